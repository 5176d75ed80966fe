"""Run a worked example that gives Q, K and V directly (format 2, ``inputs: {Q, K, V}``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from qkv.attention import merge_heads, scaled_dot_product_attention, split_heads
from qkv.examples._model import Example
from qkv.steps import WORDS
from qkv.trace import Trace

__all__ = ["run_given"]


def run_given(
    example: Example,
    *,
    heads: int,
    scale: float | None,
    causal: bool,
    mask: np.ndarray | None,
    trace: Trace,
) -> None:
    """Record the attention of an example given by Q (Lq, H·D), K (Lk, H·D), V (Lk, H·Dv).

    The columns split into ``heads`` heads as :func:`qkv.attention.split_heads` does (head h
    takes columns h·D … (h+1)·D − 1, as ``qkv check`` splits them), and the reference core
    computes softmax(Q_h·K_hᵀ·scale, masked)·V_h in each head. The trace gets the steps and
    axes that :func:`qkv.multi_head_attention` records after its projections: ``Q``, ``K``,
    ``V``, ``scores``, ``scaled``, ``masked`` (with a mask), ``weights``, ``context``; and,
    with several heads or a W_o, ``concat`` (Lq, H·Dv), then ``W_o`` and ``output``.

    Args:
        example: an example with ``inputs == "qkv"``.
        heads: H, already checked to divide the columns of Q, K and V.
        scale: the core's scale: None for 1/√D, else the factor.
        causal: the causal rule, aligned as ``example.alignment`` says.
        mask: the (Lq, Lk) allowed keys (True = may attend), or None.
        trace: the trace to record into.

    Example:
        >>> from qkv.examples import loads
        >>> ex = loads("format: 2\\ninputs: {Q: [[1, 0]], K: [[1, 0], [0, 1]], "
        ...            "V: [[1, 2], [3, 4]]}\\noptions: {scale: false}")
        >>> t = Trace()
        >>> run_given(ex, heads=1, scale=1.0, causal=False, mask=None, trace=t)
        >>> t["weights"].value.round(4), t["context"].value.round(4)
        (array([[0.7311, 0.2689]]), array([[1.5379, 2.5379]]))
    """
    q, k, v = (np.asarray(example.given[name], dtype=np.float64) for name in ("Q", "K", "V"))
    if heads > 1:  # (L, H·D) → (H, L, D); a 3-D call reads its first axis as the heads
        q, k, v = (split_heads(np, x, heads) for x in (q, k, v))
    first = len(trace.steps)
    context = scaled_dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=causal,
        causal_alignment="bottom-right" if example.alignment == "bottom-right" else "top-left",
        scale=scale,
        enable_gqa=heads > 1,
        trace=trace,
        backend="reference",
    )  # (Lq, Dv), or (H, Lq, Dv)
    if heads > 1:
        split = f", split into {heads} heads"
        trace.steps[first:] = [
            dataclasses.replace(step, formula=step.formula + split)
            if step.name in ("Q", "K", "V")
            else step
            for step in trace.steps[first:]
        ]
        context = merge_heads(np, context)  # (Lq, H·Dv): the heads side by side
    if heads > 1 or example.W_o is not None:
        _record(trace, "concat", context, ("query", "feature"))
    if example.W_o is not None:
        _record(trace, "W_o", example.W_o, ("feature", "model"))
        _record(trace, "output", context @ example.W_o, ("query", "model"))


def _record(trace: Trace, name: str, value: np.ndarray, axes: tuple[str, ...]) -> None:
    words = WORDS[name]
    trace.record(name, value, formula=words.formula, description=words.description, axes=axes)
