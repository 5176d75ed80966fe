"""benchmarks/bench_threads.py runs (--quick) and prints every thread mode in every
situation, with auto against the better fixed mode; docs/kernels.md cites the script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_thread_benchmark_prints_every_case_in_every_mode() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_threads.py"),
            "--quick",
            "--threads",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = [
        line for line in done.stdout.splitlines() if re.match(r"\| (16|window|causal|dense)", line)
    ]
    assert len(rows) == 12  # 4 cases × alone, after matmul, busy
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        torch_ms, pool_ms, auto_ms, ratio = (float(c) for c in cells[3:])
        assert torch_ms > 0 and pool_ms > 0 and auto_ms > 0
        best = min(torch_ms, pool_ms)  # printed to 0.1 ms, the ratio to 0.01
        low, high = (auto_ms - 0.05) / (best + 0.05), (auto_ms + 0.05) / max(best - 0.05, 1e-9)
        assert low - 0.005 <= ratio <= high + 0.005  # auto against the better fixed mode
    assert {c.strip("| ").split(" | ")[2] for c in rows} == {"alone", "after matmul", "busy"}
    assert all(len(line) <= 80 for line in done.stdout.splitlines())


def test_the_docs_point_to_the_script() -> None:
    text = (ROOT / "docs" / "kernels.md").read_text(encoding="utf-8")
    assert "benchmarks/bench_threads.py" in text
