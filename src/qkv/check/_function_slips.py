"""The slips of attention code, computed on a probe in NumPy float64.

A slip is a small function of a :class:`~qkv.check._probes.Probe` that returns what a
function making that mistake returns on it, (context, weights); it raises ValueError where
such a function would fail (a shape that does not fit). :func:`single` and :func:`multi`
make them, for single-head functions (kinds attention and causal) and for functions that
split heads themselves (kinds multi-head and gqa), from a few options: the scale, the mask
rule, the normalisation, how heads are split, merged and grouped. Each returns a maker: a
function of the :class:`~qkv.check._probes.Spec` that gives the slip, or None where it
does not apply. Which slip is which code is :mod:`~qkv.check._function_codes`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from qkv.check._probes import Probe, Spec, causal_allow

__all__ = [
    "DIAGONAL_HIDDEN",
    "IGNORED",
    "INVERTED",
    "INVERTED_DIAGONAL",
    "ONE_AHEAD",
    "OTHER_CORNER",
    "RIGHT",
    "Slip",
    "SlipMaker",
    "multi",
    "single",
]

Array = NDArray[np.float64]
Slip = Callable[[Probe], tuple[Array, Array]]
MaskRule = NDArray[np.bool_] | Callable[[int, int], NDArray[np.bool_]] | None

# How a slip applies the mask: as meant, not at all, the wrong way round, ...
RIGHT = "right"
IGNORED = "ignored"
INVERTED = "inverted"
INVERTED_DIAGONAL = "inverted-diagonal"  # causal: j ≥ i (triu with the diagonal) kept
OTHER_CORNER = "other-corner"  # causal: aligned at the other corner
DIAGONAL_HIDDEN = "diagonal-hidden"  # causal: j < i
ONE_AHEAD = "one-ahead"  # causal: j ≤ i + 1
_CAUSAL_ONLY = (INVERTED_DIAGONAL, OTHER_CORNER, DIAGONAL_HIDDEN, ONE_AHEAD)
# What a masked score is set to: −inf (right), 0 or a tiny number, or +inf (NaN rows)
FILLS = ("-inf", "zero", "+inf")


def _softmax(s: Array, axis: int) -> Array:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        e = np.exp(s - s.max(axis=axis, keepdims=True))
        out: Array = e / e.sum(axis=axis, keepdims=True)
    return out


def _attend(
    q: Array,
    k: Array,
    v: Array,
    rule: MaskRule,
    *,
    scale: float,
    normalise: str = "softmax",
    swap: bool = False,
    after_softmax: bool = False,
    fill: str = "-inf",
    transpose: bool = True,
    seen_ndim: int = 2,
) -> tuple[Array, Array]:
    """Single-head attention with one slip: the scale, the normalisation (``softmax``,
    ``columns``, ``sum``, or ``batch``: over axis 0 of the scores as the function saw them,
    ``seen_ndim`` axes), K·Qᵀ for Q·Kᵀ, Q·K without the transpose, the mask rule, what a
    masked score is set to (``fill``), the mask applied after the softmax. Raises
    ValueError where the slip cannot run.

    A row made NaN by a +inf fill is returned as +inf: there the function's numbers must
    not be numbers either (:func:`~qkv.check._function_diagnose.diagnose` reads it so)."""
    if not transpose:  # Q·K: runs only where Lk = d_k
        if k.shape[0] != q.shape[1]:
            raise ValueError(f"Q {q.shape} · K {k.shape}")
        s = (q @ k) * scale
    else:
        s = (k @ q.T if swap else q @ k.T) * scale  # (Lq, Lk)
    allow = None
    if rule is not None:
        allow = rule(*s.shape) if callable(rule) else rule
        if allow.shape != s.shape:
            raise ValueError(f"mask {allow.shape} vs scores {s.shape}")
    if after_softmax:  # every key weighted, then the masked weights zeroed: no renormalising
        w = _softmax(s, -1)
        if allow is not None:
            w = np.where(allow, w, 0.0)
    else:
        if allow is not None:
            s = np.where(allow, s, {"-inf": -np.inf, "zero": 0.0, "+inf": np.inf}[fill])
        if normalise == "columns":
            w = _softmax(s, -2)
        elif normalise == "batch":  # (1, 1, Lq, Lk) when lifted: exp(s − s) = 1, NaN if −inf
            w = _softmax(s.reshape((1,) * (seen_ndim - 2) + s.shape), 0).reshape(s.shape)
        elif normalise == "sum":
            s0 = np.where(np.isinf(s), 0.0, s)
            with np.errstate(invalid="ignore", divide="ignore"):
                w = s0 / s0.sum(axis=-1, keepdims=True)
        else:
            w = _softmax(s, -1)
    if w.shape[-1] != v.shape[0]:
        raise ValueError(f"weights {w.shape} vs values {v.shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        context = w @ v
    if fill == "+inf" and allow is not None:
        spoilt = ~allow.all(axis=-1)  # inf − inf in each row with a masked key
        w, context = w.copy(), context.copy()
        w[spoilt], context[spoilt] = np.inf, np.inf
    return context, w


def _rule(spec: Spec, probe: Probe, how: str) -> MaskRule:
    """The keys a slip lets each query attend (True = may attend), or None for all."""
    if spec.causal:
        meant = spec.alignment
        if how == RIGHT:
            return lambda lq, lk: causal_allow(lq, lk, meant)
        if how == INVERTED:
            return lambda lq, lk: ~causal_allow(lq, lk, meant)
        if how == INVERTED_DIAGONAL:
            return lambda lq, lk: ~causal_allow(lq, lk, meant, -1)
        if how == OTHER_CORNER:
            other = "top-left" if meant == "bottom-right" else "bottom-right"
            return lambda lq, lk: causal_allow(lq, lk, other)
        if how == DIAGONAL_HIDDEN:
            return lambda lq, lk: causal_allow(lq, lk, meant, -1)
        if how == ONE_AHEAD:
            return lambda lq, lk: causal_allow(lq, lk, meant, 1)
        return None
    if probe.allow is None or how == IGNORED:
        return None
    return ~probe.allow if how == INVERTED else probe.allow


def _applies(spec: Spec, rule: str, after_softmax: bool, fill: str = "-inf") -> bool:
    """Whether a mask slip means anything for this kind of function."""
    if rule == RIGHT and not after_softmax and fill == "-inf":
        return True
    if not spec.masked:
        return False
    return spec.causal or rule not in _CAUSAL_ONLY


SlipMaker = Callable[[Spec], Slip | None]


def single(
    *,
    rule: str = RIGHT,
    scale: str = "sqrt",
    normalise: str = "softmax",
    swap: bool = False,
    after_softmax: bool = False,
    fill: str = "-inf",
    transpose: bool = True,
) -> SlipMaker:
    """A slip of single-head attention (kinds attention and causal)."""

    def make(spec: Spec) -> Slip | None:
        if spec.multi or not _applies(spec, rule, after_softmax, fill):
            return None

        def slip(p: Probe) -> tuple[Array, Array]:
            q, k, v = p.arrays
            d = q.shape[-1]
            factor = {"sqrt": d**-0.5, "none": 1.0, "dk": 1.0 / d, "ndim": p.seen_ndim**-0.5}
            return _attend(
                q, k, v, _rule(spec, p, rule), scale=factor[scale], normalise=normalise,
                swap=swap, after_softmax=after_softmax, fill=fill, transpose=transpose,
                seen_ndim=p.seen_ndim,
            )  # fmt: skip

        return slip

    return make


def _split(x: Array, heads: int, how: str) -> Array:
    """(L, heads·d) → (heads, L, d): right, or a reshape that mixes the tokens' rows."""
    length, width = x.shape
    if how == RIGHT:
        return x.reshape(length, heads, width // heads).transpose(1, 0, 2)
    return x.reshape(heads, length, width // heads)


def _merge(x: Array, how: str) -> Array:
    """(heads, L, d) → (L, heads·d): right, or a reshape that scrambles the tokens' rows."""
    heads, length, dim = x.shape
    if how == RIGHT:
        return x.transpose(1, 0, 2).reshape(length, heads * dim)
    return x.reshape(length, heads * dim)


def _kv_head(i: int, heads: int, kv_heads: int, how: str) -> int:
    """The key/value head query head ``i`` uses (raises ValueError where the slip fails)."""
    if how == "interleave":  # right: consecutive query heads share one key/value head
        return i // (heads // kv_heads)
    if how == "tile":
        return i % kv_heads
    if how == "broadcast":  # not repeated: works only when Hkv is 1 (broadcast) or H
        if kv_heads not in (1, heads):
            raise ValueError(f"{heads} query heads vs {kv_heads} key/value heads")
        return 0 if kv_heads == 1 else i
    if kv_heads != heads:  # "loop": head i's columns of K, which has only Hkv heads
        raise ValueError(f"{heads} query heads vs {kv_heads} key/value heads")
    return i


def multi(
    *,
    scale: str = "head",
    ndim: int = 2,
    transposed: tuple[str, ...] = (),
    normalise: str = "softmax",
    swap: bool = False,
    averaged: str = "",
    split: str = RIGHT,
    merge: str = RIGHT,
    kv: str = "interleave",
    rule: str = RIGHT,
    after_softmax: bool = False,
    fill: str = "-inf",
    transpose: bool = True,
    heads: str = "any",
) -> SlipMaker:
    """A slip of multi-head (or grouped-query) attention, row vectors: Q = X·W_q, the heads
    split from the columns, output = concat(heads)·W_o; kind head is one head with W_o = I.
    A cross-attention probe projects its ``memory`` for K and V. ``heads``: ``any``,
    ``several`` (not kind head) or ``one`` (kind head only). ``scale="width"``: by √(the
    input's width), the model's width of a single head."""

    def make(spec: Spec) -> Slip | None:
        if not spec.multi or not _applies(spec, rule, after_softmax, fill):
            return None
        if kv != "interleave" and not spec.grouped:
            return None
        if (heads == "one") != (spec.kind == "head") and heads != "any":
            return None

        def slip(p: Probe) -> tuple[Array, Array]:
            x, wq, wk, wv, wo = p.arrays
            x_kv = x if p.memory is None else p.memory
            h, hkv = p.num_heads, p.kv_heads
            used = {
                name: w.T if name in transposed else w
                for name, w in zip(("W_q", "W_k", "W_v", "W_o"), (wq, wk, wv, wo), strict=True)
            }
            q, k, v = (
                x @ used["W_q"],
                x_kv @ used["W_k"],
                x_kv @ used["W_v"],
            )  # (L, H·D), (L, Hkv·D)
            d_model = q.shape[1]
            d_head = d_model // h
            if k.shape[1] != hkv * d_head or v.shape[1] != hkv * d_head:
                raise ValueError(f"K {k.shape} for {hkv} heads of {d_head}")
            factor = {
                "head": d_head**-0.5,
                "none": 1.0,
                "dk": 1.0 / d_head,
                "dmodel": d_model**-0.5,
                "ndim": ndim**-0.5,
                "heads": h**-0.5,
                "width": x.shape[1] ** -0.5,
            }[scale]
            qh, kh, vh = _split(q, h, split), _split(k, hkv, split), _split(v, hkv, split)
            contexts, weights = [], []
            for i in range(h):
                j = _kv_head(i, h, hkv, kv)
                c, w = _attend(
                    qh[i], kh[j], vh[j], _rule(spec, p, rule), scale=factor,
                    normalise=normalise, swap=swap, after_softmax=after_softmax, fill=fill,
                    transpose=transpose,
                )  # fmt: skip
                contexts.append(c)
                weights.append(w)
            all_weights = np.stack(weights)  # (H, L, L)
            if averaged == "weights":  # one weighting (the heads' mean) for all of V
                return all_weights.mean(axis=0) @ v @ used["W_o"], all_weights
            concat = _merge(np.stack(contexts), merge)  # (L, H·D)
            with np.errstate(invalid="ignore", over="ignore"):
                output = concat @ used["W_o"]
            if fill == "+inf":  # a row with a NaN head is NaN after W_o: the sentinel +inf
                output[~np.isfinite(concat).all(axis=-1)] = np.inf
            if averaged == "outputs":  # each head's share of the output, averaged: not summed
                output = output / h
            return output, all_weights

        return slip

    return make
