"""Softmax with qkv's numerics policy."""

from __future__ import annotations

from typing import Any

from qkv._array import Array, as_array, compute_dtype, is_floating, namespace


def softmax(x: Array, axis: int = -1) -> Array:
    """softmax(x)_j = exp(x_j − max x) / Σ_k exp(x_k − max x), along ``axis``.

    The numerics policy:

    - the row maximum is subtracted first, so large scores never overflow;
    - a row whose entries are all −inf (every key masked) gives zeros, not NaN;
    - float16 and bfloat16 are computed in float32 and cast back.

    Args:
        x: scores of any shape, e.g. (..., Lq, Lk); NumPy array or PyTorch tensor.
        axis: the axis to normalise over (the keys, by default).

    Returns:
        Weights of the same shape, dtype and library as ``x``: non-negative, each row summing
        to 1 (or to 0 for a row that was entirely −inf).

    Example:
        >>> import numpy as np
        >>> softmax(np.array([0.0, np.log(3.0)]))
        array([0.25, 0.75])
        >>> softmax(np.array([-np.inf, -np.inf]))
        array([0., 0.])
    """
    x = as_array(x, "x")
    xp = namespace([("x", x)])
    if not is_floating(x):
        raise TypeError(f"softmax needs floating-point scores, got {x.dtype}")
    return xp.astype(_softmax(xp, xp.astype(x, compute_dtype(xp, x)), axis), x.dtype)


def _softmax(xp: Any, x: Array, axis: int = -1) -> Array:
    """softmax without checks or casts (the inner loop of the reference)."""
    row_max = xp.max(x, axis=axis, keepdims=True)
    # A row of only −inf has max −inf; shifting by 0 instead keeps exp(−inf − 0) = 0, not NaN.
    row_max = xp.where(xp.isinf(row_max) & (row_max < 0), xp.zeros_like(row_max), row_max)
    exps = xp.exp(x - row_max)
    total = xp.sum(exps, axis=axis, keepdims=True)
    return exps / xp.where(total == 0, xp.ones_like(total), total)
