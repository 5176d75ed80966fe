"""benchmarks/bench_gpu.py runs (issue 19): ``--smoke`` does every section at tiny sizes on the
CPU, in a subprocess, in well under a minute, and prints the tables with their peers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


@pytest.mark.slow
def test_bench_gpu_smoke_runs_every_section_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text(encoding="utf-8")
    for heading in ("## Attention", "## A training step", "## Tracing one head", "## Decoding"):
        assert heading in text
    for peer in ("sdpa-flash", "flex-direct", "qkv-auto", "sdpa-mask"):
        assert f"| {peer} |" in text
    assert "qkv.nn.MultiHeadAttention" in text and "KVCache, one token" in text


def test_bench_gpu_without_a_gpu_says_so_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the full run would start")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "decode"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "bench_gpu.py needs a CUDA GPU; --smoke runs tiny sizes on the CPU"
    )
