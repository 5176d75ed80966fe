"""Sizes are checked before anything is allocated (issue 24, item 4): a huge option of
``qkv train`` or ``qkv bench``, or a small example file whose aliases repeat one large
matrix, is one line naming the option or field with the size, not an allocator traceback or
gigabytes of work; and the documented limits of worked examples hold (2,048 tokens in
format 2 too, one ``per_head`` mapping per head).

The commands that allocated before the fix run in a child process with 3 GiB of address
space and a time limit (:func:`run_limited`), so that a regression cannot take the test run
down.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkv._train_settings import RecallSettings
from qkv.examples import ExampleError, loads
from qkv.train._size import SizeError, check_recall


def run_limited(runs: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    """``qkv ARGV`` for each of ``runs``, in one child with 3 GiB of address space: (exit
    status, stderr) of each. An allocator error or a traceback ends the child: it fails."""
    code = (
        "import contextlib, io, json, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from qkv.cli import main\n"
        "results = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        results.append((main(argv), err.getvalue()))\n"
        "print(json.dumps(results))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=cwd,
        check=False,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return [(int(c), str(e)) for c, e in json.loads(done.stdout.splitlines()[-1])]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    return lines[0]


SIZE_OPTIONS = [
    (["train", "recall", "--d-model", "1000000000"], "--d-model 1000000000"),
    (["train", "recall", "--batch-size", "1000000000"], "--batch-size 1000000000"),
    (["train", "recall", "--layers", "100000000"], "--layers 100000000"),
    (["train", "classify", "--batch-size", "1000000000"], "--batch-size 1000000000"),
    (["train", "classify", "--embedding-dim", "100000000"], "--embedding-dim 100000000"),
    (["bench", "--quick", "--no-write", "--lengths", "1000000000"], "--lengths 1000000000"),
    (["bench", "--quick", "--no-write", "--long-length", "10000000000"], "--long-length"),
]


def test_a_huge_size_option_is_one_line_with_the_estimate(tmp_path: Path) -> None:
    train = ["--steps", "1", "-q", "--out", str(tmp_path / "run")]
    runs = [argv + (train if argv[0] == "train" else []) for argv, _ in SIZE_OPTIONS]
    for (status, err), (argv, option) in zip(
        run_limited(runs, tmp_path), SIZE_OPTIONS, strict=True
    ):
        line = one_line(err)
        assert status == 2 and option in line, argv
        assert "TB of memory" in line and "of this machine" in line and "Hint:" in line


@pytest.mark.parametrize("command", [["train", "recall"], ["bench"]])
def test_threads_past_any_machine_are_refused(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from qkv.cli import main

    assert main([*command, "--threads", "100000"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--threads" in line and "100000" in line


def test_the_estimate_names_the_setting_furthest_above_its_default() -> None:
    with pytest.raises(SizeError) as caught:
        check_recall(RecallSettings(d_model=4096, batch_size=128), available=1 << 30)
    assert caught.value.field == "d_model" and caught.value.default == 64
    assert "d_model=4096 makes the run need about" in str(caught.value)
    check_recall(RecallSettings(), available=1 << 30)  # the defaults fit in 1 GiB


def _aliased(rows: int, cols: int) -> str:
    row = "[" + ", ".join(["1"] * cols) + "]"
    lines = [f"    - &r {row}"] + ["    - *r"] * (rows - 1)
    return "format: 2\ninputs:\n  Q: &m\n" + "\n".join(lines) + "\n  K: *m\n  V: *m\n"


def test_an_aliased_matrix_is_refused_by_the_work_its_steps_imply(tmp_path: Path) -> None:
    """Q, K and V one 1000 × 1000 matrix, written once (3·10⁶ values, under the cap of
    5·10⁶): the products step would hold 10⁹ numbers (7.45 GiB before the fix)."""
    path = tmp_path / "alias.yaml"
    path.write_text(_aliased(1000, 1000), encoding="utf-8")
    assert path.stat().st_size < 13_000
    [(status, err)] = run_limited([["check", str(path)]], tmp_path)
    line = one_line(err)
    assert status == 2 and "inputs.V" in line and "products" in line
    assert "1,000,000,000 numbers" in line


def test_format_2_holds_the_documented_2048_tokens() -> None:
    loads(_aliased(2048, 2).replace("1, 1", "1, 0"))
    with pytest.raises(ExampleError, match=r"inputs\.Q: expected at most 2,048 rows"):
        loads(_aliased(2049, 2))
    with pytest.raises(ExampleError, match=r"inputs\.K: expected at most 2,048 rows"):
        loads(
            "format: 2\ninputs:\n  Q: [[1, 0]]\n  K: &k\n"
            + "\n".join(["    - [1, 0]"] * 2049)
            + "\n  V: *k\n"
        )


@pytest.mark.parametrize("mappings", [1, 3])
def test_per_head_needs_one_mapping_per_head(mappings: int) -> None:
    text = (
        "format: 2\nheads: 2\ninputs:\n"
        "  Q: [[1, 0, 1, 0], [0, 1, 0, 1]]\n  K: [[1, 0, 1, 0], [0, 1, 0, 1]]\n"
        "  V: [[1, 0, 1, 0], [0, 1, 0, 1]]\nclaimed:\n  per_head:\n" + "    - {}\n" * mappings
    )
    with pytest.raises(ExampleError, match=f"expected 2 mappings, one per head.*got {mappings}"):
        loads(text)
    loads(text.replace("    - {}\n" * mappings, "    - {}\n" * 2))
