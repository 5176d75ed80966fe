"""benchmarks/bench_interp.py runs (--quick), checks qkv against eager before it measures,
and docs/interventions.md shows the table it printed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> Any:
    path = ROOT / "benchmarks" / "bench_interp.py"
    spec = importlib.util.spec_from_file_location("bench_interp", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_run_prints_every_tool_and_case(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--quick"]) == 0  # exits naming the case if qkv is off eager's numbers
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == bench.HEADER
    rows = [line.strip("|").split(" | ") for line in lines[2:]]
    assert [(r[1], r[2]) for r in rows] == [
        (tool, case)
        for tool in ("TransformerLens", "nnsight")
        for case in ("forward", "pattern of 1 head")
    ]


def test_the_page_shows_a_full_run() -> None:
    bench = _bench()
    page = (ROOT / "docs" / "interventions.md").read_text(encoding="utf-8")
    section = page.split("## Inside TransformerLens and nnsight", 1)[1]
    assert bench.HEADER in section
    shown = [line for line in section.splitlines() if line.startswith("| 4096 |")]
    assert len(shown) == 4  # the largest N of the default run, both tools, both cases
