"""``qkv check --module FILE.py:CLASS`` runs a student's file as ``--function`` does (issue 26
§4 on top of issue 24 §2): the file's top-level code, the class's constructor and its
``forward`` all run in the student's process, so a hostile class is contained exactly as a
hostile function is (``test_function_sandbox.py``): it cannot write in the teacher's folder, sees a
scrubbed environment, is stopped when it loops for ever, and nothing it starts (a ``setsid``
child) outlives the check. A notebook exported to a file and the second call of
``dropout-at-inference`` run there too.

Each run is ``qkv`` in a child process with a memory and a time limit
(``tests/support/sandboxed.py``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.support.sandboxed import (
    HEARTBEAT,
    LEVELS,
    assert_nothing_outlives,
    available,
    one_line,
    run_qkv,
)

# a right attention class in the shape of LLMs from Scratch; FORWARD is its forward's body
CLASS = """
import math
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__()
        self.h = num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.p = dropout

    def forward(self, x):
        {FORWARD}
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2)
                   for f in (self.W_query, self.W_key, self.W_value))
        w = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(k.shape[-1]), dim=-1)
        w = {DROPOUT}
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, e))
"""


def student(tmp_path: Path, top: str = "", forward: str = "pass", dropout: str = "w") -> Path:
    """A student's folder with ``attention.py``: ``top`` before the class, ``forward`` at the
    start of its forward, ``dropout`` what the weights become."""
    folder = tmp_path / "student"
    folder.mkdir()
    path = folder / "attention.py"
    body = CLASS.replace("{FORWARD}", forward).replace("{DROPOUT}", dropout)
    path.write_text(textwrap.dedent(top) + body, encoding="utf-8")
    return path


def check(path: Path, *options: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    argv = ["check", "--module", f"{path}:Attention", "--kind", "multi-head", *options]
    return run_qkv(argv, env=env)


def test_a_right_class_is_checked_in_the_sandbox(tmp_path: Path) -> None:
    status, out, err = check(student(tmp_path), "-f", "json")
    assert (status, err) == (0, "")
    data = json.loads(out)
    assert data["ok"] and data["isolation"] in ("bubblewrap", "namespaces")


@pytest.mark.parametrize("level", LEVELS)
def test_the_environment_a_class_sees_is_scrubbed(tmp_path: Path, level: str) -> None:
    """Read at the file's top level and again in forward: no secret, in either."""
    seen = "any('hunter2' in v for v in __import__('os').environ.values())"
    top = f"if {seen}:\n    raise RuntimeError('leaked at the top level')\n"
    path = student(tmp_path, top=top, forward=f"assert not {seen}, 'leaked in forward'")
    status, out, err = check(
        path, "--isolation", level, "-f", "json", env={"QKV_TEST_SECRET": "hunter2-token"}
    )
    assert (status, err) == (0, ""), err
    data = json.loads(out)
    assert data["ok"] and "file_error" not in data and data["isolation"] == level


@pytest.mark.parametrize("level", LEVELS)
def test_a_class_that_writes_in_the_teacher_s_folder_writes_in_its_own(
    tmp_path: Path, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path is the sandbox's fresh temporary folder, removed afterwards, at every
    level: the file the class writes in its constructor and forward is not in the folder
    qkv was run from."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    monkeypatch.chdir(teacher)
    write = "open('pwned.txt', 'a').write('pwned')"
    path = student(tmp_path, top=write + "\n", forward=write)
    status, out, err = check(path, "--isolation", level, "-f", "json")
    assert (status, err) == (0, ""), err
    assert json.loads(out)["ok"]
    assert list(teacher.iterdir()) == [] and sorted(p.name for p in path.parent.iterdir()) == [
        "attention.py"
    ]


@pytest.mark.skipif(not available("bubblewrap"), reason="bubblewrap is not installed here")
def test_under_bubblewrap_a_class_cannot_change_the_teacher_s_files(tmp_path: Path) -> None:
    """Writing by absolute path in the teacher's folder and next to the file fails under
    bubblewrap (the class is made wrong, with the file's error, if one succeeds)."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "grades.csv").write_text("the teacher's", encoding="utf-8")
    targets = [str(teacher / "grades.csv"), str(teacher / "new.txt")]
    top = textwrap.dedent(f"""
        import os
        done = []
        for target in {targets!r} + [os.path.join(os.path.dirname(__file__), "x.txt")]:
            try:
                with open(target, "w") as f:
                    f.write("pwned")
                done.append(target)
            except OSError:
                pass
    """)
    path = student(tmp_path, top=top, dropout="w if not done else w * 2")
    status, out, err = check(path, "--isolation", "bubblewrap", "-f", "json")
    assert (status, err) == (0, ""), out
    assert json.loads(out)["isolation"] == "bubblewrap"
    assert [p.name for p in teacher.iterdir()] == ["grades.csv"]
    assert (teacher / "grades.csv").read_text(encoding="utf-8") == "the teacher's"
    assert sorted(p.name for p in path.parent.iterdir()) == ["attention.py"]


def test_a_class_that_loops_for_ever_is_stopped_and_nothing_outlives(tmp_path: Path) -> None:
    """forward starts a ``setsid`` grandchild that beats for ever, then loops."""
    beat = tmp_path / "heartbeat"
    top = HEARTBEAT.format(beat=str(beat))
    path = student(tmp_path, top=top, forward="while True: pass")
    status, out, err = check(path, "--timeout", "8")
    assert status == 2 and out == ""
    line = one_line(err)  # the adapter's trial calls of forward are part of loading
    assert (
        "the student's code (loading the file and driving the class) did not finish within 8 s"
        in line
    )
    assert_nothing_outlives(path, beat)


@pytest.mark.parametrize("level", LEVELS)
def test_a_class_that_forks_a_setsid_child_gets_its_verdict_and_nothing_outlives(
    tmp_path: Path, level: str
) -> None:
    beat = tmp_path / "heartbeat"
    path = student(tmp_path, top=HEARTBEAT.format(beat=str(beat)))
    status, out, err = check(path, "--isolation", level, "--timeout", "60", "-f", "json")
    assert (status, err) == (0, "")
    assert json.loads(out) == {"ok": True, "findings": [], "isolation": level}
    assert_nothing_outlives(path, beat)


def test_dropout_at_inference_is_found_by_two_calls_in_the_sandbox(tmp_path: Path) -> None:
    """The repeated probe runs in the same student's process; a notebook's error is a note."""
    top = "print(undefined_in_a_notebook)\n"
    dropout = "torch.nn.functional.dropout(w, self.p)"
    path = student(tmp_path, top=top, dropout=dropout)
    status, out, err = check(path, "-f", "json")
    assert (status, err) == (1, "")
    data = json.loads(out)
    assert [f["diagnosis"] for f in data["findings"]] == ["dropout-at-inference"]
    assert data["file_error"] == (
        "line 1: NameError: name 'undefined_in_a_notebook' is not defined"
    )


def test_a_class_s_own_text_reaches_the_terminal_escaped(tmp_path: Path) -> None:
    """The error of a constructor that raises, and a class's layer names, are escaped."""
    path = student(tmp_path, forward="pass")
    source = path.read_text(encoding="utf-8").replace(
        "self.h = num_heads", "raise ValueError('\\x1b]0;PWNED\\x07\\u202e')"
    )
    path.write_text(source, encoding="utf-8")
    status, out, err = check(path)
    line = one_line(err)
    assert status == 2 and out == ""
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line
    assert "ValueError: \\x1b]0;PWNED\\x07\\u202e" in line
