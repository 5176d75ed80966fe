"""The keeper: the first process of a sandboxed run, qkv's own code, standard library only.

:mod:`~qkv.check._sandbox` starts it (inside bubblewrap where that is installed) as
``python -I -S _sandbox_keeper.py SPEC``. It ignores every signal it can (the student's
code may signal its parent), becomes a child subreaper (a descendant whose parent dies is
re-parented to the keeper, so that it stays findable), enters new user, PID, network and IPC
namespaces when the spec asks for them, and forks the runner: its own process group in the
keeper's session (``kill(0, ...)`` reaches only the runner's group), killed when the keeper
dies, with resource limits, that executes the command of the spec. When the runner
ends, or when the time limit passes, the keeper kills every process left below it and exits
with the runner's status (128 + the signal's number when a signal ended it, 124 on time-out).

In new namespaces the runner is PID 1 of its namespace: when it ends, the kernel kills every
process of the namespace, ``setsid()`` or not, and none of them can see or signal a process
outside it; the keeper itself stays outside. Without them, the keeper finds what is left by
the parent links in ``/proc`` (:func:`end_descendants`, used by the parent process too).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
from collections.abc import Iterable

__all__ = ["TIMED_OUT", "descendants", "end_descendants", "main"]

TIMED_OUT = 124
"""The keeper's exit status when the runner ran past the time limit (as ``timeout(1)``)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_NAMESPACES = _CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC
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


def enter_namespaces() -> None:
    """Move this process into new user, PID, network and IPC namespaces (its next child is
    PID 1 of the new PID namespace), keeping its own user and group ids.

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


def _start_runner(command: list[str], limits: dict[str, int], own_user_namespace: bool) -> int:
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


def _wait(pid: int, seconds: float) -> int | None:
    """The runner's exit status, or None when it runs past ``seconds``."""
    deadline = time.monotonic() + seconds
    try:
        handle: int | None = os.pidfd_open(pid)
    except OSError:  # an old kernel: poll instead
        handle = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if handle is not None:
                select.select([handle], [], [], min(left, 3600.0))
            else:
                time.sleep(min(left, 0.01))
    finally:
        if handle is not None:
            os.close(handle)


def main(argv: list[str]) -> int:
    """Run the spec ``argv[1]`` (JSON: ``command``, ``timeout``, ``limits``, ``namespaces``)."""
    spec = json.loads(argv[1])
    for number in _catchable():
        signal.signal(number, signal.SIG_IGN)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # qkv gone: so is the keeper, then the runner
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if spec["namespaces"]:
        enter_namespaces()
    runner = _start_runner(spec["command"], spec["limits"], bool(spec["namespaces"]))
    status = _wait(runner, float(spec["timeout"]))
    end_descendants(os.getpid(), also=[runner])
    if status is None:
        return TIMED_OUT
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
