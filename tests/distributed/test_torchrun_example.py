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
