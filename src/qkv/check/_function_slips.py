"""Every code ``qkv check --function`` reports, declared once: its sentence, and the slips
that give it, computed on a probe in NumPy float64.

A slip is a small function of a :class:`~qkv.check._probes.Probe` that returns what a
function making that mistake returns on it, (context, weights); it raises ValueError where
such a function would fail (a shape that does not fit). Several variants may share a code
(a causal mask off by one hides the diagonal, or shows one future key); each says which in
its ``detail``. Codes found otherwise than by making the slip (``not-softmax``,
``no-max-subtraction``, ``dropout-at-inference``, ``masked-row-nan``, ``unbatched``,
``unrecognised``) have no variant: :mod:`~qkv.check._function_diagnose` finds them.

To add a code: one :class:`FunctionCode` in :data:`CODES` (the order there is the order the
slips are tried), a buggy function in the tests that makes it, and its line in
``docs/check-function.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from qkv.check._findings import DIAGNOSES
from qkv.check._probes import Probe, Spec, causal_allow

__all__ = ["CODES", "FUNCTION_DIAGNOSES", "FunctionCode", "Slip", "SlipVariant", "slips_of"]

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
) -> tuple[Array, Array]:
    """Single-head attention with one slip: the scale, the normalisation (``softmax``,
    ``columns``, ``sum``), K·Qᵀ for Q·Kᵀ, the mask rule, the mask applied after the softmax.
    Raises ValueError where the slip cannot run."""
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
            s = np.where(allow, s, -np.inf)
        if normalise == "columns":
            w = _softmax(s, -2)
        elif normalise == "sum":
            s0 = np.where(np.isinf(s), 0.0, s)
            with np.errstate(invalid="ignore", divide="ignore"):
                w = s0 / s0.sum(axis=-1, keepdims=True)
        else:
            w = _softmax(s, -1)
    if w.shape[-1] != v.shape[0]:
        raise ValueError(f"weights {w.shape} vs values {v.shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        return w @ v, w


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


def _applies(spec: Spec, rule: str, after_softmax: bool) -> bool:
    """Whether a mask slip means anything for this kind of function."""
    if rule == RIGHT and not after_softmax:
        return True
    if not spec.masked:
        return False
    return spec.causal or rule not in _CAUSAL_ONLY


SlipMaker = Callable[[Spec], Slip | None]


def _single(
    *,
    rule: str = RIGHT,
    scale: str = "sqrt",
    normalise: str = "softmax",
    swap: bool = False,
    after_softmax: bool = False,
) -> SlipMaker:
    """A slip of single-head attention (kinds attention and causal)."""

    def make(spec: Spec) -> Slip | None:
        if spec.multi or not _applies(spec, rule, after_softmax):
            return None

        def slip(p: Probe) -> tuple[Array, Array]:
            q, k, v = p.arrays
            d = q.shape[-1]
            factor = {"sqrt": d**-0.5, "none": 1.0, "dk": 1.0 / d, "ndim": p.seen_ndim**-0.5}
            return _attend(
                q, k, v, _rule(spec, p, rule), scale=factor[scale], normalise=normalise,
                swap=swap, after_softmax=after_softmax,
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


def _multi(
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
) -> SlipMaker:
    """A slip of multi-head (or grouped-query) attention, row vectors: Q = X·W_q, the heads
    split from the columns, output = concat(heads)·W_o."""

    def make(spec: Spec) -> Slip | None:
        if not spec.multi or not _applies(spec, rule, after_softmax):
            return None
        if kv != "interleave" and not spec.grouped:
            return None

        def slip(p: Probe) -> tuple[Array, Array]:
            x, wq, wk, wv, wo = p.arrays
            h, hkv = p.num_heads, p.kv_heads
            used = {
                name: w.T if name in transposed else w
                for name, w in zip(("W_q", "W_k", "W_v", "W_o"), (wq, wk, wv, wo), strict=True)
            }
            q, k, v = x @ used["W_q"], x @ used["W_k"], x @ used["W_v"]  # (L, H·D), (L, Hkv·D)
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
            }[scale]
            qh, kh, vh = _split(q, h, split), _split(k, hkv, split), _split(v, hkv, split)
            contexts, weights = [], []
            for i in range(h):
                j = _kv_head(i, h, hkv, kv)
                c, w = _attend(
                    qh[i], kh[j], vh[j], _rule(spec, p, rule), scale=factor,
                    normalise=normalise, swap=swap, after_softmax=after_softmax,
                )  # fmt: skip
                contexts.append(c)
                weights.append(w)
            all_weights = np.stack(weights)  # (H, L, L)
            if averaged == "weights":  # one weighting (the heads' mean) for all of V
                return all_weights.mean(axis=0) @ v @ used["W_o"], all_weights
            concat = _merge(np.stack(contexts), merge)  # (L, H·D)
            output = concat @ used["W_o"]
            if averaged == "outputs":  # each head's share of the output, averaged: not summed
                output = output / h
            return output, all_weights

        return slip

    return make


@dataclass(frozen=True)
class SlipVariant:
    """One way to make a slip: a maker (None where it does not apply to a kind of function)
    and, where a code has several, a sentence saying which one it was."""

    make: SlipMaker
    detail: str = ""


@dataclass(frozen=True)
class FunctionCode:
    """A code of ``qkv check --function``: what is wrong and what it should be, and the
    slips that give it (none for a code found otherwise)."""

    code: str
    sentence: str
    variants: tuple[SlipVariant, ...] = ()


def _both(
    *,
    rule: str = RIGHT,
    scale: str = "",
    normalise: str = "softmax",
    swap: bool = False,
    after_softmax: bool = False,
) -> tuple[SlipVariant, SlipVariant]:
    """The same slip for single-head and multi-head functions (``scale``: none or dk)."""
    common = {"rule": rule, "normalise": normalise, "swap": swap, "after_softmax": after_softmax}
    return (
        SlipVariant(_single(scale=scale or "sqrt", **common)),  # type: ignore[arg-type]
        SlipVariant(_multi(scale=scale or "head", **common)),  # type: ignore[arg-type]
    )


_HIDDEN = "Here the diagonal is hidden: query i sees keys 0 … i − 1, and the first sees none."
_AHEAD = "Here one future key is shown: query i sees keys 0 … i + 1."
_TRIU = (
    "A causal mask built with triu where tril was meant keeps the diagonal: each query "
    "attends itself and the keys after it."
)

CODES: tuple[FunctionCode, ...] = (
    FunctionCode(
        "unscaled",
        "the scores are not divided by √d_k before the softmax; attention is softmax(Q·Kᵀ/√d_k)·V",
        _both(scale="none"),
    ),
    FunctionCode(
        "scaled-by-dk", "the scores are divided by d_k instead of √d_k", _both(scale="dk")
    ),
    FunctionCode(
        "scaled-by-dmodel", DIAGNOSES["scaled-by-dmodel"], (SlipVariant(_multi(scale="dmodel")),)
    ),
    FunctionCode(
        "scaled-by-ndim",
        "the scores are divided by the square root of the number of axes of the array "
        "(Q.ndim, Q.dim(), len(Q.shape)) instead of √d_k, the size of the last axis: take d_k "
        "as Q.shape[-1]",
        (
            SlipVariant(_single(scale="ndim")),
            *(SlipVariant(_multi(scale="ndim", ndim=n)) for n in (2, 3, 4)),
        ),
    ),
    FunctionCode(
        "scaled-by-num-heads",
        "each head's scores are divided by √num_heads instead of √d_head (d_head = d_model / "
        "num_heads, the size of one head's query and key vectors)",
        (SlipVariant(_multi(scale="heads")),),
    ),
    FunctionCode(
        "transposed-weights",
        "X·Wᵀ instead of X·W: with row vectors, Q = X·W_q (the same for K, V and the output W_o)",
        (
            SlipVariant(
                _multi(transposed=("W_q", "W_k", "W_v")),
                "Here W_q, W_k and W_v were used transposed and W_o as it is (the habit of "
                "nn.Linear, whose weight is stored as Wᵀ).",
            ),
            SlipVariant(
                _multi(transposed=("W_q", "W_k", "W_v", "W_o")),
                "Here all four, W_q, W_k, W_v and W_o, were used transposed.",
            ),
            SlipVariant(_multi(transposed=("W_o",)), "Here only W_o was used transposed."),
        ),
    ),
    FunctionCode(
        "softmax-wrong-axis",
        "softmax over the queries (axis -2) instead of over the keys: each row of weights, one "
        "per query, must sum to 1 (softmax over the last axis)",
        _both(normalise="columns"),
    ),
    FunctionCode(
        "query-key-swapped",
        "K·Qᵀ instead of Q·Kᵀ: row i of the scores must hold query i's scores against every key",
        _both(swap=True),
    ),
    FunctionCode("sum-normalised", DIAGNOSES["sum-normalised"], _both(normalise="sum")),
    FunctionCode("mask-ignored", DIAGNOSES["mask-ignored"], _both(rule=IGNORED)),
    FunctionCode(
        "mask-inverted",
        DIAGNOSES["mask-inverted"],
        (
            *_both(rule=INVERTED),
            SlipVariant(_single(rule=INVERTED_DIAGONAL), _TRIU),
            SlipVariant(_multi(rule=INVERTED_DIAGONAL), _TRIU),
        ),
    ),
    FunctionCode(
        "causal-misaligned",
        DIAGNOSES["causal-misaligned"],
        (SlipVariant(_single(rule=OTHER_CORNER)),),
    ),
    FunctionCode(
        "causal-off-by-one",
        "the causal mask is off by one: query i must see the keys 0 … i, itself included "
        "(np.tril(ones) keeps the diagonal; torch.triu(ones, diagonal=1) marks the masked "
        "keys)",
        (
            SlipVariant(_single(rule=DIAGONAL_HIDDEN), _HIDDEN),
            SlipVariant(_multi(rule=DIAGONAL_HIDDEN), _HIDDEN),
            SlipVariant(_single(rule=ONE_AHEAD), _AHEAD),
            SlipVariant(_multi(rule=ONE_AHEAD), _AHEAD),
        ),
    ),
    FunctionCode(
        "mask-after-softmax",
        "the mask is applied after the softmax and the weights are not renormalised, so a row "
        "no longer sums to 1: set the masked scores to −inf before the softmax",
        _both(after_softmax=True),
    ),
    FunctionCode(
        "heads-averaged",
        DIAGNOSES["heads-averaged"],
        (
            SlipVariant(_multi(averaged="weights")),
            SlipVariant(
                _multi(averaged="outputs"),
                "Here each head's context went through its rows of W_o and the heads' outputs "
                "were averaged, not added: the output is 1/num_heads of attention's.",
            ),
        ),
    ),
    FunctionCode(
        "heads-split-without-transpose",
        "the heads are split with a reshape (or view) to (heads, L, d_head) without a "
        "transpose, so each head mixes the rows of several tokens: reshape to (L, heads, "
        "d_head), then transpose to (heads, L, d_head)",
        (
            SlipVariant(
                _multi(split="reshape", merge="reshape"),
                "The heads were put back together with the same reshape.",
            ),
            SlipVariant(_multi(split="reshape"), "The heads were put back together right."),
        ),
    ),
    FunctionCode(
        "heads-merged-without-transpose",
        "the heads' context vectors, (heads, L, d_head), are merged with a reshape to (L, "
        "d_model) without transposing (permuting) them back first, so the tokens' rows are "
        "scrambled: transpose to (L, heads, d_head), then reshape",
        (SlipVariant(_multi(merge="reshape")),),
    ),
    FunctionCode(
        "kv-heads-wrong-order",
        "query head h must use key/value head h // (H/Hkv): consecutive query heads share one "
        "(torch.repeat_interleave, np.repeat). This used key/value head h % Hkv (torch.repeat "
        "or np.tile puts the copies in the wrong order)",
        (SlipVariant(_multi(kv="tile")),),
    ),
    FunctionCode(
        "kv-heads-not-repeated",
        "the key/value heads are not repeated for the query heads of their group: with Hkv < H, "
        "repeat each key/value head H/Hkv times (repeat_interleave) before Q·Kᵀ",
        (SlipVariant(_multi(kv="broadcast")), SlipVariant(_multi(kv="loop"))),
    ),
    FunctionCode(
        "not-softmax",
        "the weights are not a softmax of the scores: each row must be exp(s_j) / Σ exp(s), so "
        "a larger score always gets a larger weight, in a fixed ratio e^(s_j − s_k)",
    ),
    FunctionCode(
        "no-max-subtraction",
        "softmax overflows to inf or NaN at large scores: subtract each row's maximum score "
        "before exp (softmax does not change)",
    ),
    FunctionCode(
        "dropout-at-inference",
        "the outputs change between two calls with the same inputs: dropout is left on when "
        "the function is used, not trained. Apply dropout only while training "
        "(F.dropout(w, p, training=self.training), or model.eval() with nn.Dropout)",
    ),
    FunctionCode(
        "masked-row-nan",
        "a fully masked row gives NaN; qkv's policy gives it zero weights and a zero context "
        "(a note, not an error)",
    ),
    FunctionCode(
        "unbatched",
        "right on (L, d) inputs but not on batched (B, H, L, d) inputs: use K.swapaxes(-1, -2) "
        "(NumPy) or K.transpose(-2, -1) (torch) instead of K.T, take d_k as Q.shape[-1], and "
        "take the softmax over the last axis",
    ),
    FunctionCode(
        "unrecognised", "the outputs are not attention's and match none of the known slips"
    ),
)
"""Every code of ``--function``, in the order its slips are tried. Codes a worked example can
show too share :data:`~qkv.check.DIAGNOSES`'s sentence; the others say it in terms of code
(axes, ``K.T``)."""

FUNCTION_DIAGNOSES: dict[str, str] = {c.code: c.sentence for c in CODES}
"""Each code ``--function`` can report, with its sentence: what is wrong and what it should be."""


@dataclass(frozen=True)
class Tried:
    """A slip tried on the probes: its code (None: the correct function), the computation,
    and which variant it was."""

    code: str | None
    slip: Slip
    detail: str = ""


def slips_of(spec: Spec) -> list[Tried]:
    """The correct function, then every slip that applies to ``spec``, in the order tried.

    Example:
        >>> [t.code for t in slips_of(Spec("causal", causal=True))][:4]
        [None, 'unscaled', 'scaled-by-dk', 'scaled-by-ndim']
    """
    correct = (_multi() if spec.multi else _single())(spec)
    assert correct is not None
    found = [Tried(None, correct)]
    for entry in CODES:
        for variant in entry.variants:
            slip = variant.make(spec)
            if slip is not None:
                found.append(Tried(entry.code, slip, variant.detail))
    return found
