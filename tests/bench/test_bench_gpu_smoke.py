"""benchmarks/gpu_check.sh and bench_gpu.py run (issues 19 and 30): ``--smoke`` does every
step of a GPU lease at tiny sizes on the CPU, in a subprocess, in about a minute, and
writes the tables with their peers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
CHECK = SCRIPT.with_name("gpu_check.sh")


@pytest.mark.slow
def test_the_gpu_check_smoke_runs_the_tests_and_every_section_on_the_cpu(tmp_path: Path) -> None:
    """What a GPU lease runs (issue 30), at tiny sizes: the machine's facts, the cuda tests
    (skipped here, naming the marker) and every benchmark section, each into its file."""
    done = subprocess.run(
        ["bash", str(CHECK), "--smoke"],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    facts = (tmp_path / "facts.txt").read_text(encoding="utf-8")
    assert "torch" in facts and "qkv" in facts
    tests = (tmp_path / "tests.log").read_text(encoding="utf-8")
    assert "cuda tests: exit 0" in tests and "marker 'cuda'" in tests
    text = (tmp_path / "attention.md").read_text(encoding="utf-8")
    text += (tmp_path / "others.md").read_text(encoding="utf-8")
    for heading in (
        "## Attention",
        "## The dispatch overhead of auto",
        "## A training step",
        "## Tracing one head of one layer",
        "## Tracing one head of a Hugging Face model",
        "## Decoding",
    ):
        assert heading in text, heading
    for peer in ("sdpa-flash", "sdpa-default", "flex-direct", "qkv-auto", "sdpa-mask"):
        assert f"| {peer} |" in text, peer
    assert "qkv.nn.MultiHeadAttention" in text and "KVCache, one token" in text
    assert "| qkv.tracing, 1 head x 1 row |" in text


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
