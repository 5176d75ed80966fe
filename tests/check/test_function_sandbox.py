"""``qkv check --function`` runs a student's file as a grader must run hostile code (issue 24,
item 2): whatever the file does at import (read the environment, write outside its folder,
fork, ``setsid``, print 1.5 GB, signal its parent), qkv survives and reports a verdict or one
line, nothing the file started outlives the check, and under bubblewrap nothing outside the
temporary folder changes.

Each hostile check runs ``qkv`` in a child process with 2 GiB of address space and a time
limit (``tests/support/sandboxed.py``), so that a failure cannot take the test run down.
Every level of isolation this machine allows is tested: ``make test`` installs bubblewrap,
and the level without it (``namespaces``) is asked for by name. The attacks of a student
who knows qkv (forging a verdict, importing qkv, patching the runner, reaching a classmate)
are ``test_sandbox_attacks.py``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv.check import FunctionError, check_function
from qkv.check import _sandbox as sandbox
from qkv.check._channel import Channel, ChannelError
from qkv.check._function_file import _returned, _scalars, _signature, _Stop
from qkv.check._sandbox import IsolationError
from qkv.cli import main
from qkv.testing import check_attention
from tests.support.sandboxed import (
    HEARTBEAT,
    LEVELS,
    assert_nothing_outlives,
    available,
    leftovers,
    one_line,
    run_qkv,
)

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


def student(tmp_path: Path, code: str, name: str = "student") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "attention.py"
    path.write_text(textwrap.dedent(code) + RIGHT, encoding="utf-8")
    return path


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
    code = HEARTBEAT.format(beat=str(beat)) + textwrap.dedent("""
        import os, signal, sys, time
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        ancestors, pid = [], os.getppid()
        while pid > 1:
            ancestors.append(pid)
            try:
                stat = open(f"/proc/{pid}/stat", "rb").read()
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
    if status == 2:  # the keeper was killed (bubblewrap): the run ended unfinished
        assert "SIGKILL" in one_line(err) and out == ""
    else:  # namespaces: the runner is the namespace's PID 1 and sees no parent to kill
        assert status == 0 and "No mistake found" in out
    assert_nothing_outlives(path, beat)


# the names of the environment and whether any value holds the secret, as the file's error
ENVIRONMENT = """
import os
leaked = any("hunter2" in value for value in os.environ.values())
raise RuntimeError(f"leaked={leaked} names=" + " ".join(sorted(os.environ)))
"""


@pytest.mark.parametrize("level", LEVELS)
def test_the_environment_is_scrubbed(tmp_path: Path, level: str) -> None:
    """The file's top-level error is reported (as a notebook's is) and the function checked."""
    path = student(tmp_path, ENVIRONMENT)
    status, out, err = run_qkv(
        ["check", "--function", f"{path}:attention", "--isolation", level, "-f", "json"],
        env={"QKV_TEST_SECRET": "hunter2-token"},
    )
    assert (status, err) == (0, "")
    line = json.loads(out)["file_error"]
    assert line.startswith("line 4: RuntimeError: leaked=False names=")
    assert "QKV_TEST_SECRET" not in line and " PATH " in line


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


def test_writing_past_the_file_size_limit_is_stopped(tmp_path: Path) -> None:
    """Python ignores SIGXFSZ: the write that passes the limit fails, as the file's error."""
    path = student(tmp_path, "import os\nfor _ in range(20):\n    os.write(1, b'x' * 10**6)\n")
    status, out, err = run_qkv(["check", "--function", f"{path}:attention", "-f", "json"])
    assert (status, err) == (0, "")
    assert "OSError: [Errno 27] File too large" in json.loads(out)["file_error"]


PWNED = "'\\x1b]0;PWNED\\x07\\x1b[2J\\u202e'"


@pytest.mark.parametrize("where", ["top level", "function"])
def test_a_student_s_exception_text_reaches_the_terminal_escaped(
    tmp_path: Path, where: str
) -> None:
    """At the top level, the file's error is a line of the report (the function is checked);
    raised by the function, it is the one error line."""
    if where == "top level":
        path = student(tmp_path, f"raise ValueError({PWNED})\n")
    else:
        path = tmp_path / "attention.py"
        path.write_text(f"def attention(Q, K, V):\n    raise ValueError({PWNED})\n")
    status, out, err = run_qkv(["check", "--function", f"{path}:attention"])
    shown = out if where == "top level" else one_line(err)
    assert status == (0 if where == "top level" else 2)
    assert "\x1b" not in out + err and "\u202e" not in out + err and "\x07" not in out + err
    assert "ValueError: \\x1b]0;PWNED\\x07\\x1b[2J\\u202e" in shown


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
        "b'[' * 100000 + b'\\n'",
        "b'{\"items\": 5}\\n'",
        "b'{' * (5 << 20)",
        'b\'{"error": "\\\\u001b[2J forged"}\\n\'',
        "b'\\xff\\xfe\\n'",
        'b\'{"items": null, "arrays": [{"shape": [1000000], "dtype": "float64"}]}\\n\'',
    ],
    ids=["deep", "wrong-fields", "too-large", "escape", "not-utf8", "huge-array"],
)
def test_a_forged_reply_on_the_channel_is_one_line(tmp_path: Path, forged: str) -> None:
    """The student's code shares the runner's process: it writes to the reply pipe (the
    runner's second argument) before the runner's own reply."""
    code = f"import os, sys\nos.write(int(sys.argv[2]), {forged})\n"
    path = student(tmp_path, code)
    status, _, err = run_qkv(["check", "--function", f"{path}:attention"])
    line = one_line(err)
    assert status == 2 and "\x1b" not in line
    assert "sent what qkv's runner does not send" in line


def _reply(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """What the judge's end of the channel reads from ``data`` (then end of file)."""
    requests, child_in = os.pipe()
    replies, child_out = os.pipe()
    os.close(child_in)

    def write() -> None:  # more than a pipe holds: written while the judge reads
        with contextlib.suppress(OSError):
            os.write(child_out, data)
        os.close(child_out)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        return Channel(requests, replies, None).receive(time.monotonic() + 5)
    finally:
        os.close(replies)  # a writer still blocked gets EPIPE
        writer.join()
        os.close(requests)


def test_each_reply_is_checked_before_it_is_read() -> None:
    """Sizes before allocating, then every field's type: anything else is garbage."""
    array = np.arange(6.0).reshape(2, 3)
    header = {"items": None, "arrays": [{"shape": [2, 3], "dtype": "float64"}]}
    got, arrays = _reply(json.dumps(header).encode() + b"\n" + array.tobytes())
    assert got["items"] is None
    np.testing.assert_array_equal(arrays[0], array)
    bad = [
        b"[1, 2]\n",
        b"{" * (70 << 10),
        b'{"arrays": [{"shape": [100001], "dtype": "float64"}]}\n',
        b'{"arrays": [{"shape": [0, 1000000000000], "dtype": "float64"}]}\n',
        b'{"arrays": [{"shape": [2], "dtype": "object"}]}\n',
        b'{"arrays": [{"shape": [2.5], "dtype": "float64"}]}\n',
        b'{"arrays": [{"shape": [1, 1, 1, 1, 1, 1, 1, 1, 1], "dtype": "float64"}]}\n',
        b'{"arrays": ' + json.dumps([{"shape": [1], "dtype": "float64"}] * 9).encode() + b"}\n",
    ]
    for data in bad:
        with pytest.raises(ChannelError) as caught:
            _reply(data)
        assert caught.value.why == "garbage", data[:80]
    with pytest.raises(ChannelError) as caught:  # the bytes the header promised never came
        _reply(json.dumps(header).encode() + b"\n" + b"x" * 8)
    assert caught.value.why == "ended"


def test_each_field_of_a_reply_is_checked() -> None:
    a = np.zeros((2, 3))
    assert _returned({"items": None}, [a]) is a
    assert _returned({"items": 2, "container": "tuple"}, [a, a]) == (a, a)
    with pytest.raises(Exception, match="x") as raised:
        _returned({"raised": "ZeroDivisionError", "message": "x\x1b[2J"}, [])
    assert (type(raised.value).__name__, str(raised.value)) == ("ZeroDivisionError", "x\x1b[2J")
    with pytest.raises(Exception, match=r"^$") as raised:  # not an identifier: Exception
        _returned({"raised": "rm -rf /", "message": ""}, [])
    assert type(raised.value).__name__ == "Exception"
    assert type(_returned({"returned": "str"}, [])).__name__ == "str"
    cases: list[tuple[dict[str, Any], list[Any]]] = [
        ({"items": None}, []),
        ({"items": 3, "container": "tuple"}, [a, a]),
        ({"items": 2, "container": "set"}, [a, a]),
        ({"returned": 3}, []),
        ({"returned": "str"}, [a]),
        ({"raised": "E", "message": 3}, []),
        ({"verdict": "ok"}, []),
        ({"too_large": ["x"]}, []),
    ]
    for reply, arrays in cases:
        with pytest.raises(_Stop):
            _returned(reply, arrays)
    signature = _signature([{"name": "Q", "kind": "POSITIONAL_OR_KEYWORD"}])
    assert signature is not None and list(signature.parameters) == ["Q"]
    for params in [
        "Q",
        [{"name": "class", "kind": "POSITIONAL_OR_KEYWORD"}],
        [{"name": "Q", "kind": "EVIL"}],
        [{"name": "a", "kind": "KEYWORD_ONLY"}, {"name": "b", "kind": "POSITIONAL_ONLY"}],
        [{"name": "Q", "kind": "POSITIONAL_OR_KEYWORD", "has_default": True, "default": [1]}],
    ]:
        with pytest.raises(_Stop):
            _signature(params)
    fields = _scalars({"kind": "gqa", "causal": True, "about": "forward(x)\x1b[2J", "width": 16})
    assert fields == {"kind": "gqa", "causal": True, "about": "forward(x)\\x1b[2J", "width": 16}
    for bad in [[1], {"about": ["x"]}, {"width": float("nan")}, {str(i): 1 for i in range(65)}]:
        with pytest.raises(_Stop):
            _scalars(bad)


def test_a_huge_return_is_the_function_s_error_not_a_crash(tmp_path: Path) -> None:
    """Before: "the result of the run is not what qkv's runner writes" for the whole run."""
    path = tmp_path / "attention.py"
    path.write_text("import numpy as np\n\ndef attention(Q, K, V):\n    return np.zeros(10**6)\n")
    status, _, err = run_qkv(["check", "--function", f"{path}:attention"])
    line = one_line(err)
    assert status == 2
    assert "returned an array of shape (1000000,): larger than any probe's output" in line


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "-inf", "soon", "1e308"])
def test_timeout_must_be_a_positive_finite_number(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = student(tmp_path, "")
    assert main(["check", "--function", f"{path}:attention", "--timeout", value]) == 2
    err = capsys.readouterr().err  # 1e308: before, it hung
    assert one_line(err) and "timeout" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="timeout must be a"):
        check_attention(f"{path}:attention", timeout=float(value) if value != "soon" else value)  # type: ignore[arg-type]


def test_without_bubblewrap_auto_takes_the_next_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    with pytest.raises(IsolationError, match=r"bwrap is not installed.*apt install bubblewrap"):
        check_attention(f"{student(tmp_path, '')}:attention", isolation="bubblewrap")
    if not available("namespaces"):
        with pytest.raises(IsolationError, match="no isolation for students' code"):
            check_attention(f"{tmp_path / 'student' / 'attention.py'}:attention")
        return
    report = check_attention(f"{tmp_path / 'student' / 'attention.py'}:attention")
    assert report.ok and report.isolation == "namespaces"
    with pytest.raises(ValueError, match="isolation must be one of auto, bubblewrap"):
        check_attention(f"{tmp_path / 'student' / 'attention.py'}:attention", isolation="none")


def test_a_check_that_times_out_leaves_nothing(tmp_path: Path) -> None:
    beat = tmp_path / "heartbeat"
    code = HEARTBEAT.format(beat=str(beat)) + "while True:\n    pass\n"
    path = student(tmp_path, code)
    status, _, err = run_qkv(["check", "--function", f"{path}:attention", "--timeout", "3"])
    assert (
        status == 2
        and "the student's code (loading the file) did not finish within 3 s" in one_line(err)
    )
    assert_nothing_outlives(path, beat)


@pytest.mark.parametrize("level", LEVELS)
def test_the_keeper_ends_what_the_runner_leaves(tmp_path: Path, level: str) -> None:
    """A child of the runner that ignores SIGTERM and holds the output open is killed when
    the check ends (before, at level process: the check waited for it until the limit)."""
    code = "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "if os.fork() == 0:\n    time.sleep(600)\n"
    path = student(tmp_path, code)
    report = check_attention(f"{path}:attention", isolation=level, timeout=60)
    assert report.ok and report.isolation == level
    assert leftovers(str(path)) == []


def test_isolation_process_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bare process cannot keep a student's code from the teacher's files: not offered."""
    path = student(tmp_path, "")
    with pytest.raises(IsolationError, match="isolation 'process' is not offered"):
        check_attention(f"{path}:attention", isolation="process")
    assert sandbox.ISOLATIONS == ("auto", "bubblewrap", "namespaces")


def test_a_time_out_while_calling_says_what_was_timed(tmp_path: Path) -> None:
    path = tmp_path / "attention.py"
    path.write_text("def attention(Q, K, V):\n    while True:\n        pass\n")
    status, _, err = run_qkv(["check", "--function", f"{path}:attention", "--timeout", "2"])
    line = one_line(err)
    assert status == 2
    assert (
        "the student's code (loading the file and the 1 call so far) did not finish within 2 s"
        in line
    )


TORCH_RIGHT = """
import torch


def attention(Q, K, V, mask=None):
    s = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, dim=-1)
    return w @ V, w
"""


@pytest.mark.slow
def test_a_right_torch_submission_stays_ok_on_a_loaded_machine(tmp_path: Path) -> None:
    """Every core busy (twice over) while a class of one is graded with the default time
    limit: the start of Python and torch's import are not the student's time (issue 35,
    item 4; before, under load, a right PyTorch submission could get 'timeout')."""
    pytest.importorskip("torch")
    folder = tmp_path / "class"
    (folder / "ada").mkdir(parents=True)
    (folder / "ada" / "attention.py").write_text(TORCH_RIGHT, encoding="utf-8")
    spin = "import time\nend = time.monotonic() + 240\nwhile time.monotonic() < end:\n    pass\n"
    busy = [
        subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * (os.cpu_count() or 2))
    ]
    try:
        out = tmp_path / "grades"
        status, _, err = run_qkv(["grade", str(folder), "-o", str(out), "--array", "torch"])
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert status == 0, err
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        (row,) = csv.DictReader(handle)
    assert (row["student"], row["status"], row["score"]) == ("ada", "ok", row["max_score"])


def test_namespaces_work_with_a_python_below_tmp(tmp_path: Path) -> None:
    """A virtual environment made under /tmp (as a CI clone may be) stays visible in the
    private root: its binds go on top of the private /tmp, not below it."""
    if not available("namespaces"):
        pytest.skip("no namespaces isolation here")
    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    import qkv

    paths = [str(Path(qkv.__file__).parents[1]), str(Path(np.__file__).parents[1])]
    code = (
        f"import sys; sys.path[:0] = {paths!r}; "
        "from qkv.check import _sandbox; print(repr(_sandbox._unavailable('namespaces')))"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "''", done.stderr[-500:] or done.stdout
