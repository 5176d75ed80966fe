"""The keeper: the first process of a sandboxed run, qkv's own code, standard library only.

:mod:`~qkv.check._sandbox` starts it (inside bubblewrap where that is installed) as
``python -I -S _sandbox_keeper.py SPEC``. It ignores every signal it can (the student's
code may signal its parent), becomes a child subreaper (a descendant whose parent dies is
re-parented to the keeper, so that it stays findable), enters new user, mount, PID, network
and IPC namespaces when the spec asks for them, and forks the runner: its own process group
in the keeper's session (``kill(0, ...)`` reaches only the runner's group), killed when the
keeper dies, with resource limits, that executes the command of the spec. When the runner
ends, or when the time limit passes, the keeper kills every process left below it and exits
with the runner's status (128 + the signal's number when a signal ended it, 124 on time-out).

In new namespaces (level ``namespaces``) the runner is PID 1 of its namespace: when it ends,
the kernel kills every process of the namespace, ``setsid()`` or not, and none of them can
see or signal a process outside it; the keeper itself stays outside. Before it executes the
command, the runner builds its own root (:func:`build_root`, the spec's ``root``): a mount
namespace of its own with every mount private, a tmpfs as the new root, read-only bind
mounts of the system, Python, the student's and the runner's folders, the working folder
writable, a private ``/tmp``, a minimal ``/dev``, a fresh ``/proc`` (mounted by PID 1 of the
new PID namespace), then ``pivot_root`` and the old root detached; then it drops every
capability. Without namespaces (bubblewrap's own), the keeper finds what is left by the
parent links in ``/proc`` (:func:`end_descendants`, used by the parent process too).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["TIMED_OUT", "build_root", "descendants", "end_descendants", "main", "wait_until"]

_T = TypeVar("_T")

TIMED_OUT = 124
"""The keeper's exit status when the runner ran past the time limit (as ``timeout(1)``)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_NAMESPACES = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_KEPT_FLAGS = 1 | 2 | 4 | 8 | 1024 | 2048 | 4096  # rdonly nosuid nodev noexec *atime: locked
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "amd64": 155, "aarch64": 41, "arm64": 41}  # syscall numbers
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECURE_NOROOT = 0x1 | 0x2  # SECBIT_NOROOT and its lock: uid 0 gets no capability at exec
_LIMITS = {
    "cpu_seconds": resource.RLIMIT_CPU,
    "memory": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_size": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _fail(what: str) -> None:
    error = ctypes.get_errno()
    raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    libc = _libc()
    encoded = [None if x is None else x.encode() for x in (source, target, fstype, data or None)]
    if libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]) != 0:
        _fail(f"mount {target}")


def _bind(root: str, path: str, *, writable: bool) -> None:
    """``path`` bind-mounted at the same place under ``root``, read-only unless ``writable``."""
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "a", encoding="ascii"):
            pass
    _mount(path, target, None, _MS_BIND | _MS_REC)
    if not writable:  # the flags the kernel locked on the original mount are kept
        kept = os.statvfs(target).f_flag & _KEPT_FLAGS
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)


def build_root(plan: dict[str, Any]) -> None:
    """Enter a mount namespace of this process's own and make ``plan``'s view its root
    (see the module's help); the current folder becomes ``plan["chdir"]``.

    Raises:
        OSError: a step the kernel refuses, named.
    """
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        _fail("unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    root = plan["base"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for target, name in plan["links"]:
        os.symlink(target, root + name)
    # the private /tmp first: Python, its packages or the student's folder may live below
    # /tmp (a virtual environment made there), and their binds go on top of it
    os.makedirs(root + "/tmp", exist_ok=True)
    tmp_flags = _MS_NOSUID | _MS_NODEV
    _mount("tmpfs", root + "/tmp", "tmpfs", tmp_flags, f"size={plan['tmp_size']},mode=1777")
    for path in plan["system"]:
        _bind(root, path, writable=False)
    for path in plan["readable"]:
        _bind(root, path, writable=False)
    for path in plan["writable"]:
        _bind(root, path, writable=True)
    for path in plan["mask_folders"]:
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k")
    for path in plan["mask_files"]:
        if os.path.exists(root + path):
            _mount("/dev/null", root + path, None, _MS_BIND)
    os.makedirs(root + "/dev", exist_ok=True)
    for device in plan["devices"]:
        _bind(root, device, writable=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    number = _PIVOT_ROOT.get(platform.machine().lower())
    if number is None:
        raise OSError(0, f"pivot_root: no system call number known for {platform.machine()}")
    os.chdir(root)
    if libc.syscall(ctypes.c_long(number), b".", b".") != 0:
        _fail("pivot_root")
    if libc.umount2(b".", _MNT_DETACH) != 0:  # the old root, stacked below the new one
        _fail("umount the old root")
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(plan["chdir"])


def _drop_capabilities() -> None:
    """No capability now or after ``exec``, even as uid 0 of the namespace; no new ones."""
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as file:
            last = int(file.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap)
    if _libc().prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
        pass  # a kernel before ambient capabilities has none to clear
    _prctl(_PR_SET_SECUREBITS, _SECURE_NOROOT)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def enter_namespaces() -> None:
    """Move this process into new user, mount, PID, network and IPC namespaces (its next
    child is PID 1 of the new PID namespace), keeping its own user and group ids; every
    mount is private (nothing done here reaches the machine's mounts).

    Raises:
        OSError: the kernel refuses (user namespaces disabled, or a restricting policy).
    """
    uid, gid = os.getuid(), os.getgid()
    if _libc().unshare(_NAMESPACES) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    maps = (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1"))
    for name, text in maps:
        with open(f"/proc/self/{name}", "w", encoding="ascii") as file:
            file.write(text)
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)


def _parents() -> dict[int, int]:
    """Every visible process and its parent, from ``/proc/PID/stat``."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                stat = file.read()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            found[int(name)] = int(fields[1])
    return found


def descendants(root: int) -> list[int]:
    """The processes below ``root`` (children, their children, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _reap() -> None:
    """Collect every ended child of this process (zombies would stay in /proc)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(root: int, *, also: Iterable[int] = (), seconds: float = 10.0) -> None:
    """Kill (SIGKILL) every process below ``root`` and the pids of ``also``, again and again
    until none is left: a process that forks while it is being killed is found in the next
    round. Children of this process are reaped. Gives up after ``seconds``."""
    deadline = time.monotonic() + seconds
    extra = list(also)
    while True:
        found = descendants(root) + extra
        extra = []
        if not found or time.monotonic() > deadline:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if root == os.getpid():
            _reap()
        time.sleep(0.002)


def _limit(name: str, value: int) -> None:
    which = _LIMITS[name]
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _user_tasks() -> int:
    """How many tasks (threads included) of this user are visible: the kernel counts them
    against ``RLIMIT_NPROC`` outside a new user namespace."""
    uid, count = str(os.getuid()), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", encoding="ascii", errors="replace") as file:
                fields = dict(line.split(":", 1) for line in file if ":" in line)
        except OSError:
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def _start_runner(
    command: list[str], limits: dict[str, int], own_user_namespace: bool, root: Any
) -> int:
    if not own_user_namespace:
        limits = {**limits, "processes": limits["processes"] + _user_tasks()}
    pid = os.fork()
    if pid:
        return pid
    try:  # the runner: its own process group, dies with the keeper, limited, then the command
        os.setpgid(0, 0)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        for number in _catchable():
            signal.signal(number, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if root is not None:
            build_root(root)
            _drop_capabilities()
        for name, value in limits.items():
            _limit(name, value)
        os.execv(command[0], command)
    except BaseException as exc:  # nothing of the runner's may go on in the keeper's code
        os.write(2, f"qkv sandbox: could not start the runner: {exc}\n".encode())
    os._exit(127)


def _catchable() -> list[int]:
    return [
        s
        for s in signal.valid_signals()
        if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)
    ]


def wait_until(pid: int, seconds: float, ended: Callable[[], _T | None]) -> _T | None:
    """What ``ended()`` says once it says something (not None), asked again each time the
    process ``pid`` changes state; None when ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    try:
        handle: int | None = os.pidfd_open(pid)
    except OSError:  # an old kernel: poll instead
        handle = None
    try:
        while (answer := ended()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if handle is not None:
                select.select([handle], [], [], min(left, 3600.0))
            else:
                time.sleep(min(left, 0.01))
        return answer
    finally:
        if handle is not None:
            os.close(handle)


def _wait(pid: int, seconds: float) -> int | None:
    """The runner's exit status, or None when it runs past ``seconds``."""

    def ended() -> int | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if done else None

    return wait_until(pid, seconds, ended)


def main(argv: list[str]) -> int:
    """Run the spec ``argv[1]`` (JSON: ``command``, ``timeout``, ``limits``, ``namespaces``)."""
    spec = json.loads(argv[1])
    for number in _catchable():
        signal.signal(number, signal.SIG_IGN)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # qkv gone: so is the keeper, then the runner
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if spec["namespaces"]:
        enter_namespaces()
    root = spec.get("root") if spec["namespaces"] else None
    runner = _start_runner(spec["command"], spec["limits"], bool(spec["namespaces"]), root)
    status = _wait(runner, float(spec["timeout"]))
    end_descendants(os.getpid(), also=[runner])
    if status is None:
        return TIMED_OUT
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
