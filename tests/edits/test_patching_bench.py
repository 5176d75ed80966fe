"""benchmarks/bench_patching.py runs (--quick), and docs/benchmarks.md shows its table."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Activation patching"


def _bench() -> Any:
    path = ROOT / "benchmarks" / "bench_patching.py"
    spec = importlib.util.spec_from_file_location("bench_patching", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_run_checks_both_sweeps_and_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == bench.HEADER
    rows = [line.split(" | ") for line in lines[3:]]
    assert [r[1] for r in rows] == ["qkv.patching", "eager + hooks"]
    assert rows[0][4] == "1.00 |"
    assert all(len(line) <= 100 for line in lines)


def test_the_benchmark_page_shows_the_table() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert SECTION in page
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert _bench().HEADER in section
    assert "qkv.patching" in section and "eager + hooks" in section
