"""``qkv check --function`` runs a student's file as a grader must run hostile code (issue 24,
item 2): whatever the file does at import (read the environment, write outside its folder,
fork, ``setsid``, print 1.5 GB, signal its parent), qkv survives and reports a verdict or one
line, nothing the file started outlives the check, and under bubblewrap nothing outside the
temporary folder changes.

Each hostile check runs ``qkv`` in a child process with 2 GiB of address space and a time
limit (:func:`run_qkv`), so that a failure cannot take the test run down. Every level of
isolation this machine allows is tested: ``make test`` installs bubblewrap, and the levels
without it (``namespaces``, ``process``) are asked for by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv.check import FunctionError, check_function
from qkv.check import _sandbox as sandbox
from qkv.check._function_file import outcomes_from
from qkv.check._sandbox import IsolationError, choose
from qkv.cli import main
from qkv.testing import check_attention

RIGHT = """
import numpy as np


def attention(Q, K, V, mask=None):
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -1e9)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w = w / w.sum(axis=-1, keepdims=True)
    return w @ V, w
"""

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
    for level in ("bubblewrap", "namespaces", "process")
]


def student(tmp_path: Path, code: str, name: str = "student") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "attention.py"
    path.write_text(textwrap.dedent(code) + RIGHT, encoding="utf-8")
    return path


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


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_a_hostile_file_with_a_right_function_gets_its_verdict_and_nothing_outlives(
    tmp_path: Path, level: str
) -> None:
    """Forks a child that holds its output open for 10 minutes (before: "did not finish
    within 60 s"), starts a ``setsid`` grandchild that beats for ever (before: it outlived
    the check), sends SIGTERM to its parent and to every ancestor it can find (before: qkv
    was killed), and prints 1.5 GB (before: qkv held it all in memory)."""
    beat = tmp_path / "heartbeat"
    code = HEARTBEAT.format(beat=str(beat)) + textwrap.dedent(f"""
        import os, signal, sys, time
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        ancestors, pid = [], os.getppid()
        while pid > 1 and {level != "process"!r}:  # at level process qkv is within reach
            ancestors.append(pid)
            try:
                stat = open(f"/proc/{{pid}}/stat", "rb").read()
            except OSError:
                break
            pid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        for pid in ancestors or [os.getppid()]:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        for _ in range(1500):
            sys.stdout.write("x" * 1_000_000)
        print("done", file=sys.stderr)
    """)
    path = student(tmp_path, code)
    status, out, err = run_qkv(
        [
            "check",
            "--function",
            f"{path}:attention",
            "--isolation",
            level,
            "--timeout",
            "60",
            "-f",
            "json",
        ]
    )
    assert (status, err) == (0, "")
    assert json.loads(out) == {"ok": True, "findings": [], "isolation": level}
    assert_nothing_outlives(path, beat)


@pytest.mark.parametrize("level", LEVELS)
def test_a_file_that_kills_its_parent_is_one_line_and_nothing_outlives(
    tmp_path: Path, level: str
) -> None:
    beat = tmp_path / "heartbeat"
    code = HEARTBEAT.format(beat=str(beat)) + "os.kill(os.getppid(), 9)\ntime.sleep(2)\n"
    path = student(tmp_path, code)
    status, out, err = run_qkv(
        ["check", "--function", f"{path}:attention", "--isolation", level, "--timeout", "60"]
    )
    if status == 2:  # the keeper was killed (bubblewrap, process): the run ended unfinished
        assert "SIGKILL" in one_line(err) and out == ""
    else:  # namespaces: the runner is the namespace's PID 1 and sees no parent to kill
        assert status == 0 and "No mistake found" in out
    assert_nothing_outlives(path, beat)


@pytest.mark.parametrize("level", LEVELS)
def test_the_environment_is_scrubbed(tmp_path: Path, level: str) -> None:
    path = student(tmp_path, "import os\nraise RuntimeError(repr(dict(os.environ)))\n")
    status, out, err = run_qkv(
        ["check", "--function", f"{path}:attention", "--isolation", level],
        env={"QKV_TEST_SECRET": "hunter2-token"},
    )
    line = one_line(err)
    assert status == 2 and out == ""
    assert "importing it raised RuntimeError" in line
    assert "hunter2" not in line and "QKV_TEST_SECRET" not in line and "'PATH'" in line


@pytest.mark.skipif(not available("bubblewrap"), reason="bubblewrap is not installed here")
def test_under_bubblewrap_nothing_outside_the_temporary_folder_changes(tmp_path: Path) -> None:
    """The file tries to overwrite and delete the teacher's files next to it, to write in
    the teacher's home and in /tmp, and to reach the network. Writing next to its file, in
    the home or to the network must fail (the function is made wrong if one succeeds);
    /tmp is private to the sandbox. Nothing outside changes."""
    home = Path.home()
    private = [tmp_path / "pwned", Path("/tmp") / f"qkv-pwned-{os.getpid()}"]
    code = textwrap.dedent(f"""
        import os, socket
        done = []
        here = os.path.dirname(os.path.abspath(__file__))
        for target in [os.path.join(here, "canary.txt"), {str(home / "pwned")!r}]:
            try:
                with open(target, "w") as f:
                    f.write("pwned")
                done.append(target)
            except OSError:
                pass
        for target in [os.path.join(here, "canary.txt"), here]:
            try:
                os.remove(target) if target.endswith(".txt") else os.rmdir(target)
                done.append(target)
            except OSError:
                pass
        try:
            socket.create_connection(("1.1.1.1", 80), timeout=2)
            done.append("network")
        except OSError:
            pass
        if done:
            raise RuntimeError(f"it could: {{done}}")
        for target in {[str(p) for p in private]!r}:
            with open(target, "w") as f:  # the sandbox's own /tmp
                f.write("pwned")
    """)
    path = student(tmp_path, code)
    (path.parent / "canary.txt").write_text("the teacher's", encoding="utf-8")
    before = sorted(p.name for p in path.parent.iterdir())
    status, out, err = run_qkv(
        ["check", "--function", f"{path}:attention", "--isolation", "bubblewrap"]
    )
    assert (status, err) == (0, ""), err
    assert "isolation: bubblewrap" in out
    assert (path.parent / "canary.txt").read_text(encoding="utf-8") == "the teacher's"
    assert sorted(p.name for p in path.parent.iterdir()) == before
    assert not any(p.exists() for p in [*private, home / "pwned"])


def test_writing_past_the_file_size_limit_is_one_line(tmp_path: Path) -> None:
    path = student(tmp_path, "import os\nfor _ in range(20):\n    os.write(1, b'x' * 10**6)\n")
    status, _, err = run_qkv(["check", "--function", f"{path}:attention"])
    assert status == 2 and "File too large" in one_line(err)


def test_a_student_s_exception_text_reaches_the_terminal_escaped(tmp_path: Path) -> None:
    path = student(tmp_path, "raise ValueError('\\x1b]0;PWNED\\x07\\x1b[2J\\u202e')\n")
    status, _, err = run_qkv(["check", "--function", f"{path}:attention"])
    line = one_line(err)
    assert status == 2 and "\x1b" not in line and "\u202e" not in line and "\x07" not in line
    assert "ValueError: \\x1b]0;PWNED\\x07\\x1b[2J\\u202e" in line


def test_an_exception_raised_in_this_process_is_escaped_too() -> None:
    class WeirdError(Exception):
        pass

    WeirdError.__name__ = "Weird\x1b[31m"

    def attention(Q: object, K: object, V: object) -> object:
        raise WeirdError("line one\nline two \x1b]8;;http://x\x07")

    with pytest.raises(FunctionError) as caught:
        check_function(attention, array="numpy")
    text = str(caught.value)
    assert "\x1b" not in text and "\n" not in text and "\x07" not in text
    assert "Weird\\x1b[31m: line one line two \\x1b]8;;http://x\\x07" in text


@pytest.mark.parametrize(
    "forged",
    [
        "os.write(fd, b'[' * 100000)",
        'os.write(fd, b\'{"array": "numpy", "with_mask": true, "outcomes": [1, 2]}\')',
        "os.write(fd, b'x' * (5 << 20))",
        'os.write(fd, b\'{"error": "\\\\u001b[2J forged"}\')',
    ],
    ids=["deep", "wrong-fields", "too-large", "escape"],
)
def test_a_forged_result_file_is_one_line(tmp_path: Path, forged: str) -> None:
    code = f"import os\nfd = int(os.environ['QKV_RESULT_FD'])\n{forged}\nos._exit(0)\n"
    path = student(tmp_path, code)
    status, _, err = run_qkv(["check", "--function", f"{path}:attention"])
    line = one_line(err)
    assert status == 2 and "\x1b" not in line
    assert "forged" in line or "not what qkv's runner writes" in line


def test_each_field_of_the_result_is_checked() -> None:
    good: dict[str, Any] = {"context": [[1.0, 2.0]], "weights": None, "error": None}
    cases: list[dict[str, Any]] = [
        {"array": "numpy; rm -rf", "with_mask": False, "outcomes": [good] * 4},
        {"array": "numpy", "with_mask": "yes", "outcomes": [good] * 4},
        {"array": "numpy", "with_mask": False, "outcomes": [good] * 3},
        {"array": "numpy", "with_mask": False, "outcomes": [{**good, "x": 1}] * 4},
        {"array": "numpy", "with_mask": False, "outcomes": [{**good, "error": 3}] * 4},
        {"array": "numpy", "with_mask": False, "outcomes": [{**good, "context": [[1], 2]}] * 4},
        {"array": "numpy", "with_mask": False, "outcomes": [{**good, "context": 1.0}] * 4},
        {"array": "numpy", "with_mask": False, "outcomes": [{**good, "context": [0] * 10**6}] * 4},
    ]
    for data in cases:
        with pytest.raises(FunctionError, match="not what qkv's runner writes"):
            outcomes_from(data, "attention", False, "f.py:attention")
    used, with_mask, outcomes = outcomes_from(
        {"array": "numpy", "with_mask": False, "outcomes": [good] * 4}, "attention", False, "t"
    )
    assert (used, with_mask, len(outcomes)) == ("numpy", False, 4)
    np.testing.assert_array_equal(outcomes[0].context, [[1.0, 2.0]])


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "-inf", "soon"])
def test_timeout_must_be_a_positive_finite_number(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = student(tmp_path, "")
    assert main(["check", "--function", f"{path}:attention", "--timeout", value]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--timeout" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="timeout must be a"):
        check_attention(f"{path}:attention", timeout=float(value) if value != "soon" else value)  # type: ignore[arg-type]


def test_without_bubblewrap_auto_takes_the_next_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    with pytest.raises(IsolationError, match=r"bwrap is not installed.*apt install bubblewrap"):
        check_attention(f"{student(tmp_path, '')}:attention", isolation="bubblewrap")
    report = check_attention(f"{tmp_path / 'student' / 'attention.py'}:attention")
    assert report.ok
    assert report.isolation == ("namespaces" if available("namespaces") else "process")
    with pytest.raises(ValueError, match="isolation must be one of auto, bubblewrap"):
        check_attention(f"{tmp_path / 'student' / 'attention.py'}:attention", isolation="none")


def test_a_check_that_times_out_leaves_nothing(tmp_path: Path) -> None:
    beat = tmp_path / "heartbeat"
    code = HEARTBEAT.format(beat=str(beat)) + "while True:\n    pass\n"
    path = student(tmp_path, code)
    status, _, err = run_qkv(["check", "--function", f"{path}:attention", "--timeout", "3"])
    assert status == 2 and "did not finish within 3 s" in one_line(err)
    assert_nothing_outlives(path, beat)


def test_the_keeper_ends_what_the_runner_leaves(tmp_path: Path) -> None:
    """At level process (no namespace), a child of the runner that ignores SIGTERM and holds
    the output open is killed by the keeper when the runner ends (before: the check waited
    for it until the time limit)."""
    code = "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "if os.fork() == 0:\n    time.sleep(600)\n"
    path = student(tmp_path, code)
    report = check_attention(f"{path}:attention", isolation="process", timeout=60)
    assert report.ok and report.isolation == "process"
    assert leftovers(str(path)) == []
