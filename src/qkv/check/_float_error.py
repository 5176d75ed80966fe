"""How far a computation in float32 (or float16, bfloat16) can be from the exact numbers.

Courses and framework tutorials compute in float32 and print 7–9 significant digits, or the
17-digit repr of a float32. Those digits hold the float32 computation's own rounding: a few
units in the last place of a float32, carried through the steps. :func:`float_error` bounds
that rounding for every number of every step, by propagating it step by step (a running
error estimate, first order):

- an input is rounded to the format: u·|x|, u the unit roundoff (2⁻²⁴ for float32);
- a dot product of n terms adds ``ULPS·√n·u·Σ|a_i·b_i|`` and carries its inputs' errors:
  ``E(a·b) = ULPS·√n·u·|a|·|b| + E(a)·|b| + |a|·E(b)``;
- the scaled scores, ``f·E(s) + u·|f·s|``;
- a softmax weight moves by its own score's error and the row's largest one (through the
  max-subtraction and the sum): ``E(w_j) = w_j·(E(z_j) + 2·max_k E(z_k) + ULPS·(√Lk + 2)·u)``;
- the exponentials, their sum, the products w_j·v_j, the context and the output likewise.

√n rather than n: rounding errors of a sum of n terms grow like √n in practice (the
worst case n is rarely approached), and ``ULPS`` covers the difference in the order of
operations between libraries. For a softmax weight the bound is some ten units in the
last place of a float32 (its inputs' rounding included), far below half a unit of any number
printed with 6 decimals or fewer.
"""

from __future__ import annotations

import math

import numpy as np

from qkv.check._pipeline import Setup, Values, forward, merge_heads, split_heads

__all__ = ["ULPS", "UNIT_ROUNDOFF", "float_error"]

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
"""Half the distance from 1 to the next number of each floating-point format (``dtype:`` of
a format-2 example may also say ``float64``: every printed digit held)."""
ULPS = 2.0
"""Units of roundoff per operation (different libraries add and multiply in other orders)."""


def _product(
    a: np.ndarray, b: np.ndarray, error_a: np.ndarray, error_b: np.ndarray, u: float
) -> np.ndarray:
    """The error of a @ b (last axis of a with the one before the last of b)."""
    n = a.shape[-1]
    own: np.ndarray = ULPS * math.sqrt(max(n, 1)) * u * (np.abs(a) @ np.abs(b))
    total: np.ndarray = own + error_a @ np.abs(b) + np.abs(a) @ error_b
    return total


def float_error(setup: Setup, dtype: str) -> Values:
    """The bound of the rounding of a computation in ``dtype``, for every number of every
    step (absolute; shaped like :func:`~qkv.check._pipeline.forward`'s values; the
    exponentials are e^s, not e^(s − max s)).

    Example:
        >>> from qkv.examples import loads
        >>> ex = loads("format: 2\\ninputs: {scores: [[1, 2, 3]]}\\noptions: {scale: false}")
        >>> bound = float_error(Setup.of(ex), "float32")["weights"][0, 0]
        >>> bool(np.all(bound < 2e-6)), bool(np.all(bound > 1e-8))
        (True, True)
    """
    u = UNIT_ROUNDOFF[dtype]
    exact = forward(setup)
    heads = setup.heads
    given = setup.given
    allowed = setup.allowed() if setup.masked else np.ones((setup.lq, setup.lk), dtype=bool)

    def projected(name: str, w: np.ndarray) -> np.ndarray:
        if name in given:
            own: np.ndarray = u * np.abs(given[name])
            return own
        x = setup.X
        if x.shape[1] == 0:
            return np.zeros_like(exact[name])
        return _product(x, w, u * np.abs(x), u * np.abs(w), u)

    error: Values = {
        "Q": projected("Q", setup.W_q),
        "K": projected("K", setup.W_k),
        "V": projected("V", setup.W_v),
    }
    if "scores" in given:
        scores = np.where(np.isfinite(exact["scores"]), u * np.abs(exact["scores"]), 0.0)
    else:
        qh, kh = split_heads(exact["Q"], heads), split_heads(exact["K"], heads)
        eq, ek = split_heads(error["Q"], heads), split_heads(error["K"], heads)
        scores = _product(qh, kh.transpose(0, 2, 1), eq, ek.transpose(0, 2, 1), u)
    error["scores"] = scores
    factor = abs(setup.factor)
    with np.errstate(invalid="ignore"):
        scaled = factor * scores + u * np.nan_to_num(np.abs(exact["scaled"]), posinf=0.0)
    scaled = np.where(allowed, scaled, 0.0)
    error["scaled"] = scaled
    largest = scaled.max(axis=-1, keepdims=True)
    keys = allowed.sum(axis=-1, keepdims=True)
    weights = exact["weights"]
    error["weights"] = weights * (scaled + 2.0 * largest + ULPS * (np.sqrt(keys) + 2) * u)
    exp = exact["exp"]
    relative = np.where(allowed, scaled + largest + 2.0 * ULPS * u, 0.0)
    error["exp"] = exp * relative
    error["exp_sum"] = (exp * relative).sum(axis=-1, keepdims=True) + ULPS * np.sqrt(
        keys
    ) * u * exp.sum(axis=-1, keepdims=True)
    vh = split_heads(exact["V"], heads)  # (H, Lk, Dv)
    ev = split_heads(error["V"], heads)
    terms = error["weights"][..., None] * np.abs(vh)[:, None] + weights[..., None] * ev[:, None]
    terms = terms + u * np.abs(weights[..., None] * vh[:, None])  # (H, Lq, Lk, Dv)
    error["products"] = terms.reshape(*weights.shape[:2], -1)
    error["context"] = merge_heads(_product(weights, vh, error["weights"], ev, u))
    if setup.W_o is None:
        error["output"] = error["context"].copy()
    else:
        w_o = setup.W_o
        error["output"] = _product(exact["context"], w_o, error["context"], u * np.abs(w_o), u)
    return error
