"""`qkv bench ring --quick`: spawned gloo ranks, tables of at most 80 columns with the
time, balance and memory rows; its errors are one line with exit status 2."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from qkv.bench import _ring
from qkv.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_bench_ring_quick_prints_time_balance_and_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    groups: list[dict[str, Any]] = []
    run_ring = _ring.run_ring

    def kept(*args: Any) -> list[dict[str, Any]]:  # the figures behind the printed tables
        groups.extend(run_ring(*args))
        return groups

    monkeypatch.setattr(_ring, "run_ring", kept)
    assert main(["bench", "ring", "--quick"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    rows = {tuple(line.split()[:3]): line.split() for line in lines if line[:2].strip()}
    for key in (("1", "—", "ring"), ("2", "zigzag", "ring"), ("2", "zigzag", "allgather")):
        assert key in rows, out
    # The balance the layout promises, counted (the timed max/mean is the benchmark's):
    # under the causal mask, zigzag gives each of the P = 2 ranks the same 2P + 1 (query,
    # key) chunk pairs (two half-empty diagonal ones); contiguous gives rank 1 twice rank 0's.
    (two,) = [group for group in groups if group["size"] == 2]
    pairs = {}
    for i, run in enumerate(two["ranks"][0]["runs"]):
        if run["strategy"] == "ring":
            pairs[run["layout"]] = [rank["runs"][i]["pairs"] for rank in two["ranks"]]
    assert pairs["zigzag"] == [5, 5]
    assert pairs["contiguous"] == [1, 2]
    memory = [line.split() for line in lines if line[:6].strip().isdigit()]
    buffers = {(int(row[0]), int(row[1])): float(row[4]) for row in memory}
    # counted private buffers at fixed N halve from P = 1 to P = 2
    for n in _ring.RingSettings.quick_run().memory_lengths:
        assert buffers[(n, 2)] == pytest.approx(buffers[(n, 1)] / 2, rel=0.1)
    # docs/benchmarks.md records a full run: the same headings and columns, other numbers
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8").split("qkv bench ring`", 1)[1]
    recorded = {re.sub(r"\d+(?:\.\d+)?", "#", line) for line in page.splitlines()}
    for line in lines:
        if line.startswith((" P ", "     N", "Ring attention", "Peak memory", "OS =", "buffers")):
            assert re.sub(r"\d+(?:\.\d+)?", "#", line) in recorded, line


def test_bench_ring_refuses_a_length_that_does_not_split(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "ring", "--quick", "--length", "100", "--sizes", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: length 100 does not split into 2·P = 6 chunks")
    assert len(err.strip().splitlines()) == 1
