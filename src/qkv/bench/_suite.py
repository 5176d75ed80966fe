"""The benchmark suite behind ``qkv bench`` and ``benchmarks/bench_attention.py``: its
sections, each a table of rows, measured one after the other.

How time, GFLOP/s and the peers are measured: :mod:`qkv.bench._measure`. Peak memory: the
resident memory a call adds at its peak, measured by the operating system in a fresh process
(:mod:`qkv.bench._memory`: PyTorch's CPU allocations are invisible to ``tracemalloc``); the
masks and long sections run their workers in a fresh Python process (``python -m
qkv.bench._suite KIND SPEC``).
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from qkv.attention import scaled_dot_product_attention
from qkv.bench._measure import (
    DIM,
    HEADS,
    PEERS,
    causal_share,
    forward_flops,
    gemm_rate,
    inputs,
    machine,
    medians,
    ratios,
    sdpa_peer,
    timed,
)
from qkv.bench._memory import peak_memory
from qkv.bench._results import Row, Settings, Table
from qkv.kernels import tiled_attention
from qkv.masks import Mask, document, sliding_window
from qkv.masks import causal as causal_rule
from qkv.nn import KVCache

__all__ = ["SECTIONS", "Row", "Settings", "Table", "gemm_rate", "machine", "run_suite", "ticks"]

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
        q, k, v = inputs(length)
        for causal in (False, True):
            case = "causal" if causal else "dense"
            runs: dict[str, Callable[[], Any]] = {
                name: functools.partial(fn, q, k, v, causal)
                for name, (fn, longest) in PEERS.items()
                if length <= longest
            }
            seconds_of = medians(runs, settings.repeats)
            share = causal_share(length) if causal else 1.0
            for name, seconds in seconds_of.items():
                flops = forward_flops(length, length, share)
                table.rows.append(Row(case, length, name, seconds, flops))
            tick()
    ratios(table.rows, "sdpa-flash")
    return table


def _structured(kind: str, length: int) -> tuple[Mask, float]:
    """The mask of a structured case and its share of allowed pairs."""
    if kind == "window":
        rule = sliding_window(511)  # w = 512 keys: itself and the 511 before
        allowed = sum(min(i + 1, 512) for i in range(length)) / length**2
        return rule, allowed
    documents = 16
    ids = np.repeat(np.arange(documents), -(-length // documents))[:length]
    rule = document(ids) & causal_rule()
    sizes = np.bincount(ids)
    return rule, float(sum(s * (s + 1) / 2 for s in sizes)) / length**2


def _worker_masks(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: time and peak memory of one structured-mask case."""
    length, kind, peer, repeats = spec["length"], spec["kind"], spec["peer"], spec["repeats"]
    q, k, v = inputs(length)
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
    times = [timed(run) for _ in range(max(repeats - 1, 1))]
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
    q, k, v = inputs(64, heads=1)
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
    ratios(table.rows, "sdpa-dense-mask", memory=True)
    return table


def _worker_long(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: forward + backward, causal, at a long length: time and memory."""
    length = spec["length"]
    q, k, v = (x.requires_grad_() for x in inputs(length))
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
    flops = 3.5 * forward_flops(length, length, causal_share(length))
    table.rows.append(Row("fwd+bwd", length, "tiled", result["seconds"], flops, max(above, 0)))
    tick()
    return table


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def trace_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """What the public entry costs over the kernel (tracing off, checks, dispatch)."""
    length = settings.trace_length
    q, k, v = inputs(length)
    runs = {
        "tiled kernel": lambda: tiled_attention(q, k, v, is_causal=True),
        "qkv tiled": lambda: scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled"),
        "sdpa direct": lambda: sdpa_peer("flash")(q, k, v, True),
        "qkv auto": lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    seconds_of = medians(runs, max(settings.repeats, 9))  # short runs, a small difference
    table = Table(
        "trace",
        f"Cost of the public entry with tracing off, causal, N={length}",
        "",
        note=(
            "qkv tiled: qkv.scaled_dot_product_attention(..., backend='tiled') against the "
            "kernel called directly; qkv auto (which picks sdpa) against torch's SDPA."
        ),
    )
    flops = forward_flops(length, length, causal_share(length))
    pairs = (("tiled kernel", "qkv tiled"), ("sdpa direct", "qkv auto"))
    for base, entry in pairs:
        table.rows.append(Row("causal", length, base, seconds_of[base], flops))
        row = Row("causal", length, entry, seconds_of[entry], flops)
        row.ratio = seconds_of[entry] / seconds_of[base]
        table.rows.append(row)
    tick()
    return table


def decode_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """One decoding step with a KV cache against recomputing causal attention."""
    length = settings.decode_length
    q, k, v = inputs(length + 1)
    note = "qkv.nn.KVCache"
    cache = KVCache()
    with torch.no_grad():
        cache.append(k[:, :, :length], v[:, :, :length])

    def step() -> Any:
        with torch.no_grad():
            keys, values = cache.append(k[:, :, length:], v[:, :, length:])
            return scaled_dot_product_attention(
                q[:, :, length:],
                keys,
                values,
                is_causal=True,
                causal_alignment="bottom-right",
            )

    def recompute() -> Any:
        with torch.no_grad():
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    step_times = [timed(step) for _ in range(max(settings.repeats, 5) + 1)][1:]
    full = medians({"recompute": recompute}, min(settings.repeats, 2))["recompute"]
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
            forward_flops(length + 1, length + 1, causal_share(length + 1)),
        )
    )
    table.rows.append(
        Row("decode", length, "decode", statistics.median(step_times), forward_flops(1, length + 1))
    )
    ratios(table.rows, "recompute")
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
    command = [sys.executable, "-m", "qkv.bench._suite", kind, json.dumps(spec)]
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
