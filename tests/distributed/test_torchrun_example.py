"""examples/torchrun_ring.py runs under torchrun with 2 processes (gloo) and trains the
split model exactly as the unsplit one: the example's own printed check, read here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_example_trains_like_one_process() -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "torchrun_ring.py"),
        "--steps",
        "2",
        "--length",
        "48",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, done.stdout
    for line in lines:
        found = re.search(r"difference ([0-9.e+-]+)\)", line)
        assert found is not None, line
        assert float(found.group(1)) <= 1e-10, line
        assert "on 2 processes" in line


def test_a_bad_argument_is_one_line_printed_once() -> None:
    """Before: a traceback from every rank. Now rank 0 prints one line, every rank exits 2
    (torchrun then adds its own report of the failed ranks, which is torchrun's)."""
    for bad, expected in (
        (["--length", "46"], "sequence length 46 does not divide into 2·P = 4 chunks"),
        (["--steps", "0"], "argument --steps: expected a positive number, got 0"),
    ):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(ROOT / "examples" / "torchrun_ring.py"), *bad,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT, check=False
        )
        assert done.returncode != 0
        ours = [line for line in done.stderr.splitlines() if "torchrun_ring.py: error:" in line]
        assert len(ours) == 1 and expected in ours[0], done.stderr[-3000:]
        assert 'torchrun_ring.py", line' not in done.stderr  # no rank's traceback
        assert "exitcode  : 2" in done.stderr
