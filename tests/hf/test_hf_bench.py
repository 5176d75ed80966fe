"""benchmarks/bench_hf.py runs (--quick), and docs/benchmarks.md shows its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Hugging Face: tracing one head of a 12-layer model"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_hf", ROOT / "benchmarks" / "bench_hf.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_hf"] = bench  # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["bench_hf"]
    return bench


def test_quick_run_prints_every_case_with_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--quick"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == bench.HEADER
    rows = [line.split(" | ") for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        (f"| {n}", case) for n in (32, 64) for case in bench.CASES
    ]
    assert all(r[3] == "1.00" for r in rows if r[1] == "sdpa, untraced")
    assert all(len(line) <= 80 and line.count("|") == 7 for line in lines)
    # the check before timing: the traced output and row equal eager's
    assert "N=64: vs eager, output" in captured.err


def test_the_benchmark_page_shows_the_scripts_table() -> None:
    bench = _bench()
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert SECTION in page
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert "python benchmarks/bench_hf.py" in section
    lines = section.splitlines()
    assert bench.HEADER in lines
    rows = [line for line in lines if line.startswith("| ") and line != bench.HEADER]
    cases = {line.split(" | ")[1] for line in rows}
    assert cases == set(bench.CASES)
    assert all(line.count("|") == 7 for line in rows)
