"""benchmarks/bench_threads.py runs (--quick) and prints both thread modes in every
situation, with the ratio between them; docs/kernels.md cites the script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_thread_benchmark_prints_every_case_in_both_modes() -> None:
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
        torch_ms, pool_ms, ratio = (float(c) for c in cells[3:])
        assert torch_ms > 0 and pool_ms > 0
        assert abs(ratio - pool_ms / torch_ms) < 0.02 + 0.05 * ratio  # the ratio of the two
    assert {c.strip("| ").split(" | ")[2] for c in rows} == {"alone", "after matmul", "busy"}
    assert all(len(line) <= 80 for line in done.stdout.splitlines())


def test_the_docs_point_to_the_script() -> None:
    text = (ROOT / "docs" / "kernels.md").read_text(encoding="utf-8")
    assert "benchmarks/bench_threads.py" in text
