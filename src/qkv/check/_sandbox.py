"""Running a student's code in a child process that qkv can always end: the sandbox of
``qkv check --function``.

:func:`run_sandboxed` runs a Python command as an autograder must run untrusted code. The
child starts in a fresh temporary folder with an environment scrubbed to what Python needs,
under a keeper (:mod:`~qkv.check._sandbox_keeper`) that ignores signals, gives the command
resource limits (CPU time, address space, processes, file size, open files) and its own
session, and kills everything left below it when the command ends or the time runs out. The
command's standard output and error go to files, of which the last few KiB are read back, so
that the verdict never waits on a pipe; its result comes back through a file that the caller
reads with a size bound (:attr:`Finished.result`) and validates.

Three levels of isolation, the strongest available by default (``isolation="auto"``):

- ``bubblewrap``: inside Debian's ``bwrap``: new user, PID, network, IPC and UTS
  namespaces, no capabilities, no further user namespaces; a read-only view of the system
  folders (``/usr``, ``/etc``, Python and the import path, the student's folder), a private
  ``/tmp`` of 64 MiB, and only the temporary folder writable. Home folders, other temporary
  files and ``/run`` (sockets) are not there. Nothing outlives the check.
- ``namespaces``: new user, PID, network and IPC namespaces entered by the keeper: no
  network, no signal to a process outside, nothing outlives the check; the files are the
  user's, readable and writable as by any program the user runs.
- ``process``: the keeper alone (a child subreaper): the process tree below it is killed at
  the end. Code that kills the keeper itself (SIGKILL) can leave a detached process running,
  and may signal any process of the user: this level contains accidents, not attacks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from qkv.check._sandbox_keeper import TIMED_OUT, end_descendants

__all__ = ["ISOLATIONS", "LEVELS", "Finished", "IsolationError", "Limits", "run_sandboxed"]

LEVELS: tuple[str, ...] = ("bubblewrap", "namespaces", "process")
"""The levels of isolation, strongest first."""
ISOLATIONS: tuple[str, ...] = ("auto", *LEVELS)
"""What a caller may ask for: ``auto`` takes the strongest level this machine allows."""

_KEEPER = Path(__file__).with_name("_sandbox_keeper.py")
_SOURCE = Path(__file__).resolve().parents[2]  # the folder that holds the qkv package
_TAIL = 4096  # bytes of standard error read back
_GRACE = 5.0  # seconds the keeper gets to clean up after the time limit
_SYSTEM = ("/usr", "/etc")
_LINKED = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # often links into /usr
_PRIVATE_TMP = 64 << 20


class IsolationError(ValueError):
    """The isolation asked for is not available here: one line that says why."""


@dataclass(frozen=True)
class Limits:
    """The resource limits of the sandboxed command (``setrlimit``)."""

    memory: int = 4 << 30
    """Address space, bytes (importing PyTorch takes about 0.7 GiB)."""
    processes: int = 64
    """Processes and threads more than the user has (the kernel does not bind root)."""
    file_size: int = 8 << 20
    """The largest file it may write, its output included, bytes."""
    open_files: int = 256


@dataclass(frozen=True)
class Finished:
    """How a sandboxed command ended.

    Attributes:
        isolation: the level it ran at, one of :data:`LEVELS`.
        status: its exit status; 128 + N when signal N ended it.
        timed_out: it ran past the time limit (and was killed).
        result: the bytes of the result file (at most ``result_limit``; more is refused
            with ``result_too_large``).
        result_too_large: the result file held more than ``result_limit`` bytes.
        stderr: the last few KiB of its standard error, decoded leniently.
    """

    isolation: str
    status: int
    timed_out: bool
    result: bytes
    result_too_large: bool
    stderr: str


def run_sandboxed(
    command: Sequence[str],
    *,
    timeout: float,
    isolation: str = "auto",
    readable: Sequence[Path] = (),
    limits: Limits = Limits(),
    result_limit: int = 4 << 20,
) -> Finished:
    """Run ``python -I`` with the arguments ``command`` in the sandbox; wait at most
    ``timeout`` seconds.

    The command finds its result file open for writing as the file descriptor given by the
    environment variable ``QKV_RESULT_FD``, and its working folder (also ``HOME`` and
    ``TMPDIR``) empty and writable. ``readable`` lists the folders it must read (the
    student's); with bubblewrap nothing else outside the system and Python is visible.

    Raises:
        IsolationError: ``isolation`` is not one of :data:`ISOLATIONS`, or that level is not
            available here.
    """
    level = choose(isolation)
    with _folder() as tmp:
        work = tmp / "work"
        work.mkdir(mode=0o700)
        with _files(tmp) as (out, err, result):
            spec = {
                "command": [sys.executable, "-I", *command],
                "timeout": timeout,
                "limits": {**asdict(limits), "cpu_seconds": _cpu_seconds(timeout)},
                "namespaces": level == "namespaces",
            }
            argv = [sys.executable, "-I", "-S", str(_KEEPER), json.dumps(spec)]
            if level == "bubblewrap":
                argv = _bubblewrap(work, readable) + argv
            mark = f"qkv-{os.getpid()}-{secrets.token_hex(8)}"
            env = {**_environment(work), "QKV_RESULT_FD": str(result), "QKV_SANDBOX": mark}
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(result,),
                cwd=work,
                env=env,
                start_new_session=True,
            )
            try:
                ended = _wait_unreaped(process.pid, timeout + _GRACE)
            finally:
                _end(process, f"QKV_SANDBOX={mark}".encode())
            status = process.returncode
            data, too_large = _read_result(result, result_limit)
            return Finished(
                isolation=level,
                status=status if status >= 0 else 128 - status,
                timed_out=not ended or status == TIMED_OUT,
                result=data,
                result_too_large=too_large,
                stderr=_tail(err),
            )


def choose(isolation: str) -> str:
    """The level that ``isolation`` means here.

    Raises:
        IsolationError: an unknown name, or a level this machine does not allow.
    """
    if isolation not in ISOLATIONS:
        raise IsolationError(
            f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}. "
            "Hint: 'auto' takes the strongest level available"
        )
    if isolation == "auto":
        return next(level for level in LEVELS if not _unavailable(level))
    why = _unavailable(isolation)
    if why:
        raise IsolationError(f"isolation {isolation!r} is not available here: {why}")
    return isolation


def _unavailable(level: str) -> str:
    """Why ``level`` cannot run here ('' when it can)."""
    if level == "bubblewrap":
        if _bwrap() is None:
            return "bwrap is not installed. Hint: 'apt install bubblewrap' (Debian, Ubuntu)"
        if not _bubblewrap_works():
            return (
                "bwrap is installed but does not run with qkv's options here (it needs "
                "bubblewrap 0.8 or later and user namespaces). Hint: upgrade bubblewrap or "
                "allow user namespaces, or use isolation 'namespaces' or 'process'"
            )
        return ""
    if level == "namespaces" and not _namespaces_work():
        return (
            "this kernel does not let this user create user namespaces. Hint: install "
            "bubblewrap, or use isolation 'process'"
        )
    return ""


def _bwrap() -> str | None:
    return shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


_BWRAP_FLAGS = (
    "--unshare-all",
    "--unshare-user",
    "--disable-userns",
    "--cap-drop",
    "ALL",
    "--die-with-parent",
    "--new-session",
)


@functools.cache
def _bubblewrap_works() -> bool:
    bwrap = _bwrap()
    if bwrap is None:
        return False
    probe = [bwrap, *_BWRAP_FLAGS, "--ro-bind", "/", "/", "--proc", "/proc", "--", "/bin/true"]
    done = subprocess.run(probe, capture_output=True, timeout=60, check=False)
    return done.returncode == 0


@functools.cache
def _namespaces_work() -> bool:
    code = "import sys; sys.path.insert(0, sys.argv[1]); import _sandbox_keeper as k; "
    code += "k.enter_namespaces()"
    probe = [sys.executable, "-I", "-S", "-c", code, str(_KEEPER.parent)]
    done = subprocess.run(probe, capture_output=True, timeout=60, check=False)
    return done.returncode == 0


def _cpu_seconds(timeout: float) -> int:
    return min(math.ceil(timeout) + 1, 2**31 - 1)


def _environment(work: Path) -> dict[str, str]:
    """What Python needs and nothing of the caller's: no tokens, keys or paths leak."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@functools.cache
def _python_folders() -> tuple[Path, ...]:
    """The folders ``python -I`` reads: its prefixes and its import path."""
    code = "import json, sys; print(json.dumps(sys.path))"
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    paths = [Path(p) for p in json.loads(done.stdout) if p]
    paths += [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    paths += [Path(sysconfig.get_paths()["stdlib"]), Path(sys.executable).parent]
    return tuple(paths)


def _bubblewrap(work: Path, readable: Sequence[Path]) -> list[str]:
    """The ``bwrap`` command line: the system read-only, ``work`` writable, nothing else."""
    bwrap = _bwrap()
    assert bwrap is not None
    args = [bwrap, *_BWRAP_FLAGS, "--size", str(_PRIVATE_TMP), "--tmpfs", "/tmp"]
    for name in _LINKED:
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    shown: set[str] = set()
    wanted = [*map(Path, _SYSTEM), *_python_folders(), _SOURCE]
    for path in [*wanted, *readable]:
        for form in (os.path.abspath(path), os.path.realpath(path)):
            if form not in shown and os.path.exists(form):
                shown.add(form)
                args += ["--ro-bind", form, form]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", str(work), str(work)]
    return [*args, "--remount-ro", "/", "--chdir", str(work), "--"]


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    """A private temporary folder, removed afterwards whatever the command left in it."""
    tmp = Path(tempfile.mkdtemp(prefix="qkv-sandbox-"))
    try:
        yield tmp
    finally:
        _remove(tmp)


def _remove(tmp: Path) -> None:
    def opened(function: Callable[[str], object], path: str, _: object) -> None:
        # a folder the command made unreadable or read-only: open it up and try again
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            if not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
            function(path)

    for _ in range(3):  # a folder opened up on one pass is emptied on the next
        if not os.path.lexists(tmp):
            return
        shutil.rmtree(tmp, onerror=opened)


@contextlib.contextmanager
def _files(tmp: Path) -> Iterator[tuple[int, int, int]]:
    """The command's standard output, standard error and result file, opened here."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fds = [os.open(tmp / name, flags, 0o600) for name in ("stdout", "stderr", "result")]
    try:
        yield fds[0], fds[1], fds[2]
    finally:
        for fd in fds:
            os.close(fd)


def _wait_unreaped(pid: int, seconds: float) -> bool:
    """Wait until the child ``pid`` ends, at most ``seconds``, without collecting it: until it
    is collected, its pid (the number of its session) cannot name another process."""
    deadline = time.monotonic() + seconds
    try:
        handle: int | None = os.pidfd_open(pid)
    except OSError:  # an old kernel: poll instead
        handle = None
    try:
        while True:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if handle is not None:
                select.select([handle], [], [], min(left, 3600.0))
            else:
                time.sleep(min(left, 0.01))
    finally:
        if handle is not None:
            os.close(handle)


def _end(process: subprocess.Popen[bytes], mark: bytes) -> None:
    """Kill the keeper, everything below it, everything left in its session and every
    process that still carries the run's mark in its environment; collect the keeper.

    The last two find, at level ``process``, what detached itself (``setsid``) and then
    killed the keeper: its children were re-parented away from the keeper's tree."""
    end_descendants(process.pid, also=[process.pid])
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        found = _scan(lambda pid, stat: _session_of(stat) == process.pid or _marked(pid, mark))
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    process.wait()


def _scan(wanted: Callable[[int, bytes], bool]) -> list[int]:
    """The visible processes (but this one) for which ``wanted(pid, stat line)`` holds."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            stat_line = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        if stat_line[stat_line.rfind(b")") + 2 :].startswith(b"Z"):
            continue  # ended; its parent collects it
        if wanted(int(name), stat_line):
            found.append(int(name))
    return found


def _session_of(stat_line: bytes) -> int:
    fields = stat_line[stat_line.rfind(b")") + 2 :].split()
    return int(fields[3]) if len(fields) > 3 else -1


def _marked(pid: int, mark: bytes) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _read_result(fd: int, limit: int) -> tuple[bytes, bool]:
    """The result file's bytes (at most ``limit``), through the descriptor opened here: the
    command cannot swap it for a link, a pipe or a device."""
    size = os.fstat(fd).st_size
    if size > limit:
        return b"", True
    return os.pread(fd, limit + 1, 0)[: limit + 1], False


def _tail(fd: int) -> str:
    size = os.fstat(fd).st_size
    data = os.pread(fd, _TAIL, max(0, size - _TAIL))
    return data.decode("utf-8", errors="replace")
