"""The benchmark suite behind ``qkv bench`` and ``benchmarks/bench_attention.py``.

Every figure is measured in one run beside its peers and reported also as a ratio to one of
them, so that a machine busy with other work slows both sides alike (peers alternate within
each repeat; the median of the repeats is kept).

- time: ``time.perf_counter`` around one call, median of the repeats;
- attained GFLOP/s: the useful floating-point operations (4·B·H·Lq·Lk·D for a forward pass,
  times the share of allowed (query, key) pairs; 3.5 times that for forward + backward)
  divided by the time, and as a share of the machine's own float32 matrix product rate,
  measured first (a 2048 × 2048 × 2048 product);
- peak memory: the resident memory a call adds at its peak, measured by the operating system
  in a fresh process (:mod:`qkv.kernels._memory`: PyTorch's CPU allocations are invisible to
  ``tracemalloc``).

Peers: the tiled kernel (``qkv.kernels.tiled_attention``); torch's SDPA with the CPU flash
kernel and with the math kernel (``torch.nn.attention.sdpa_kernel``); naive attention that
materialises softmax(Q·Kᵀ/√d)·V in PyTorch and in NumPy; FlexAttention in eager mode (no
``torch.compile``). Slow peers run only at the lengths where they finish in seconds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qkv import masks
from qkv.kernels._api import tiled_attention
from qkv.kernels._memory import peak_memory

__all__ = ["Row", "Settings", "Table", "machine", "run_suite"]

HEADS, DIM = 8, 64


@dataclass(frozen=True)
class Settings:
    """What to measure: lengths and repeats (``quick`` for a run under a minute)."""

    lengths: tuple[int, ...] = (1024, 4096, 16384)
    mask_length: int = 16384
    long_length: int = 32768
    decode_length: int = 32768
    trace_length: int = 4096
    repeats: int = 3
    threads: int = 0  # 0: PyTorch's default
    quick: bool = False

    @classmethod
    def quick_run(cls) -> Settings:
        return cls((512, 1024, 2048), 4096, 4096, 4096, 2048, 2, quick=True)


@dataclass
class Row:
    """One measured case of one peer."""

    case: str
    length: int
    peer: str
    seconds: float | None
    flops: float = 0.0
    memory: int | None = None
    ratio: float | None = None  # seconds / the table's reference peer's seconds
    memory_ratio: float | None = None
    note: str = ""


@dataclass
class Table:
    """The rows of one section, with its title and what the ratios compare to."""

    key: str
    title: str
    reference: str
    rows: list[Row] = field(default_factory=list)
    note: str = ""


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


def gemm_rate(repeats: int = 5) -> float:
    """The machine's float32 matrix product rate in GFLOP/s: the fastest of ``repeats``
    2048 × 2048 × 2048 products (what the machine can do, when nothing else runs)."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = [_timed(lambda: a @ b) for _ in range(repeats)]
    return 2 * n**3 / min(times) / 1e9


# -- peers ---------------------------------------------------------------------------------

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Peer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Any]


def _sdpa(backend: str) -> Peer:
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


PEERS: dict[str, tuple[Peer, int]] = {
    # name: (function, the longest sequence it runs at: the slow ones stop early)
    "tiled": (_tiled, 1 << 20),
    "sdpa-flash": (_sdpa("flash"), 1 << 20),
    "sdpa-math": (_sdpa("math"), 4096),
    "naive-torch": (_naive_torch, 4096),
    "naive-numpy": (_naive_numpy, 2048),
    "flex-eager": (_flex, 2048),
}


def _inputs(length: int, *, heads: int = HEADS, seed: int = 0) -> Inputs:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, length, DIM, generator=generator) for _ in range(3))
    return q, k, v


def forward_flops(q_len: int, kv_len: int, allowed: float = 1.0) -> float:
    """4·B·H·Lq·Lk·D times the share of allowed pairs (B = 1, H = 8, D = 64)."""
    return 4.0 * HEADS * q_len * kv_len * DIM * allowed


def _causal_share(length: int) -> float:
    return (length + 1) / (2 * length)


# -- timing --------------------------------------------------------------------------------


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _medians(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each run; the runs alternate within each repeat. A first call that
    takes over a second counts as a repeat (no separate warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, run in runs.items():
        first = _timed(run)
        if first > 1.0:
            times[name].append(first)
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            if len(times[name]) < repeats:
                times[name].append(_timed(runs[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def _ratios(rows: list[Row], reference: str, *, memory: bool = False) -> None:
    base: dict[tuple[str, int], Row] = {(r.case, r.length): r for r in rows if r.peer == reference}
    for row in rows:
        ref = base.get((row.case, row.length))
        if ref is None:
            continue
        if row.seconds is not None and ref.seconds:
            row.ratio = row.seconds / ref.seconds
        if memory and row.memory is not None and ref.memory:
            row.memory_ratio = row.memory / ref.memory


# -- sections ------------------------------------------------------------------------------


def dense_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Dense and causal forward: every peer where it runs, against SDPA's flash kernel."""
    table = Table(
        "dense",
        "Dense and causal forward (B=1, H=8, D=64, float32)",
        "sdpa-flash",
        note="ratio: time / sdpa-flash time at the same length and mask (below 1 is faster).",
    )
    for length in settings.lengths:
        q, k, v = _inputs(length)
        for causal in (False, True):
            case = "causal" if causal else "dense"
            runs: dict[str, Callable[[], Any]] = {
                name: functools.partial(fn, q, k, v, causal)
                for name, (fn, longest) in PEERS.items()
                if length <= longest
            }
            medians = _medians(runs, settings.repeats)
            share = _causal_share(length) if causal else 1.0
            for name, seconds in medians.items():
                flops = forward_flops(length, length, share)
                table.rows.append(Row(case, length, name, seconds, flops))
            tick()
    _ratios(table.rows, "sdpa-flash")
    return table


def _structured(kind: str, length: int) -> tuple[masks.Mask, float]:
    """The mask of a structured case and its share of allowed pairs."""
    if kind == "window":
        rule = masks.sliding_window(511)  # w = 512 keys: itself and the 511 before
        allowed = sum(min(i + 1, 512) for i in range(length)) / length**2
        return rule, allowed
    documents = 16
    ids = np.repeat(np.arange(documents), -(-length // documents))[:length]
    rule = masks.document(ids) & masks.causal()
    sizes = np.bincount(ids)
    return rule, float(sum(s * (s + 1) / 2 for s in sizes)) / length**2


def _worker_masks(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: time and peak memory of one structured-mask case."""
    length, kind, peer, repeats = spec["length"], spec["kind"], spec["peer"], spec["repeats"]
    q, k, v = _inputs(length)
    rule, _ = _structured(kind, length)
    if peer == "tiled":

        def run() -> Any:
            return tiled_attention(q, k, v, mask=rule)

    else:
        dense = rule.dense(length, length, xp=_torch_namespace())  # built before: its input

        def run() -> Any:
            return _sdpa_masked(q, k, v, dense)

    _warm_up()
    added, _ = peak_memory(run)
    times = [_timed(run) for _ in range(max(repeats - 1, 1))]
    return {"seconds": statistics.median(times), "memory": added}


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _torch_namespace() -> Any:
    import array_api_compat.torch as torch_xp

    return torch_xp


def _warm_up() -> None:
    """Load the kernels' code before measuring memory (a tiny call of each)."""
    q, k, v = _inputs(64, heads=1)
    tiled_attention(q, k, v, is_causal=True)
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    _sdpa_masked(q, k, v, torch.ones(64, 64, dtype=torch.bool))


def masks_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Sliding window and documents: tiled against SDPA given the equivalent dense mask."""
    length = settings.mask_length
    table = Table(
        "masks",
        f"Structured masks, forward at N={length} (B=1, H=8, D=64)",
        "sdpa-dense-mask",
        note=(
            "sdpa-dense-mask: torch SDPA given the (N, N) boolean mask (built before the call, "
            "not timed). ratio: time / its time; mem: peak memory added by the call / its. "
            "Sliding window: w = 512 keys; documents: 16 causal documents packed in one row."
        ),
    )
    for kind in ("window", "documents"):
        _, allowed = _structured(kind, length)
        for peer in ("tiled", "sdpa-dense-mask"):
            spec = {"length": length, "kind": kind, "peer": peer, "repeats": settings.repeats}
            result = _in_subprocess("masks", spec, settings)
            table.rows.append(
                Row(
                    kind,
                    length,
                    peer,
                    result["seconds"],
                    forward_flops(length, length, allowed),
                    result["memory"],
                )
            )
            tick()
    _ratios(table.rows, "sdpa-dense-mask", memory=True)
    return table


def _worker_long(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: forward + backward, causal, at a long length: time and memory."""
    length = spec["length"]
    q, k, v = (x.requires_grad_() for x in _inputs(length))
    _warm_up()
    grad = torch.randn(1, HEADS, length, DIM)

    def run() -> Any:
        out = tiled_attention(q, k, v, is_causal=True)
        out.backward(grad)
        return out

    start = time.perf_counter()
    added, _ = peak_memory(run)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "memory": added}


def long_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Forward + backward, causal, at a length whose (N, N) matrix would not fit."""
    length = settings.long_length
    tensor = HEADS * length * DIM * 4
    result = _in_subprocess("long", {"length": length}, settings)
    outputs = 4 * tensor  # out, dq, dk, dv (q, k, v exist before the call)
    above = result["memory"] - outputs
    naive = HEADS * length * length * 4
    table = Table(
        "long",
        f"Forward + backward, causal, N={length} (B=1, H=8, D=64)",
        "tiled",
        note=(
            f"memory: peak memory the call adds, minus its outputs (out, dQ, dK, dV: "
            f"{_gib(outputs)}); q, k, v ({_gib(3 * tensor)}) exist before. One (N, N) "
            f"float32 matrix per head, as naive attention keeps: {_gib(naive)}."
        ),
    )
    flops = 3.5 * forward_flops(length, length, _causal_share(length))
    table.rows.append(Row("fwd+bwd", length, "tiled", result["seconds"], flops, max(above, 0)))
    tick()
    return table


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def trace_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """What the public entry costs over the kernel (tracing off, checks, dispatch)."""
    import qkv

    length = settings.trace_length
    q, k, v = _inputs(length)
    runs = {
        "tiled kernel": lambda: tiled_attention(q, k, v, is_causal=True),
        "qkv tiled": lambda: qkv.scaled_dot_product_attention(
            q, k, v, is_causal=True, backend="tiled"
        ),
        "sdpa direct": lambda: _sdpa("flash")(q, k, v, True),
        "qkv auto": lambda: qkv.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    medians = _medians(runs, max(settings.repeats, 9))  # short runs, a small difference
    table = Table(
        "trace",
        f"Cost of the public entry with tracing off, causal, N={length}",
        "",
        note=(
            "qkv tiled: qkv.scaled_dot_product_attention(..., backend='tiled') against the "
            "kernel called directly; qkv auto (which picks sdpa) against torch's SDPA."
        ),
    )
    flops = forward_flops(length, length, _causal_share(length))
    pairs = (("tiled kernel", "qkv tiled"), ("sdpa direct", "qkv auto"))
    for base, entry in pairs:
        table.rows.append(Row("causal", length, base, medians[base], flops))
        row = Row("causal", length, entry, medians[entry], flops)
        row.ratio = medians[entry] / medians[base]
        table.rows.append(row)
    tick()
    return table


def decode_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """One decoding step with a KV cache against recomputing causal attention."""
    import qkv

    length = settings.decode_length
    q, k, v = _inputs(length + 1)
    note = "qkv.nn.KVCache"
    cache_type: Any = None
    try:
        from qkv.nn import KVCache

        cache_type = KVCache
    except ImportError:  # pragma: no cover - qkv.nn is part of the package
        note = "single-query attention against the cached K, V (qkv.nn not available)"
    if cache_type is not None:
        cache = cache_type()
        with torch.no_grad():
            cache.append(k[:, :, :length], v[:, :, :length])

        def step() -> Any:
            with torch.no_grad():
                keys, values = cache.append(k[:, :, length:], v[:, :, length:])
                return qkv.scaled_dot_product_attention(
                    q[:, :, length:],
                    keys,
                    values,
                    is_causal=True,
                    causal_alignment="bottom-right",
                )

    else:

        def step() -> Any:
            return qkv.scaled_dot_product_attention(
                q[:, :, length:], k, v, is_causal=True, causal_alignment="bottom-right"
            )

    def recompute() -> Any:
        with torch.no_grad():
            return qkv.scaled_dot_product_attention(q, k, v, is_causal=True)

    step_times = [_timed(step) for _ in range(max(settings.repeats, 5) + 1)][1:]
    full = _medians({"recompute": recompute}, min(settings.repeats, 2))["recompute"]
    table = Table(
        "decode",
        f"One decoding step, KV cache of {length} tokens",
        "recompute",
        note=f"decode: append one token to a {note} and attend; recompute: causal attention "
        f"over all {length + 1} tokens (qkv auto). ratio: time / recompute time.",
    )
    table.rows.append(
        Row(
            "decode",
            length,
            "recompute",
            full,
            forward_flops(length + 1, length + 1, _causal_share(length + 1)),
        )
    )
    table.rows.append(
        Row("decode", length, "decode", statistics.median(step_times), forward_flops(1, length + 1))
    )
    _ratios(table.rows, "recompute")
    tick()
    return table


# -- running -------------------------------------------------------------------------------

SECTIONS: dict[
    str, tuple[Callable[[Settings, Callable[[], None]], Table], Callable[[Settings], int]]
] = {
    # name: (the section, how many progress ticks it makes)
    "dense": (dense_section, lambda s: 2 * len(s.lengths)),
    "masks": (masks_section, lambda s: 4),
    "long": (long_section, lambda s: 1),
    "trace": (trace_section, lambda s: 1),
    "decode": (decode_section, lambda s: 1),
}


def run_suite(
    settings: Settings,
    sections: Sequence[str] = tuple(SECTIONS),
    tick: Callable[[str], None] = lambda name: None,
) -> Iterator[Table]:
    """Measure the sections one after the other, yielding each table when it is done."""
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        for name in sections:
            section, _ = SECTIONS[name]
            yield section(settings, functools.partial(tick, name))
    finally:
        torch.set_num_threads(threads)


def ticks(settings: Settings, sections: Sequence[str]) -> int:
    return sum(SECTIONS[name][1](settings) for name in sections)


def _in_subprocess(kind: str, spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Run a worker of this module in a fresh Python process; return its JSON answer."""
    spec = {**spec, "threads": settings.threads or torch.get_num_threads()}
    command = [sys.executable, "-m", "qkv.kernels._suite", kind, json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"benchmark worker {kind} failed: {' | '.join(tail)}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _main(argv: Sequence[str]) -> int:
    kind, spec = argv[0], json.loads(argv[1])
    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    worker = {"masks": _worker_masks, "long": _worker_long}[kind]
    print(json.dumps(worker(spec)))
    return 0


if __name__ == "__main__":  # pragma: no cover - run by _in_subprocess
    raise SystemExit(_main(sys.argv[1:]))
