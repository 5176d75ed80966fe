"""The reference's numerics policy: NaN or ±inf in a masked-out position never reaches the
output or a gradient, and finite inputs whose scores overflow are refused in one line.

Shape legend: scores and weights (..., H, Lq, Lk); query, key (..., L, D); value (..., Lk, Dv).
"""

from __future__ import annotations

import contextlib
from typing import Any

from qkv._array import Array, device, is_torch_namespace

__all__ = ["check_overflow", "clean_scores", "quiet", "weighted_sum"]


def clean_scores(xp: Any, q: Array, k: Array, *, masked: bool) -> Array:
    """S = Q·Kᵀ, (..., H, Lq, Lk).

    With a mask, a NaN or ±inf entry of a query or key must not reach the gradient through a
    masked-out pair: dQ = dS·K has dS = 0 there, but 0 · NaN is NaN. The scores are then
    computed with those entries replaced by 0, and the pairs that involve them take their
    true score with no gradient (as in the tiled kernel): a live NaN still gives NaN.
    """
    with quiet(xp):
        scores = xp.matmul(q, xp.matrix_transpose(k))
    if not masked:
        return scores
    q_ok = xp.all(xp.isfinite(q), axis=-1, keepdims=True)  # (..., Lq, 1)
    k_ok = xp.all(xp.isfinite(k), axis=-1, keepdims=True)  # (..., Lk, 1)
    if bool(xp.all(q_ok)) and bool(xp.all(k_ok)):
        return scores
    zero = xp.zeros_like(q[..., :1, :1])
    clean_q = xp.where(xp.isfinite(q), q, zero)
    clean_k = xp.where(xp.isfinite(k), k, zero)
    clean = xp.matmul(clean_q, xp.matrix_transpose(clean_k))
    both = q_ok & xp.matrix_transpose(k_ok)  # (..., Lq, Lk)
    true = scores.detach() if hasattr(scores, "detach") else scores
    return xp.where(both, clean, true)


def quiet(xp: Any) -> Any:
    """NumPy's overflow warnings off: :func:`check_overflow` says it in one line instead."""
    if is_torch_namespace(xp):
        return contextlib.nullcontext()
    import numpy as np

    return np.errstate(over="ignore", invalid="ignore")


def check_overflow(
    xp: Any,
    scores: Array,
    allowed: Array | None,
    what: str,
    operands: tuple[tuple[str, Array], ...],
    scale: float | None = None,
) -> None:
    """ValueError when finite operands gave a score of ±inf or NaN (on an allowed pair)."""
    bad = ~xp.isfinite(scores)
    if allowed is not None:
        bad = bad & allowed
    if not bool(xp.any(bad)) or not all(bool(xp.all(xp.isfinite(x))) for _, x in operands):
        return
    largest = ", ".join(f"|{name}| ≤ {float(xp.max(xp.abs(x))):.3g}" for name, x in operands)
    scaled = "" if scale is None else f", scale = {scale:.3g}"
    raise ValueError(
        f"{what} overflowed {_dtype_word(scores)}: finite inputs ({largest}{scaled}) give "
        "±inf or NaN scores, so the weights would be NaN. Hint: "
        "rescale query and key (or the scale) so that q·k × scale stays well below the "
        "dtype's maximum; qkv refuses rather than return NaN."
    )


def _dtype_word(x: Array) -> str:
    return str(x.dtype).removeprefix("torch.")


def weighted_sum(xp: Any, weights: Array, value: Array) -> Array:
    """C = A·V, where a value row with weight 0 contributes nothing, even if it is NaN or ±inf.

    Plain matrix multiplication would turn 0 · NaN into NaN: a NaN in a padded or masked-out
    value would reach every output. When ``value`` holds non-finite entries, they are added
    back only for the queries that give them a positive weight.
    """
    finite = xp.isfinite(value)
    if bool(xp.all(finite)):
        return xp.matmul(weights, value)
    zero = xp.zeros_like(value)
    context = xp.matmul(weights, xp.where(finite, value, zero))
    attended = xp.astype(weights > 0, value.dtype)  # (..., Lq, Lk): 1 where the weight is > 0

    def reaches(hit: Array) -> Array:  # does some attended key have this kind of value?
        return xp.matmul(attended, xp.astype(hit, value.dtype)) > 0

    pos = reaches(xp.isinf(value) & (value > 0))
    neg = reaches(xp.isinf(value) & (value < 0))
    nan = reaches(xp.isnan(value)) | (pos & neg)
    inf = xp.asarray(xp.inf, dtype=value.dtype, device=device(value))
    context = xp.where(pos, inf, xp.where(neg, -inf, context))
    return xp.where(nan, xp.asarray(xp.nan, dtype=value.dtype, device=device(value)), context)
