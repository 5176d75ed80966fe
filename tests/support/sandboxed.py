"""Running ``qkv check --function`` or ``--module`` on hostile students' files in tests
(issue 24, item 2; issue 26): each run is ``qkv`` in a child process with 2 GiB of address
space and a time limit (:func:`run_qkv`), so that a failure cannot take the test run down,
and the levels of isolation this machine allows (:data:`LEVELS`: ``make test`` installs
bubblewrap; ``namespaces`` is asked for by name).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkv.check._sandbox import IsolationError, choose

__all__ = [
    "HEARTBEAT",
    "LEVELS",
    "assert_nothing_outlives",
    "available",
    "leftovers",
    "one_line",
    "run_qkv",
]

# a grandchild in a session of its own that writes a heartbeat every 50 ms, for ever
HEARTBEAT = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            try:
                with open({beat!r}, "a") as f:
                    f.write(".")
            except OSError:
                pass
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.3)
"""


def available(level: str) -> bool:
    try:
        return choose(level) == level
    except IsolationError:
        return False


LEVELS = [
    pytest.param(
        level,
        marks=pytest.mark.skipif(not available(level), reason=f"no {level} isolation here"),
    )
    for level in ("bubblewrap", "namespaces")
]


def run_qkv(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``qkv ARGV`` in a child process with 2 GiB of address space and a time limit: its exit
    status, output and error. qkv itself must end normally (a signal or a traceback fails)."""
    code = (
        "import contextlib, io, json, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from qkv.cli import main\n"
        "out, err = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "    status = main(sys.argv[1:])\n"
        "print(json.dumps([status, out.getvalue(), err.getvalue()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    status, out, err = json.loads(done.stdout.splitlines()[-1])
    return int(status), str(out), str(err)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    return lines[0]


def leftovers(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (the student's file)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(name))
    return found


def assert_nothing_outlives(path: Path, beat: Path | None = None) -> None:
    assert leftovers(str(path)) == []
    if beat is not None and beat.exists():
        size = beat.stat().st_size
        time.sleep(0.5)  # ten heartbeats, were the writer alive
        assert beat.stat().st_size == size, "a process of the check still writes its heartbeat"
