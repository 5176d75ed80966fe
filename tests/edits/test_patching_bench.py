"""benchmarks/bench_patching.py runs (--quick) with every peer, ``qkv bench``'s patching
section makes its rows from the worker's answer, and docs/benchmarks.md shows the table."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from qkv.bench import _patching
from qkv.bench._results import Settings

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Activation patching"
SWEEPS = ["qkv.patching", "qkv, a forward per head", "eager + hooks", "TransformerLens", "nnsight"]


def _bench() -> Any:
    path = ROOT / "benchmarks" / "bench_patching.py"
    spec = importlib.util.spec_from_file_location("bench_patching", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_run_checks_every_sweep_and_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == bench.HEADER
    rows = [line.split(" | ") for line in lines[4:]]
    assert [r[1] for r in rows] == SWEEPS  # qkv[interp] is part of the dev install
    assert rows[0][2] == "2 + 2 batches" and rows[1][2] == "9"
    assert rows[0][4] == "1.00 |"
    assert all(len(line) <= 80 for line in lines)


def test_quick_run_by_position_checks_the_peers_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One head at one position at a time: qkv's table equals TransformerLens's
    ``generic_activation_patch`` over those (layer, pos, head) rows and the nnsight loop's
    (measure raises otherwise), and each peer runs the model once per cell."""
    bench = _bench()
    assert bench.main(["--quick", "--by", "position"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("by position")
    rows = [line.split(" | ") for line in lines[4:]]
    assert [r[1] for r in rows] == ["qkv.patching", "TransformerLens", "nnsight"]
    assert rows[1][2] == rows[2][2] == "33"  # 2 layers x 4 positions x 4 heads, and the clean run


def test_the_qkv_bench_section_makes_a_row_per_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []

    def answer(spec: dict[str, Any]) -> dict[str, Any]:
        asked.append(spec)
        seconds = {"qkv.patching": 2.0, "eager + hooks": 9.0}
        return {"seconds": seconds, "forwards": {"qkv.patching": "2 + 12 batches",
                                                 "eager + hooks": "145"}}  # fmt: skip

    monkeypatch.setattr(_patching, "_measured", answer)
    ticks: list[None] = []
    table = _patching.patching_section(Settings.quick_run(), lambda: ticks.append(None))
    assert [spec["length"] for spec in asked] == [128] and len(ticks) == 1
    assert _patching.patching_ticks(Settings()) == 3
    assert [(r.peer, r.ratio) for r in table.rows] == [
        ("qkv.patching", 1.0),
        ("eager + hooks", 4.5),
    ]
    assert table.rows[1].note == "model runs: 145" and table.reference == "qkv.patching"


def test_the_worker_answers_in_json_for_a_fresh_process() -> None:
    from qkv.edits import _timing

    found = _timing._main({"length": 12, "quick": True, "only": ["eager + hooks"]})
    assert list(found["seconds"]) == ["qkv.patching", "eager + hooks"]
    assert found["forwards"]["eager + hooks"] == "9"


def test_the_benchmark_page_shows_the_table() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert SECTION in page
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert _bench().HEADER in section
    assert all(name in section for name in SWEEPS)
