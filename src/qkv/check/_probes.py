"""The probes of ``qkv check --function`` and the slips they tell apart, in NumPy float64.

A probe is a set of inputs chosen so that each common slip gives different numbers: d_k = 16,
so that dividing by √d_k, by d_k or not at all differ by factors of 4; values of width 3 ≠ d_k;
Lq ≠ Lk, so that a softmax over the wrong axis or a misaligned causal rule shows; a masked key
in every row; a probe whose scores have a known order, with V = I so that the context rows are
the weights (a normalisation that is no softmax shows); scores shifted by a large constant
(softmax does not change, a softmax without max-subtraction overflows); a fully masked row;
and, when asked, batched inputs with leading (B, H) = (2, 3) axes.

:data:`SLIPS` lists, per kind of function, each slip as a small function that computes what a
function making that slip returns on a probe: ``None`` is the correct attention. Nothing here
calls a student's code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "KINDS",
    "MASK_MEANINGS",
    "ORDER_SCORES",
    "SLIPS",
    "Probe",
    "causal_allow",
    "per_slice",
    "probes",
]

Array = NDArray[np.float64]
Kind = Literal["attention", "causal", "multi-head"]
KINDS: tuple[str, ...] = ("attention", "causal", "multi-head")
"""The kinds of function ``--kind`` accepts."""
MASK_MEANINGS: tuple[str, ...] = ("allow", "ignore", "additive")
"""What the mask given to ``NAME(Q, K, V, mask)`` means: True = may attend (``allow``),
True = must not attend (``ignore``), or a float added to the scores, 0 or −inf (``additive``)."""

_LARGE = 110.0  # Q and K share a column of this value: every score grows by 110²/4 ≈ 3000
_ORDER_Q = np.array([4.0, 8.0, -4.0, 2.0])
_ORDER_K = np.array([3.0, 2.0, 1.0, 0.0, -1.5])
ORDER_SCORES = np.outer(_ORDER_Q, _ORDER_K) / 4.0
"""The scaled scores Q·Kᵀ/√16 of the probe "known score order": rows [3, 2, 1, 0, −1.5],
twice that, its negative and half of it. With V = I, the context rows are the weights."""


@dataclass(frozen=True)
class Probe:
    """One set of inputs for the function under test.

    Attributes:
        name: a short name, shown in findings (``"Lq≠Lk, masked keys"``).
        role: ``"main"`` (tells the slips apart), ``"large"`` (large scores),
            ``"masked-row"`` (a fully masked row) or ``"batched"`` (leading (B, H) axes).
        arrays: the inputs in the function's order: Q, K, V (attention, causal) or X, W_q,
            W_k, W_v, W_o (multi-head).
        allow: for kind attention, the mask (True = may attend), or None.
        num_heads: for kind multi-head, the number of heads.
    """

    name: str
    role: str
    arrays: tuple[Array, ...]
    allow: NDArray[np.bool_] | None = None
    num_heads: int = 1


def causal_allow(lq: int, lk: int, alignment: str) -> NDArray[np.bool_]:
    """The causal rule as a boolean matrix (True = may attend): query i sees keys 0 … i
    (``"top-left"``) or 0 … i + Lk − Lq (``"bottom-right"``)."""
    shift = lk - lq if alignment == "bottom-right" else 0
    return np.arange(lk)[None, :] <= np.arange(lq)[:, None] + shift


def probes(kind: str, *, with_mask: bool, batched: bool = False) -> tuple[Probe, ...]:
    """The probes of one kind of function; ``with_mask`` when it takes a mask (kind
    attention); ``batched`` adds a probe with leading (B, H) = (2, 3) axes (kinds attention
    and causal). Always the same numbers (a fixed seed)."""
    found = _probes(kind, with_mask=with_mask)
    if not batched or kind == "multi-head":
        return found
    rng = np.random.default_rng(20261124)
    lq, lk = (5, 5) if kind == "causal" else (4, 6)
    q, k = rng.normal(size=(2, 3, lq, 16)), rng.normal(size=(2, 3, lk, 16))
    v = rng.normal(size=(2, 3, lk, 3))
    allow = None
    if with_mask:
        allow = np.ones((lq, lk), dtype=bool)
        allow[0, 1] = allow[2, [0, 5]] = False
    return (*found, Probe("batched (B, H) = (2, 3)", "batched", (q, k, v), allow))


def per_slice(slip: Callable[[Probe], tuple[Array, Array]], probe: Probe) -> tuple[Array, Array]:
    """A slip on a batched probe: computed on each (L, d) slice of the leading axes."""
    lead = probe.arrays[0].shape[:-2]
    contexts, weights = np.empty(lead, dtype=object), np.empty(lead, dtype=object)
    for idx in np.ndindex(lead):
        one = Probe(probe.name, "main", tuple(a[idx] for a in probe.arrays), probe.allow)
        contexts[idx], weights[idx] = slip(one)
    return (
        np.array(contexts.tolist(), dtype=np.float64),
        np.array(weights.tolist(), dtype=np.float64),
    )


def _probes(kind: str, *, with_mask: bool) -> tuple[Probe, ...]:
    rng = np.random.default_rng(20261123)
    if kind == "multi-head":
        w = [rng.normal(0.0, 0.25, (16, 16)) for _ in range(4)]
        x5 = rng.normal(size=(5, 16))
        x4 = rng.normal(size=(4, 16))
        return (
            Probe("5 tokens, 4 heads", "main", (x5, *w), num_heads=4),
            Probe("4 tokens, 2 heads", "main", (x4, *w), num_heads=2),
            Probe("large scores", "large", (8.0 * x5, *w), num_heads=4),
        )
    q5, k5, v5 = rng.normal(size=(5, 16)), rng.normal(size=(5, 16)), rng.normal(size=(5, 3))
    q3, k6, v6 = rng.normal(size=(3, 16)), rng.normal(size=(6, 16)), rng.normal(size=(6, 3))
    big_q, big_k = q3.copy(), k6.copy()
    big_q[:, 0] = _LARGE
    big_k[:, 0] = _LARGE
    order_q, order_k = np.zeros((4, 16)), np.zeros((5, 16))
    order_q[:, 0], order_k[:, 0] = _ORDER_Q, _ORDER_K
    order = (order_q, order_k, np.eye(5))
    if kind == "causal":
        big5q, big5k = q5.copy(), k5.copy()
        big5q[:, 0] = _LARGE
        big5k[:, 0] = _LARGE
        return (
            Probe("5 tokens", "main", (q5, k5, v5)),
            Probe("Lq=3, Lk=6", "main", (q3, k6, v6)),
            Probe("known score order", "main", order),
            Probe("large scores", "large", (big5q, big5k, v5)),
        )
    if not with_mask:
        return (
            Probe("Lq=Lk=5", "main", (q5, k5, v5)),
            Probe("Lq=3, Lk=6", "main", (q3, k6, v6)),
            Probe("known score order", "main", order),
            Probe("large scores", "large", (big_q, big_k, v6)),
        )
    allow = np.ones((3, 6), dtype=bool)
    allow[0, [1, 4]] = False
    allow[1, 0] = False
    allow[2, [2, 3, 5]] = False
    empty_row = allow.copy()
    empty_row[1, :] = False
    return (
        Probe("Lq=Lk=5, nothing masked", "main", (q5, k5, v5), np.ones((5, 5), dtype=bool)),
        Probe("Lq=3, Lk=6, masked keys", "main", (q3, k6, v6), allow),
        Probe("known score order", "main", order, np.ones((4, 5), dtype=bool)),
        Probe("large scores", "large", (big_q, big_k, v6), allow),
        Probe("a fully masked row", "masked-row", (q3, k6, v6), empty_row),
    )


MaskRule = NDArray[np.bool_] | Callable[[int, int], NDArray[np.bool_]] | None


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
) -> tuple[Array, Array]:
    """Attention with one slip: the scale, the normalisation (``softmax``, ``columns``,
    ``sum``), K·Qᵀ for Q·Kᵀ, the mask rule. Raises ValueError where the slip cannot run."""
    s = (k @ q.T if swap else q @ k.T) * scale
    if rule is not None:
        allow = rule(*s.shape) if callable(rule) else rule
        if allow.shape != s.shape:
            raise ValueError(f"mask {allow.shape} vs scores {s.shape}")
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


Slip = Callable[[Probe], tuple[Array, Array]]


def _single(
    *, rule: str = "mask", scale: str = "sqrt", normalise: str = "softmax", swap: bool = False
) -> Callable[[str], Slip]:
    """A slip of single-head attention; called with the causal alignment meant."""

    def with_alignment(alignment: str) -> Slip:
        def slip(p: Probe) -> tuple[Array, Array]:
            q, k, v = p.arrays
            d = q.shape[-1]
            factor = {"sqrt": d**-0.5, "none": 1.0, "dk": 1.0 / d}[scale]
            mask: MaskRule
            if rule == "mask":
                mask = p.allow
            elif rule == "inverted":
                mask = None if p.allow is None else ~p.allow
            elif rule == "causal":
                mask = lambda lq, lk: causal_allow(lq, lk, alignment)  # noqa: E731
            elif rule == "causal-inverted":
                mask = lambda lq, lk: ~causal_allow(lq, lk, alignment)  # noqa: E731
            elif rule == "causal-other":
                other = "top-left" if alignment == "bottom-right" else "bottom-right"
                mask = lambda lq, lk: causal_allow(lq, lk, other)  # noqa: E731
            else:
                mask = None
            return _attend(q, k, v, mask, scale=factor, normalise=normalise, swap=swap)

        return slip

    return with_alignment


def _multi_head(
    *,
    scale: str = "head",
    transposed: bool = False,
    normalise: str = "softmax",
    swap: bool = False,
    averaged: bool = False,
) -> Callable[[str], Slip]:
    """A slip of multi-head attention (row-vector convention: Q = X·W_q, output = concat·W_o)."""

    def with_alignment(alignment: str) -> Slip:
        def slip(p: Probe) -> tuple[Array, Array]:
            x, wq, wk, wv, wo = p.arrays
            h = p.num_heads

            def t(w: Array) -> Array:
                return w.T if transposed else w

            q, k, v = x @ t(wq), x @ t(wk), x @ t(wv)
            d_model = q.shape[1]
            d_head = d_model // h
            factor = {
                "head": d_head**-0.5,
                "none": 1.0,
                "dk": 1.0 / d_head,
                "dmodel": d_model**-0.5,
            }[scale]
            contexts, weights = [], []
            for i in range(h):
                cols = slice(i * d_head, (i + 1) * d_head)
                c, w = _attend(
                    q[:, cols], k[:, cols], v[:, cols], None,
                    scale=factor, normalise=normalise, swap=swap,
                )  # fmt: skip
                contexts.append(c)
                weights.append(w)
            all_weights = np.stack(weights)
            # averaged: one weighting (the heads' mean) for all of V, nothing concatenated
            concat = all_weights.mean(axis=0) @ v if averaged else np.concatenate(contexts, -1)
            return concat @ t(wo), all_weights

        return slip

    return with_alignment


SLIPS: dict[str, tuple[tuple[str | None, Callable[[str], Slip]], ...]] = {
    "attention": (
        (None, _single()),
        ("unscaled", _single(scale="none")),
        ("scaled-by-dk", _single(scale="dk")),
        ("softmax-wrong-axis", _single(normalise="columns")),
        ("query-key-swapped", _single(swap=True)),
        ("sum-normalised", _single(normalise="sum")),
        ("mask-ignored", _single(rule="none")),
        ("mask-inverted", _single(rule="inverted")),
    ),
    "causal": (
        (None, _single(rule="causal")),
        ("unscaled", _single(rule="causal", scale="none")),
        ("scaled-by-dk", _single(rule="causal", scale="dk")),
        ("softmax-wrong-axis", _single(rule="causal", normalise="columns")),
        ("query-key-swapped", _single(rule="causal", swap=True)),
        ("sum-normalised", _single(rule="causal", normalise="sum")),
        ("mask-ignored", _single(rule="none")),
        ("mask-inverted", _single(rule="causal-inverted")),
        ("causal-misaligned", _single(rule="causal-other")),
    ),
    "multi-head": (
        (None, _multi_head()),
        ("unscaled", _multi_head(scale="none")),
        ("scaled-by-dk", _multi_head(scale="dk")),
        ("scaled-by-dmodel", _multi_head(scale="dmodel")),
        ("transposed-weights", _multi_head(transposed=True)),
        ("softmax-wrong-axis", _multi_head(normalise="columns")),
        ("query-key-swapped", _multi_head(swap=True)),
        ("sum-normalised", _multi_head(normalise="sum")),
        ("heads-averaged", _multi_head(averaged=True)),
    ),
}
"""Per kind, each slip (``None``: the correct function) in the order they are tried, as a
function of the causal alignment meant that computes the slipped (context, weights)."""
