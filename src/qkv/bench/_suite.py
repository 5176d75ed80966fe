"""The benchmark suite behind ``qkv bench`` and ``benchmarks/bench_attention.py``: its
sections, each a table of rows, measured one after the other.

How time, GFLOP/s and the peers are measured: :mod:`qkv.bench._measure`. Peak memory: the
resident memory a call adds at its peak, measured by the operating system in a fresh process
(:mod:`qkv.bench._memory`: PyTorch's CPU allocations are invisible to ``tracemalloc``); the
masks and long sections run their workers in a fresh Python process (``python -m
qkv.bench._suite KIND SPEC``): the masks section times the peers of a case interleaved in
one process and measures each one's memory in a process of its own.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from qkv.attention import explain_dispatch, scaled_dot_product_attention
from qkv.bench._decode import decode_section
from qkv.bench._measure import (
    DIM,
    HEADS,
    PEERS,
    causal_share,
    compiled_flex,
    flex_block_mask,
    forward_flops,
    gemm_rate,
    in_fresh_process,
    inputs,
    load_average,
    machine,
    medians,
    ratios,
    sdpa_peer,
    timed,
)
from qkv.bench._memory import peak_memory
from qkv.bench._patching import patching_section, patching_ticks
from qkv.bench._results import Row, Settings, Table
from qkv.bench._sdpa_sections import backward_section, trace_section
from qkv.bench._tables import ON_REQUEST
from qkv.bench._targets import targets_table, worst
from qkv.bench._train_step import train_step_section
from qkv.kernels import tiled_attention
from qkv.masks import Mask, document, sliding_window
from qkv.masks import causal as causal_rule

__all__ = [
    "MASK_KINDS",
    "SECTIONS",
    "Row",
    "Settings",
    "Table",
    "gemm_rate",
    "machine",
    "run_suite",
    "targets_table",
    "ticks",
    "torch_mask_mod",
]

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
            # at N = 1024 a median of about a hundred: auto's target there is 1.03 × SDPA
            seconds_of = medians(runs, settings.repeats, budget=settings.budget("dense"))
            share = causal_share(length) if causal else 1.0
            for name, seconds in seconds_of.items():
                flops = forward_flops(length, length, share)
                row = Row(case, length, name, seconds, flops)
                row.spread = seconds_of.spreads[name]
                table.rows.append(row)
            tick()
    ratios(table.rows, "sdpa-flash")
    return table


MASK_KINDS = ("causal", "window", "documents")
"""The structured masks: causal, a sliding window of 512 keys, 16 causal documents."""

WINDOW, DOCUMENTS = 512, 16


def _document_ids(length: int) -> np.ndarray:
    return np.repeat(np.arange(DOCUMENTS), -(-length // DOCUMENTS))[:length]


def _structured(kind: str, length: int) -> tuple[Mask, float]:
    """The mask of a structured case and its share of allowed pairs."""
    if kind == "causal":
        return causal_rule(), causal_share(length)
    if kind == "window":
        rule = sliding_window(WINDOW - 1)  # w = 512 keys: itself and the 511 before
        allowed = sum(min(i + 1, WINDOW) for i in range(length)) / length**2
        return rule, allowed
    ids = _document_ids(length)
    rule = document(ids) & causal_rule()
    sizes = np.bincount(ids)
    return rule, float(sum(s * (s + 1) / 2 for s in sizes)) / length**2


def torch_mask_mod(kind: str, length: int) -> Callable[..., Any]:
    """The rule of a structured case as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``."""
    if kind == "causal":
        return lambda b, h, i, j: i >= j
    if kind == "window":
        return lambda b, h, i, j: (i >= j) & (i - j < WINDOW)
    ids = torch.from_numpy(_document_ids(length))
    return lambda b, h, i, j: (ids[i] == ids[j]) & (i >= j)


def _mask_peer(
    peer: str, kind: str, length: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[Callable[[], Any], float | None]:
    """One peer of a structured-mask case, ready to time: (its call, the seconds its first
    calls spent compiling, or None). Raises when compiled FlexAttention cannot compile."""
    rule, _ = _structured(kind, length)
    if peer == "tiled":
        return (lambda: tiled_attention(q, k, v, mask=rule)), None
    if peer == "qkv-auto":

        def auto() -> Any:
            return scaled_dot_product_attention(q, k, v, mask=rule)

        return auto, warm_auto(auto)
    if peer == "flex-compiled":
        block_mask = flex_block_mask(rule, torch_mask_mod(kind, length), length)
        flex = compiled_flex()

        def run() -> Any:
            return flex(q, k, v, block_mask=block_mask)

        return run, timed(run)
    if peer == "sdpa-flash":  # causal: SDPA's own causal kernel, no mask
        return (lambda: sdpa_peer("flash")(q, k, v, True)), None
    dense = rule.dense(length, length, xp=_torch_namespace())  # built before: its input
    return (lambda: _sdpa_masked(q, k, v, dense)), None


def _failure(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


def _worker_masks(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the peers of one structured-mask case, timed interleaved (each
    repeat calls every peer once, so that a change of the machine's load hits all alike),
    after their first calls (compiling, and auto's repeats: 'compile' apart)."""
    length, kind, repeats = spec["length"], spec["kind"], spec["repeats"]
    q, k, v = inputs(length)
    runs: dict[str, Callable[[], Any]] = {}
    compiled: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    # torch's own compiled FlexAttention first: compiled after qkv's, torch 2.13's CPU code
    # generator can emit C++ that does not compile (an undeclared `cur_qSplitSize8`).
    for peer in sorted(spec["peers"], key=lambda name: name != "flex-compiled"):
        try:
            runs[peer], compiled[peer] = _mask_peer(peer, kind, length, q, k, v)
        except Exception as error:  # no C++ compiler, an unsupported platform
            errors[peer] = _failure(error)
    runs = {peer: runs[peer] for peer in spec["peers"] if peer in runs}  # the table's order
    seconds = medians(runs, max(repeats, 1), budget=spec.get("budget", 0.0))
    rule, _ = _structured(kind, length)
    ran = explain_dispatch(q, k, v, mask=rule).backend
    return {
        "seconds": dict(seconds),
        "spreads": seconds.spreads,
        "compile": compiled,
        "errors": errors,
        "ran": ran,
    }


def _worker_mask_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the memory one peer's call adds at its peak (after its first
    calls), where no other peer's allocations hide it."""
    length, kind = spec["length"], spec["kind"]
    q, k, v = inputs(length)
    try:
        run, _ = _mask_peer(spec["peer"], kind, length, q, k, v)
    except Exception as error:
        return {"memory": None, "error": _failure(error)}
    _warm_up()
    added, _ = peak_memory(run)
    return {"memory": added}


def warm_auto(run: Callable[[], Any]) -> float | None:
    """Call ``run`` (a qkv call with ``backend="auto"``) as a model's layers and steps call
    it before it is timed: auto counts the calls of a rule and shape, compiles FlexAttention
    on the :data:`~qkv.kernels._compiled_forward.REPEATS`-th and keeps the faster path
    after timing the next few. Returns the seconds its compilations took (None: nothing was
    compiled)."""
    from qkv.kernels._compiled_forward import COMPILED, REPEATS, VERDICT_SAMPLES

    before = set(COMPILED.seconds)
    for _ in range(REPEATS + VERDICT_SAMPLES + 1):
        run()
    new = set(COMPILED.seconds) - before
    return sum(COMPILED.seconds[key] for key in new) if new else None


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


def _mask_peers(kind: str) -> tuple[str, ...]:
    sdpa = "sdpa-flash" if kind == "causal" else "sdpa-dense-mask"
    return ("tiled", "qkv-auto", "flex-compiled", sdpa)


def masks_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Causal, sliding window and documents: tiled against compiled FlexAttention (the
    ratio) and SDPA (its causal kernel, or the equivalent dense mask), at 4096 and longer."""
    lengths = settings.mask_lengths
    table = Table(
        "masks",
        f"Structured masks, forward at N={', '.join(map(str, lengths))} (B=1, H=8, D=64)",
        "flex-compiled",
        note=(
            "ratio: time / flex-compiled time (torch.compile(flex_attention) with a BlockMask "
            "of 128-blocks; its first call, compiling, is 'compile s', apart). qkv-auto: "
            "qkv.scaled_dot_product_attention(q, k, v, mask=rule), timed after the calls a "
            "model's layers make first (auto compiles from the third; its compile s apart), "
            "the backend it ran in brackets (flex: qkv's BlockMask, of 64-blocks on CPU). "
            "sdpa-dense-mask: torch SDPA given the (N, N) boolean mask, built before the call; "
            "causal: SDPA's own causal kernel. peak MiB: memory the call adds. Window: w = "
            f"{WINDOW} keys; documents: {DOCUMENTS} causal documents packed in one row."
        ),
    )
    for length in lengths:
        for kind in MASK_KINDS:
            _, allowed = _structured(kind, length)
            peers = _mask_peers(kind)
            case = {
                "length": length,
                "kind": kind,
                "repeats": settings.repeats,
                "budget": settings.budget("masks"),  # a median of 9 at N = 16384
            }
            timing = _in_subprocess("masks", {**case, "peers": peers}, settings)
            for peer in peers:
                memory = _in_subprocess("mask-memory", {**case, "peer": peer}, settings)
                row = Row(
                    kind,
                    length,
                    peer,
                    timing["seconds"].get(peer),
                    forward_flops(length, length, allowed),
                    memory["memory"],
                    note=timing["errors"].get(peer, ""),
                )
                row.compile_seconds = timing["compile"].get(peer)
                row.spread = timing["spreads"].get(peer)
                row.ran = timing["ran"] if peer == "qkv-auto" else ""
                table.rows.append(row)
                tick()
    ratios(table.rows, "flex-compiled")
    failed = {r.note for r in table.rows if r.note}
    if failed:
        table.note += " flex-compiled failed: " + "; ".join(sorted(failed))
    return table


TRAINED_MASKS = ("window", "documents")
"""The structured masks of the forward + backward table (causal: the backward table)."""


def masks_backward_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Forward + backward with a sliding window and with documents: qkv (auto and the
    tiled kernel) against what torch offers on CPU for a trained structured mask (its
    FlexAttention refuses the backward there): SDPA with the dense mask, naive attention."""
    length = settings.train_length
    table = Table(
        "masks-bwd",
        f"Structured masks, forward + backward at N={length} (B=1, H=8, D=64)",
        "sdpa-dense-mask",
        note=(
            "ratio: time / sdpa-dense-mask time (forward, then the gradients of q, k and v). "
            "sdpa-dense-mask: torch SDPA given the (N, N) boolean mask, built before; "
            "naive-torch: softmax(Q·Kᵀ/√d + mask)·V materialised. FlexAttention, eager or "
            "compiled, has no backward on CPU. qkv-auto: timed after the calls a model "
            "makes first (auto compiles the forward from the third; compile s apart)."
        ),
    )
    q, k, v = (x.requires_grad_() for x in inputs(length))
    grad = torch.randn(1, HEADS, length, DIM, generator=torch.Generator().manual_seed(1))
    for kind in TRAINED_MASKS:
        rule, allowed = _structured(kind, length)
        dense = rule.dense(length, length, xp=_torch_namespace())

        def train(forward: Callable[[], torch.Tensor]) -> Callable[[], Any]:
            return lambda: torch.autograd.grad(forward(), (q, k, v), grad)

        runs = {
            "tiled": train(lambda: tiled_attention(q, k, v, mask=rule)),  # noqa: B023
            "qkv-auto": train(lambda: scaled_dot_product_attention(q, k, v, mask=rule)),  # noqa: B023
            "sdpa-dense-mask": train(lambda: _sdpa_masked(q, k, v, dense)),  # noqa: B023
            "naive-torch": train(lambda: _naive_masked(q, k, v, dense)),  # noqa: B023
        }
        compile_seconds = warm_auto(runs["qkv-auto"])
        seconds_of = medians(runs, settings.repeats)
        ran = explain_dispatch(q, k, v, mask=rule).backend
        for name, seconds in seconds_of.items():
            row = Row(kind, length, name, seconds, 3.5 * forward_flops(length, length, allowed))
            row.spread = seconds_of.spreads[name]
            if name == "qkv-auto":
                row.compile_seconds, row.ran = compile_seconds, ran
            table.rows.append(row)
        tick()
    ratios(table.rows, "sdpa-dense-mask")
    return table


def _naive_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / DIM**0.5  # (B, H, N, N)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


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


# -- running -------------------------------------------------------------------------------

SECTIONS: dict[
    str, tuple[Callable[[Settings, Callable[[], None]], Table], Callable[[Settings], int]]
] = {
    # name: (the section, how many progress ticks it makes)
    "dense": (dense_section, lambda s: 2 * len(s.lengths)),
    "masks": (masks_section, lambda s: 4 * len(MASK_KINDS) * len(s.mask_lengths)),
    "backward": (backward_section, lambda s: 2),
    "masks-bwd": (masks_backward_section, lambda s: len(TRAINED_MASKS)),
    "train": (train_step_section, lambda s: 1),
    "long": (long_section, lambda s: 1),
    "trace": (trace_section, lambda s: 1),
    "decode": (decode_section, lambda s: 1),
    "patching": (patching_section, patching_ticks),
}


def run_suite(
    settings: Settings,
    sections: Sequence[str] | None = None,
    tick: Callable[[str], None] = lambda name: None,
) -> Iterator[Table]:
    """Measure the sections one after the other (default: all but those run only on request,
    :data:`~qkv.bench._tables.ON_REQUEST`), yielding each table when it is done."""
    if sections is None:
        sections = tuple(name for name in SECTIONS if name not in ON_REQUEST)
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    done = []
    try:
        for name in sections:
            section, _ = SECTIONS[name]
            before = load_average()
            table = section(settings, functools.partial(tick, name))
            load = worst(before, load_average())  # the busier of its start and end
            for row in table.rows:
                row.load = load
            done.append(table)
            yield table
        targets = targets_table(done)
        if targets is not None:
            yield targets
    finally:
        torch.set_num_threads(threads)


def ticks(settings: Settings, sections: Sequence[str]) -> int:
    return sum(SECTIONS[name][1](settings) for name in sections)


def _in_subprocess(kind: str, spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Run a worker of this module in a fresh Python process; return its JSON answer."""
    spec = {**spec, "threads": settings.threads or torch.get_num_threads()}
    return in_fresh_process(
        "qkv.bench._suite", [kind, json.dumps(spec)], f"benchmark worker {kind}"
    )


def _main(argv: Sequence[str]) -> int:
    kind, spec = argv[0], json.loads(argv[1])
    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    worker = {
        "masks": _worker_masks,
        "mask-memory": _worker_mask_memory,
        "long": _worker_long,
    }[kind]
    print(json.dumps(worker(spec)))
    return 0


if __name__ == "__main__":  # pragma: no cover - run by _in_subprocess
    raise SystemExit(_main(sys.argv[1:]))
