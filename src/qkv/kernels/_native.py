"""Kernels in C, built by the machine's C compiler at first use and loaded with ``ctypes``.

Some loops cannot be written fast with PyTorch's operations: a decode step must stream the
KV cache once, and a matrix product with 4 rows packs its operand and runs far below the
memory's speed. Such a loop lives in a C file of this package (``_decode.c``). The first
call builds it with ``cc -O3 -march=native`` into a cache folder (:func:`_cache_folder`:
``~/.cache/qkv/native`` by default), under a name that hashes the source, the flags, the
compiler and the processor; later calls and processes load the built library.

Without a compiler, or with ``QKV_NATIVE=0``, :func:`library` returns None and the callers
run their PyTorch path, which computes the same function (more slowly); :func:`why_not`
says why. The build writes a temporary file and renames it, so a failed or concurrent
build never leaves a half-written library behind, and a library (or folder) that another
user could have written is not loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["FLAGS", "library", "why_not"]

_VERSION_SECONDS, _BUILD_SECONDS = 30.0, 120.0
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread", "-fno-math-errno")
_lock = threading.Lock()
_reasons: dict[str, str] = {}


def _cache_folder() -> Path:
    """``$QKV_CACHE_DIR/native``, else ``$XDG_CACHE_HOME/qkv/native``, else
    ``~/.cache/qkv/native``."""
    own, shared = os.environ.get("QKV_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME")
    if own:
        return Path(own) / "native"
    return (Path(shared) if shared else Path.home() / ".cache") / "qkv" / "native"


def _processor() -> str:
    """The processor's model and features (``-march=native`` builds for them)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """The built ``<name>.c`` of this folder, loaded; None where it cannot be built.

    Example:
        >>> lib = library("_decode")
        >>> lib is None or hasattr(lib, "qkv_decode_f32")
        True
    """
    if os.environ.get("QKV_NATIVE", "1").strip() == "0":
        _reasons[name] = "QKV_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _reasons[name] = "no C compiler (cc) on PATH"
        return None
    source = (Path(__file__).parent / f"{name}.c").read_bytes()
    try:
        version = _run([compiler, "--version"], _VERSION_SECONDS).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        _reasons[name] = f"{compiler} --version failed: {_said(error)}"
        return None
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), version, _processor().encode()])
    ).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"{name}-{key}.so"
    with _lock:
        if not target.exists():
            failure = _build(compiler, name, source, folder, target)
            if failure:
                _reasons[name] = failure
                return None
        unsafe = _unsafe(target)
        if unsafe:
            _reasons[name] = unsafe
            return None
        try:
            return ctypes.CDLL(str(target))
        except OSError as error:
            _reasons[name] = f"loading the built library failed: {error}"
            return None


def _build(compiler: str, name: str, source: bytes, folder: Path, target: Path) -> str:
    """Build ``source`` into ``target`` (renamed into place); '' or what went wrong."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as work:
            c_file, built = Path(work) / f"{name}.c", Path(work) / f"{name}.so"
            c_file.write_bytes(source)
            done = _run([compiler, *FLAGS, "-o", str(built), str(c_file), "-lm"], _BUILD_SECONDS)
            if done.returncode != 0:
                said = done.stderr.decode(errors="replace").replace(f"{work}/", "")
                lines = said.strip().splitlines()
                return f"{compiler} failed: {lines[-1] if lines else done.returncode}"
            built.chmod(0o755)  # whatever the umask: only its owner may write it
            os.replace(built, target)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"building {name}.c failed: {_said(error)}"
    return ""


def _run(argv: list[str], seconds: float) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` in a session of its own; past ``seconds`` the whole group is killed
    (the compiler's own children too: cc1, as, ld) and TimeoutExpired raised."""
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _said(error: BaseException) -> str:
    """What went wrong, without the build's temporary folder."""
    if isinstance(error, subprocess.TimeoutExpired):
        return f"no answer within {error.timeout:g} s (stopped)"
    return getattr(error, "strerror", None) or str(error)


def _unsafe(built: Path) -> str:
    """Why loading ``built`` would run code another user could have put there ('' if it
    and its folder are ours and only we may write them)."""
    if not hasattr(os, "getuid"):
        return ""
    for path in (built, built.parent):
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return (
                f"{path} is not only writable by this user; not loaded. Hint: point "
                "QKV_CACHE_DIR to a folder of your own."
            )
    return ""


def why_not(name: str) -> str:
    """Why :func:`library` gave None for ``name`` ('' when it did not).

    Example:
        >>> why_not("_decode") in ("", "QKV_NATIVE=0") or why_not("_decode") != ""
        True
    """
    return _reasons.get(name, "")
