"""The examples in the user docs run and print what the docs say."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name", ["attention.md"])
def test_doc_examples_run(name: str) -> None:
    result = doctest.testfile(
        str(DOCS / name),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted > 10
    assert result.failed == 0


# -- printed outputs in the guides match what the commands print (issue 12, item 15) --------

ROOT = DOCS.parent


def _text_blocks(name: str) -> list[list[str]]:
    """The fenced ``text`` blocks of a page, as lists of lines."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in (DOCS / name).read_text(encoding="utf-8").splitlines():
        if current is None and line.strip() == "```text":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _shape(line: str) -> str:
    """A printed line with every number replaced by ``#`` (numbers depend on the run)."""
    import re

    return re.sub(r"\d+(?:[.,]\d+)*", "#", line.rstrip())


def _contains(printed: str, block: list[str]) -> bool:
    """Whether ``block`` appears in ``printed`` as consecutive lines, up to the numbers."""
    lines = [_shape(line) for line in printed.splitlines()]
    wanted = [_shape(line) for line in block]
    return any(lines[i : i + len(wanted)] == wanted for i in range(len(lines)))


@pytest.mark.usefixtures("one_torch_thread")
def test_training_guide_prints_what_recall_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outputs shown in docs/training.md section 1 have the lines the commands print
    (a tiny run that stops at its target, so that the same lines come out)."""
    from qkv.cli import main

    for name in ("COLUMNS", "LINES", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    blocks = _text_blocks("training.md")
    summary = next(b for b in blocks if b[0].startswith("Best validation accuracy"))
    weights = next(b for b in blocks if b[0].startswith("columns 1–7 of 9"))
    tiny = ["--d-model", "16", "--heads", "2", "--validation-size", "32", "--eval-every", "2"]
    argv = ["train", "recall", "--out", "runs/recall", "--target-accuracy", "0.01", *tiny, "-q"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert _contains(printed, summary), printed
    text = "a 3 c 5 b 1 d 7 c"
    assert main(["explain", "--model", "runs/recall", "--text", text, "--steps", "weights"]) == 0
    printed = capsys.readouterr().out
    assert _contains(printed, weights), printed


def test_benchmark_page_shows_the_tables_the_script_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/benchmarks.md's training tables have the headings and columns that
    ``python benchmarks/bench_train.py`` prints (run here with --quick)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "bench_train_docs", ROOT / "benchmarks" / "bench_train.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_train_docs"] = bench
    try:
        spec.loader.exec_module(bench)
        bench.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    finally:
        del sys.modules["bench_train_docs"]
    printed = capsys.readouterr().out.splitlines()
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8").split("\n## Training\n", 1)[1]
    lines = page.splitlines()
    kinds = ("###", "| steps", "| model", "|---")
    shown = [line for line in printed if line.startswith(kinds)]
    for kind in kinds:  # the script printed each kind of line (an empty run would pass)
        assert any(line.startswith(kind) for line in shown), (kind, printed)
    for line in shown:
        assert line in lines, line
    heads = [line for line in lines if line.startswith(("| steps", "| model"))]
    assert len(heads) == 2
    assert set(heads) <= set(shown), heads  # and the page's table heads are printed ones
    head = ""
    for line in lines:
        if line.startswith(("| steps", "| model")):
            head = line
        elif line.startswith("| "):
            assert line.count("|") == head.count("|"), line  # a row has the header's columns
