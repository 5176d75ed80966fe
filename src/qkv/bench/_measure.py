"""How ``qkv bench`` measures: the machine, the peers it times, and the timing itself.

Every figure is measured in one run beside its peers and reported also as a ratio to one of
them, so that a machine busy with other work slows both sides alike (peers alternate within
each repeat; the median of the repeats is kept).

- time: ``time.perf_counter`` around one call, median of the repeats;
- attained GFLOP/s: the useful floating-point operations (4·B·H·Lq·Lk·D for a forward pass,
  times the share of allowed (query, key) pairs; 3.5 times that for forward + backward)
  divided by the time, and as a share of the machine's own float32 matrix product rate,
  measured first (a 2048 × 2048 × 2048 product).

Peers: the tiled kernel (``qkv.kernels.tiled_attention``); ``qkv-auto``, the public
``qkv.scaled_dot_product_attention`` with its default backend (what a user's call costs,
dispatch and checks included); torch's SDPA with the CPU flash
kernel and with the math kernel (``torch.nn.attention.sdpa_kernel``); naive attention that
materialises softmax(Q·Kᵀ/√d)·V in PyTorch and in NumPy; FlexAttention in eager mode (no
``torch.compile``). Slow peers run only at the lengths where they finish in seconds. For the
structured masks, the real peer is FlexAttention under ``torch.compile``
(:func:`compiled_flex`, given a ``BlockMask`` built from qkv's own block structure by
:func:`flex_block_mask`, the one the ``flex`` backend uses, from
``qkv.kernels._flex_masks``); its compile time is measured apart from its time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from qkv.attention import scaled_dot_product_attention
from qkv.bench._results import MOST_REPEATS, Row
from qkv.kernels import tiled_attention
from qkv.kernels._flex_masks import flex_block_mask, raise_recompile_limits

__all__ = [
    "DIM",
    "HEADS",
    "PEERS",
    "Inputs",
    "Peer",
    "Timings",
    "causal_share",
    "compiled_flex",
    "flex_block_mask",
    "forward_flops",
    "gemm_rate",
    "in_fresh_process",
    "inputs",
    "load_average",
    "machine",
    "medians",
    "ratios",
    "sdpa_peer",
    "spread",
    "timed",
]

HEADS, DIM = 8, 64


def in_fresh_process(module: str, args: Sequence[str], what: str) -> dict[str, Any]:
    """Run ``python -m module *args`` in a fresh process (its memory and compiled code apart
    from this one's); return the JSON object on its last line of output.

    Raises:
        RuntimeError: the process failed; ``what`` names it, beside its last three lines.
    """
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{what} failed: {' | '.join(tail)}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


# -- machine -------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The CPU, cores, memory and software the figures were measured with."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "memory_gib": None if memory is None else round(memory / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes, ours included), or None
    where the system does not say."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def gemm_rate(repeats: int = 5) -> float:
    """The machine's float32 matrix product rate in GFLOP/s: the fastest of ``repeats``
    2048 × 2048 × 2048 products (what the machine can do, when nothing else runs)."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = [timed(lambda: a @ b) for _ in range(repeats)]
    return 2 * n**3 / min(times) / 1e9


# -- peers ---------------------------------------------------------------------------------

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Peer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Any]


def sdpa_peer(backend: str) -> Peer:
    """torch's SDPA held to one of its CPU kernels: ``"flash"`` or ``"math"``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    choice = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
        with sdpa_kernel(choice):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _naive_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    if causal:
        length = q.shape[-2]
        scores.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def _naive_numpy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    scores = qn @ np.ascontiguousarray(np.swapaxes(kn, -1, -2)) / math.sqrt(qn.shape[-1])
    if causal:
        length = qn.shape[-2]
        scores[..., np.triu(np.ones((length, length), dtype=bool), 1)] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores @ vn


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if causal:
        length = q.shape[-2]
        block_mask = create_block_mask(
            lambda b, h, i, j: i >= j, None, None, length, length, device="cpu"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return flex_attention(q, k, v, block_mask=block_mask)


def _tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    return tiled_attention(q, k, v, is_causal=causal)


def _auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    return scaled_dot_product_attention(q, k, v, is_causal=causal)


def compiled_flex() -> Callable[..., Any]:
    """torch's ``flex_attention`` under ``torch.compile`` (compiled on its first call), with
    room for a compilation per case, as FlexAttention's own benchmarks give it (past
    torch's default of 8, it would run uncompiled)."""
    from torch.nn.attention.flex_attention import flex_attention

    raise_recompile_limits()
    compiled: Callable[..., Any] = torch.compile(flex_attention)
    return compiled


PEERS: dict[str, tuple[Peer, int]] = {
    # name: (function, the longest sequence it runs at: the slow ones stop early)
    "tiled": (_tiled, 1 << 20),
    "qkv-auto": (_auto, 1 << 20),  # what a user's call runs: qkv's public function
    "sdpa-flash": (sdpa_peer("flash"), 1 << 20),
    "sdpa-math": (sdpa_peer("math"), 4096),
    "naive-torch": (_naive_torch, 4096),
    "naive-numpy": (_naive_numpy, 2048),
    "flex-eager": (_flex, 2048),
}


def inputs(length: int, *, heads: int = HEADS, seed: int = 0) -> Inputs:
    """Random q, k, v of shape (1, heads, length, 64), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, length, DIM, generator=generator) for _ in range(3))
    return q, k, v


def forward_flops(q_len: int, kv_len: int, allowed: float = 1.0) -> float:
    """4·B·H·Lq·Lk·D times the share of allowed pairs (B = 1, H = 8, D = 64)."""
    return 4.0 * HEADS * q_len * kv_len * DIM * allowed


def causal_share(length: int) -> float:
    """The share of (query, key) pairs a causal mask allows at this length."""
    return (length + 1) / (2 * length)


# -- timing --------------------------------------------------------------------------------


def timed(run: Callable[[], Any]) -> float:
    """Seconds one call of ``run`` takes."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class Timings(dict[str, float]):
    """Median seconds by run, with ``spreads``: how far each run's repeats scatter."""

    def __init__(self, medians: dict[str, float], spreads: dict[str, float]) -> None:
        super().__init__(medians)
        self.spreads = spreads


def spread(times: Sequence[float]) -> float:
    """How far repeated timings scatter: their interquartile range over their median (0
    for a single one).

    Example:
        >>> spread([1.0]), spread([1.0, 1.0, 1.0]), spread([1.0, 1.0, 2.0, 1.0])
        (0.0, 0.0, 0.25)
    """
    if len(times) < 2:
        return 0.0
    low, _, high = statistics.quantiles(times, n=4, method="inclusive")
    return (high - low) / statistics.median(times)


def medians(runs: dict[str, Callable[[], Any]], repeats: int, *, budget: float = 0.0) -> Timings:
    """Median seconds of each run; the runs alternate within each repeat. A first call that
    takes over a second counts as a repeat (no separate warm-up). ``budget``: a run is
    timed more often, until its calls take about that many seconds (at most
    :data:`MOST_REPEATS`), so that a few-millisecond call's median is one of many. The
    result's ``spreads`` say how far each run's repeats scatter (:func:`spread`)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    wanted: dict[str, int] = {}
    for name, run in runs.items():
        first = timed(run)
        if first > 1.0:
            times[name].append(first)
        wanted[name] = max(repeats, min(MOST_REPEATS, int(budget / max(first, 1e-9))))
    for i in range(max(wanted.values(), default=0)):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            if len(times[name]) < wanted[name]:
                times[name].append(timed(runs[name]))
    return Timings(
        {name: statistics.median(values) for name, values in times.items()},
        {name: spread(values) for name, values in times.items()},
    )


def ratios(rows: list[Row], reference: str, *, memory: bool = False) -> None:
    """Set each row's ratio (and memory ratio) to the reference peer's row of its case."""
    base: dict[tuple[str, int], Row] = {(r.case, r.length): r for r in rows if r.peer == reference}
    for row in rows:
        ref = base.get((row.case, row.length))
        if ref is None:
            continue
        if row.seconds is not None and ref.seconds:
            row.ratio = row.seconds / ref.seconds
        if memory and row.memory is not None and ref.memory:
            row.memory_ratio = row.memory / ref.memory
