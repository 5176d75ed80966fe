"""Running a student's code in a process that qkv can always end, and that holds nothing of
qkv: the sandbox of ``qkv check --function``, ``--module`` and ``qkv grade``.

:func:`start` starts the student's process as an autograder must run untrusted code: the
runner ``_student_main.py`` and its two neighbours copied into a private read-only folder,
run by ``python -I`` in a fresh temporary folder with an environment scrubbed to what Python
needs, under a keeper (:mod:`~qkv.check._sandbox_keeper`) that ignores signals, gives the
process resource limits (CPU time, address space, processes, file size, open files) and its
own session, and kills everything left below it when the runner ends or the time runs out.
Its standard output and error go to files, of which the last few KiB are read back; qkv
talks to it over two pipes (:class:`Sandbox`: ``requests`` and ``replies``,
:mod:`~qkv.check._channel`).

Two levels of isolation, the strongest available by default (``isolation="auto"``); each
gives the student's process its own ``/tmp``, and neither lets it import qkv, see another
submission, another sandbox's files or qkv's work folders, reach a unix socket of the host,
read another process's ``/proc/PID/environ``, or outlive the check (docs/isolation.md):

- ``bubblewrap``: inside Debian's ``bwrap``: new user, PID, network, IPC and UTS
  namespaces, no capabilities, no further user namespaces; a read-only view of the system
  folders (``/usr``, ``/etc``, Python and its import path, with qkv's own package masked;
  the student's folder), a private ``/tmp`` of 64 MiB, and only the working folder
  writable.
- ``namespaces``: the keeper enters new user, mount, PID, network and IPC namespaces and
  builds the same view itself (a new root on a tmpfs, read-only bind mounts, a minimal
  ``/dev``, a fresh ``/proc``, ``pivot_root``); where the kernel refuses a step the level
  is refused.

A bare process (no namespaces) cannot keep the student's code from the user's files and
processes: qkv does not offer it (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import secrets
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

from qkv.check._sandbox_keeper import TIMED_OUT, end_descendants, wait_until

__all__ = [
    "ISOLATIONS",
    "LEVELS",
    "STARTUP_SECONDS",
    "Finished",
    "IsolationError",
    "Limits",
    "Sandbox",
    "start",
]

LEVELS: tuple[str, ...] = ("bubblewrap", "namespaces")
"""The levels of isolation, strongest first."""
ISOLATIONS: tuple[str, ...] = ("auto", *LEVELS)
"""What a caller may ask for: ``auto`` takes the strongest level this machine allows."""
STARTUP_SECONDS = 120.0
"""How long the student's process may take to start (Python, NumPy and torch imported)
before the time of the student's code begins: generous, for a loaded machine."""

_KEEPER = Path(__file__).with_name("_sandbox_keeper.py")
_RUNNER = ("_student_main.py", "_student_file.py", "_module_adapt.py")
"""The files of the student's process: the runner and its two neighbours (no qkv)."""
_TAIL = 4096  # bytes of standard error read back
_SYSTEM = ("/usr", "/etc")
_LINKED = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # often links into /usr
_PRIVATE_TMP = 64 << 20
_DEVICES = ("null", "zero", "random", "urandom")
_QKV_ENTRY = re.compile(r"(qkv|qkv[-.].*|.*editable.*qkv.*)", re.IGNORECASE)
"""Names in an import folder that belong to an installed qkv: the package, its metadata,
an editable install's ``.pth`` file and finder."""


class IsolationError(ValueError):
    """The isolation asked for is not available here: one line that says why."""


@dataclass(frozen=True)
class Limits:
    """The resource limits of the student's process (``setrlimit``)."""

    memory: int = 4 << 30
    """Address space, bytes (importing PyTorch takes about 0.7 GiB)."""
    processes: int = 64
    """Processes and threads more than the user has (the kernel does not bind root)."""
    file_size: int = 8 << 20
    """The largest file it may write, its output included, bytes."""
    open_files: int = 256


@dataclass(frozen=True)
class Finished:
    """How the student's process ended.

    Attributes:
        isolation: the level it ran at, one of :data:`LEVELS`.
        status: its exit status; 128 + N when signal N ended it; -1 when it was still
            running and qkv ended it.
        timed_out: the keeper's hard limit ended it.
        stderr: the last few KiB of its standard error, decoded leniently.
    """

    isolation: str
    status: int
    timed_out: bool
    stderr: str


@dataclass(frozen=True)
class Sandbox:
    """A started student's process: qkv writes requests to ``requests`` and reads replies
    from ``replies``; ``ended`` becomes readable when the process ends (a pidfd, or None on
    an old kernel); :meth:`finish` waits for its end and says how it ended."""

    isolation: str
    requests: int
    replies: int
    ended: int | None
    process: subprocess.Popen[bytes]
    stderr_fd: int

    def finish(self, seconds: float = 10.0) -> Finished:
        """How it ended, after waiting at most ``seconds`` for the end."""
        done = _wait_unreaped(self.process.pid, seconds)
        status = -1
        if done:
            self.process.wait()
            code = self.process.returncode
            status = code if code >= 0 else 128 - code
        return Finished(self.isolation, status, status == TIMED_OUT, _tail(self.stderr_fd))


def cpu_seconds(timeout: float) -> int:
    """The CPU time the student's process may use: its start and the student's time."""
    return min(math.ceil(STARTUP_SECONDS + timeout) + 1, 2**31 - 1)


@contextlib.contextmanager
def start(
    *,
    timeout: float,
    isolation: str = "auto",
    readable: Sequence[Path] = (),
    limits: Limits = Limits(),
    torch: bool = True,
) -> Iterator[Sandbox]:
    """Start the student's process (the runner of :data:`_RUNNER`) in the sandbox; end it,
    and everything it started, when the block ends. The keeper's hard limit is the start-up
    bound plus ``timeout`` (qkv measures the student's time itself). ``readable`` lists the
    folders it must read (the student's); nothing else outside the system and Python is
    visible. With ``torch``, the runner imports torch before it says it is ready (about
    1.5 s, not counted in the student's time); without, a student's code that imports it
    pays for it.

    Raises:
        IsolationError: ``isolation`` is not one of :data:`ISOLATIONS`, or that level is not
            available here.
    """
    level = choose(isolation)
    with _folder() as tmp:
        work, runner = tmp / "work", tmp / "runner"
        work.mkdir(mode=0o700)
        _copy_runner(runner)
        limit = STARTUP_SECONDS + timeout
        command = [
            sys.executable, "-I", str(runner / _RUNNER[0]), "{requests}", "{replies}",
            "torch" if torch else "-",
        ]  # fmt: skip
        with _files(tmp) as (out, err):
            child_in, requests = os.pipe()
            replies, child_out = os.pipe()
            opened = [child_in, requests, replies, child_out]
            try:
                command[-3:-1] = [str(child_in), str(child_out)]
                plan = _root_plan(tmp / "root", work, [runner, *readable])
                spec = {
                    "command": command,
                    "timeout": limit,
                    "limits": {**asdict(limits), "cpu_seconds": cpu_seconds(timeout)},
                    "namespaces": level == "namespaces",
                    "root": plan if level == "namespaces" else None,
                }
                keeper = _KEEPER
                if level == "bubblewrap":  # the keeper runs inside: a copy of its own
                    keeper = _copy_keeper(tmp / "keeper")
                argv = [sys.executable, "-I", "-S", str(keeper), json.dumps(spec)]
                if level == "bubblewrap":
                    argv = _bubblewrap(work, [runner, keeper.parent, *readable]) + argv
                mark = f"qkv-{os.getpid()}-{secrets.token_hex(8)}"
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=(child_in, child_out),
                    cwd=work,
                    env={**_environment(work), "QKV_SANDBOX": mark},
                    start_new_session=True,
                )
                for fd in (child_in, child_out):  # the child's ends: only the child holds them
                    opened.remove(fd)
                    os.close(fd)
                try:
                    handle: int | None = os.pidfd_open(process.pid)
                except OSError:  # an old kernel: the pipe's end of file says it
                    handle = None
                try:
                    yield Sandbox(level, requests, replies, handle, process, err)
                finally:
                    _end(process, f"QKV_SANDBOX={mark}".encode())
                    if handle is not None:
                        os.close(handle)
            finally:
                for fd in opened:
                    os.close(fd)


def _copy_keeper(folder: Path) -> Path:
    """The keeper's file, copied into a folder of its own, read-only (qkv's source is not
    in the sandbox)."""
    folder.mkdir(mode=0o700)
    shutil.copyfile(_KEEPER, folder / _KEEPER.name)
    os.chmod(folder / _KEEPER.name, 0o444)
    os.chmod(folder, 0o555)
    return folder / _KEEPER.name


def _copy_runner(runner: Path) -> None:
    """The runner's files, copied into a folder of their own, read-only."""
    runner.mkdir(mode=0o700)
    here = Path(__file__).parent
    for name in _RUNNER:
        shutil.copyfile(here / name, runner / name)
        os.chmod(runner / name, 0o444)
    os.chmod(runner, 0o555)


def choose(isolation: str) -> str:
    """The level that ``isolation`` means here.

    Raises:
        IsolationError: an unknown name, or a level this machine does not allow.
    """
    if isolation == "process":
        raise IsolationError(
            "isolation 'process' is not offered for students' code: a process without "
            "namespaces can read and write your files and reach your other processes "
            "(docs/isolation.md). Hint: 'apt install bubblewrap', or isolation 'namespaces'"
        )
    if isolation not in ISOLATIONS:
        raise IsolationError(
            f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}. "
            "Hint: 'auto' takes the strongest level available"
        )
    if isolation == "auto":
        reasons = []
        for level in LEVELS:
            why = _unavailable(level)
            if not why:
                return level
            reasons.append(f"{level}: {why.split('. Hint:')[0]}")
        raise IsolationError(
            f"no isolation for students' code is available here ({'; '.join(reasons)}). "
            "Hint: 'apt install bubblewrap' (Debian, Ubuntu)"
        )
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
                "allow user namespaces, or use isolation 'namespaces'"
            )
        return ""
    why = _namespaces_refused()
    if why:
        return (
            "this kernel does not let this user build a private root in new user, mount "
            f"and PID namespaces ({why}). Hint: install bubblewrap ('apt install bubblewrap')"
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
def _namespaces_refused() -> str:
    """'' when the keeper builds its private root here, else the kernel's last words."""
    with _folder() as tmp:
        work = tmp / "work"
        work.mkdir(mode=0o700)
        code = "import os; os.listdir('/proc'); open('/dev/null', 'w').write('x')"
        spec = {
            "command": [sys.executable, "-I", "-S", "-c", code],
            "timeout": 60,
            "limits": {**asdict(Limits()), "cpu_seconds": 60},
            "namespaces": True,
            "root": _root_plan(tmp / "root", work, []),
        }
        argv = [sys.executable, "-I", "-S", str(_KEEPER), json.dumps(spec)]
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=90, check=False, cwd=work, text=True,
                env=_environment(work),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return "the trial did not end"
        if done.returncode == 0:
            return ""
        lines = done.stderr.strip().splitlines() or [f"status {done.returncode}"]
        return lines[-1].removeprefix("qkv sandbox: ")[:200]


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
def _python_folders() -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """The folders ``python -I`` reads (its prefixes and its import path), but those that
    hold qkv's source; and the entries of an installed qkv in them, to be masked."""
    code = "import json, sys; print(json.dumps(sys.path))"
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    path = [Path(p) for p in json.loads(done.stdout) if p]
    folders = [*path, Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    folders += [Path(sysconfig.get_paths()["stdlib"]), Path(sys.executable).parent]
    kept, masked = [], []
    for folder in folders:
        site = folder.name in ("site-packages", "dist-packages")
        if (folder / "qkv").is_dir() and not site:
            continue  # a source folder (an editable install's): not in the sandbox at all
        kept.append(folder)
        if folder in path and folder.is_dir():
            with contextlib.suppress(OSError):
                masked += [e for e in folder.iterdir() if _QKV_ENTRY.fullmatch(e.name)]
    return tuple(kept), tuple(masked)


def _visible(paths: Sequence[Path]) -> list[str]:
    """Each path as written and as resolved, once, those that exist."""
    shown: list[str] = []
    for path in paths:
        for form in (os.path.abspath(path), os.path.realpath(path)):
            if form not in shown and os.path.exists(form):
                shown.append(form)
    return shown


def _masks() -> tuple[list[str], list[str]]:
    """The folders and the files of an installed qkv, as seen in the sandbox."""
    folders: list[str] = []
    files: list[str] = []
    for entry in _python_folders()[1]:
        for form in _visible([entry]):
            (folders if os.path.isdir(form) else files).append(form)
    return folders, files


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
    system = _visible([*map(Path, _SYSTEM), *_python_folders()[0]])
    for form in [*system, *(f for f in _visible(readable) if f not in system)]:
        args += ["--ro-bind", form, form]
    folders, files = _masks()
    for folder in folders:
        args += ["--tmpfs", folder, "--remount-ro", folder]
    for file in files:
        args += ["--ro-bind", "/dev/null", file]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", str(work), str(work)]
    return [*args, "--remount-ro", "/", "--chdir", str(work), "--"]


def _root_plan(base: Path, work: Path, readable: Sequence[Path]) -> dict[str, object]:
    """What the keeper mounts in its private root (level ``namespaces``): the system and
    Python read-only, a private /tmp, the student's and the runner's folders read-only,
    ``work`` writable, an installed qkv masked, a minimal /dev, a fresh /proc."""
    base.mkdir(mode=0o700)
    links = [[os.readlink(name), name] for name in _LINKED if os.path.islink(name)]
    linked = [name for name in _LINKED if os.path.isdir(name) and not os.path.islink(name)]
    system = _visible([*map(Path, _SYSTEM), *map(Path, linked), *_python_folders()[0]])
    folders, files = _masks()
    return {
        "base": str(base),
        "links": links,
        "system": system,
        "tmp_size": _PRIVATE_TMP,
        "readable": [f for f in _visible(readable) if f not in system],
        "writable": [str(work)],
        "mask_folders": folders,
        "mask_files": files,
        "devices": [f"/dev/{name}" for name in _DEVICES],
        "chdir": str(work),
    }


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
def _files(tmp: Path) -> Iterator[tuple[int, int]]:
    """The process's standard output and error, opened here (outside its view)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fds = [os.open(tmp / name, flags, 0o600) for name in ("stdout", "stderr")]
    try:
        yield fds[0], fds[1]
    finally:
        for fd in fds:
            os.close(fd)


def _wait_unreaped(pid: int, seconds: float) -> bool:
    """Wait until the child ``pid`` ends, at most ``seconds``, without collecting it: until it
    is collected, its pid (the number of its session) cannot name another process."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT

    def ended() -> bool | None:
        return True if os.waitid(os.P_PID, pid, flags) is not None else None

    return wait_until(pid, seconds, ended) is not None


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


def _tail(fd: int) -> str:
    size = os.fstat(fd).st_size
    data = os.pread(fd, _TAIL, max(0, size - _TAIL))
    return data.decode("utf-8", errors="replace")
