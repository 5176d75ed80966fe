"""The sections of ``qkv bench`` timed against torch's SDPA alone: ``backward`` (forward +
backward, dense and causal, tiled kernel against SDPA's flash kernel) and ``trace`` (what the
public entry costs over the kernel it runs, tracing off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qkv.attention import scaled_dot_product_attention
from qkv.bench._measure import (
    DIM,
    HEADS,
    causal_share,
    forward_flops,
    inputs,
    medians,
    ratios,
    sdpa_peer,
)
from qkv.bench._results import Row, Settings, Table
from qkv.kernels import tiled_attention

__all__ = ["backward_section", "trace_section"]


def backward_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """Forward + backward, dense and causal: tiled against SDPA's flash kernel (compiled
    FlexAttention has no backward on CPU)."""
    length = settings.train_length
    table = Table(
        "backward",
        f"Forward + backward at N={length} (B=1, H=8, D=64, float32)",
        "sdpa-flash",
        note="ratio: time / sdpa-flash time (forward, then the gradients of q, k and v).",
    )
    q, k, v = (x.requires_grad_() for x in inputs(length))
    grad = torch.randn(1, HEADS, length, DIM, generator=torch.Generator().manual_seed(1))
    flash = sdpa_peer("flash")

    def train(forward: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(forward(), (q, k, v), grad)

    for causal in (False, True):
        runs = {
            "tiled": train(lambda: tiled_attention(q, k, v, is_causal=causal)),  # noqa: B023
            "sdpa-flash": train(lambda: flash(q, k, v, causal)),  # noqa: B023
        }
        seconds_of = medians(runs, settings.repeats)
        share = causal_share(length) if causal else 1.0
        for name, seconds in seconds_of.items():
            flops = 3.5 * forward_flops(length, length, share)
            row = Row("causal" if causal else "dense", length, name, seconds, flops)
            row.spread = seconds_of.spreads[name]
            table.rows.append(row)
        tick()
    ratios(table.rows, "sdpa-flash")
    return table


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
