"""The probes of ``qkv check --function``: inputs on which each common slip gives other numbers.

A probe is a set of inputs chosen so that each common slip gives different numbers: d_k = 16,
so that dividing by √d_k, by d_k or not at all differ by factors of 4; values of width 3 ≠ d_k;
Lq ≠ Lk, so that a softmax over the wrong axis or a misaligned causal rule shows; a masked key
in every row; a probe whose scores have a known order, with V = I so that the context rows are
the weights (a normalisation that is no softmax shows); scores shifted by a large constant
(softmax does not change, a softmax without max-subtraction overflows); a fully masked row;
the first probe once more (a function whose outputs change between two calls leaves dropout
on); a "square" probe whose key count equals d_k, so that Q·K without the transpose runs and
can be named; and, when asked, batched inputs with leading (B, H) = (2, 3) axes. Multi-head
probes have d_model = 16 and 4 or 2 heads; grouped-query probes narrower W_k and W_v, for
fewer key/value heads than query heads. An attention class (``--module``) whose forward takes
a mask gets masked probes, and one whose forward takes the queries apart from the keys and
values gets cross-attention probes (Lq ≠ Lk); a single head without an output projection
(kind ``head``) gets probes of its own width.

What each slip gives on a probe is :mod:`~qkv.check._function_slips`'s. Nothing here calls a
student's code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "HEAD",
    "KINDS",
    "KV_HEADS",
    "MASK_MEANINGS",
    "ORDER_SCORES",
    "Probe",
    "Spec",
    "causal_allow",
    "per_slice",
    "probes",
    "probes_of",
]

Array = NDArray[np.float64]
KINDS: tuple[str, ...] = ("attention", "causal", "multi-head", "gqa")
"""The kinds of function ``--kind`` accepts."""
HEAD = "head"
"""The kind of a single-head attention class without an output projection (Karpathy's
``Head(head_size)``): forward(x) → softmax(x·W_q·(x·W_k)ᵀ/√head_size)·x·W_v. Its probes
are multi-head probes with one head and W_o = I."""
MASK_MEANINGS: tuple[str, ...] = ("allow", "ignore", "additive")
"""What the mask given to ``NAME(Q, K, V, mask)`` means: True = may attend (``allow``),
True = must not attend (``ignore``), or a float added to the scores, 0 or −inf (``additive``)."""
KV_HEADS: tuple[int, ...] = (1, 2, 4, 8)
"""The ``num_kv_heads`` a multi-head probe can have (d_model = 16: heads of 2 columns at least)."""

_D_MODEL = 16
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
            ``"masked-row"`` (a fully masked row), ``"repeat"`` (a main probe once more) or
            ``"batched"`` (leading (B, H) axes).
        arrays: the inputs in the function's order: Q, K, V (attention, causal) or X, W_q,
            W_k, W_v, W_o (multi-head, gqa).
        allow: for kind attention, the mask (True = may attend), or None.
        num_heads: for kinds multi-head and gqa, the number of (query) heads H.
        num_kv_heads: the number of key/value heads Hkv (0: as many as query heads).
        base: for a ``large`` or ``repeat`` probe, the index of the main probe it repeats
            or scales; −1 otherwise.
        memory: kinds multi-head and head: the keys' and values' input X_kv of a
            cross-attention probe (Lk rows), or None (self-attention: X).
        seen_ndim: how many axes the function saw Q with: 2, or 4 when the probe was lifted
            to (1, 1, L, d) or is batched (a slip like ``Q.ndim`` depends on it).
    """

    name: str
    role: str
    arrays: tuple[Array, ...]
    allow: NDArray[np.bool_] | None = None
    num_heads: int = 1
    num_kv_heads: int = 0
    base: int = -1
    seen_ndim: int = 2
    memory: Array | None = None

    @property
    def kv_heads(self) -> int:
        """Hkv: the key/value heads (the query heads when not grouped)."""
        return self.num_kv_heads or self.num_heads


@dataclass(frozen=True)
class Spec:
    """What a function is checked as: its kind and everything its slips depend on.

    Attributes:
        kind: one of :data:`KINDS`.
        with_mask: kind attention: the function takes a mask.
        causal: the attention must be causal (kind causal; a causal attention class).
        alignment: the causal rule meant when Lq ≠ Lk: ``top-left`` or ``bottom-right``.
        num_kv_heads: kind multi-head: W_k and W_v for this many key/value heads
            (grouped-query attention with the multi-head signature), or None.
        cross: an attention class whose forward takes the queries apart from the keys and
            values: cross-attention probes (Lq ≠ Lk) are added.
        width: kind head: the width of the class's input (its model width).
        head_size: kind head: the size of the head.
    """

    kind: str
    with_mask: bool = False
    causal: bool = False
    alignment: str = "top-left"
    num_kv_heads: int | None = None
    cross: bool = False
    width: int = 16
    head_size: int = 8

    @property
    def multi(self) -> bool:
        """Whether the function projects X itself (kinds multi-head, gqa and head)."""
        return self.kind in ("multi-head", "gqa", HEAD)

    @property
    def grouped(self) -> bool:
        """Whether key/value heads are fewer than query heads on some probe."""
        return self.kind == "gqa" or self.num_kv_heads is not None

    @property
    def masked(self) -> bool:
        """Whether some key is masked: a mask argument or the causal rule."""
        return self.with_mask or self.causal


def causal_allow(lq: int, lk: int, alignment: str, offset: int = 0) -> NDArray[np.bool_]:
    """The causal rule as a boolean matrix (True = may attend): query i sees keys 0 … i
    (``"top-left"``) or 0 … i + Lk − Lq (``"bottom-right"``); ``offset`` moves the last key
    seen (−1: the diagonal hidden, +1: one future key shown)."""
    shift = lk - lq if alignment == "bottom-right" else 0
    return np.arange(lk)[None, :] <= np.arange(lq)[:, None] + shift + offset


def probes_of(spec: Spec, *, batched: bool = False) -> tuple[Probe, ...]:
    """The probes of ``spec`` (:func:`probes` with everything the spec says)."""
    own_mask = spec.with_mask and not (spec.multi and spec.causal)  # a class: the causal rule
    return probes(
        spec.kind,
        with_mask=own_mask,
        batched=batched,
        num_kv_heads=spec.num_kv_heads,
        cross=spec.cross,
        width=spec.width,
        head_size=spec.head_size,
    )


def probes(
    kind: str,
    *,
    with_mask: bool,
    batched: bool = False,
    num_kv_heads: int | None = None,
    cross: bool = False,
    width: int = 16,
    head_size: int = 8,
) -> tuple[Probe, ...]:
    """The probes of one kind of function; ``with_mask`` when it takes a mask (kind
    attention, or an attention class whose forward takes one); ``batched`` adds a probe
    with leading (B, H) = (2, 3) axes (kinds attention and causal); ``num_kv_heads`` (kind
    multi-head, one of :data:`KV_HEADS`) gives W_k and W_v for that many key/value heads;
    ``cross`` adds cross-attention probes (kinds multi-head and head); ``width`` and
    ``head_size`` are the sizes of kind head. Always the same numbers (fixed seeds).

    Example:
        >>> [p.name for p in probes("gqa", with_mask=False)][:3]
        ['5 tokens, 4 heads, 4 key/value heads', '5 tokens, 4 heads, 2 key/value heads',
         '4 tokens, 2 heads, 1 key/value head']
    """
    if kind == HEAD:
        return _head_probes(width, head_size, with_mask=with_mask, cross=cross)
    found = _probes(kind, with_mask=with_mask, num_kv_heads=num_kv_heads, cross=cross)
    if not batched or kind in ("multi-head", "gqa"):
        return found
    rng = np.random.default_rng(20261124)
    lq, lk = (5, 5) if kind == "causal" else (4, 6)
    q, k = rng.normal(size=(2, 3, lq, 16)), rng.normal(size=(2, 3, lk, 16))
    v = rng.normal(size=(2, 3, lk, 3))
    allow = None
    if with_mask:
        allow = np.ones((lq, lk), dtype=bool)
        allow[0, 1] = allow[2, [0, 5]] = False
    return (*found, Probe("batched (B, H) = (2, 3)", "batched", (q, k, v), allow, seen_ndim=4))


def per_slice(slip: Callable[[Probe], tuple[Array, Array]], probe: Probe) -> tuple[Array, Array]:
    """A slip on a batched probe: computed on each (L, d) slice of the leading axes."""
    lead = probe.arrays[0].shape[:-2]
    contexts, weights = np.empty(lead, dtype=object), np.empty(lead, dtype=object)
    for idx in np.ndindex(lead):
        one = dataclasses.replace(
            probe, role="main", arrays=tuple(a[idx] for a in probe.arrays), seen_ndim=4
        )
        contexts[idx], weights[idx] = slip(one)
    return (
        np.array(contexts.tolist(), dtype=np.float64),
        np.array(weights.tolist(), dtype=np.float64),
    )


def _again(found: tuple[Probe, ...]) -> Probe:
    """The first probe once more: a function must give the same numbers twice."""
    first = found[0]
    return dataclasses.replace(first, name=f"{first.name} (a second call)", role="repeat", base=0)


def _grouped(x5: Array, x4: Array, w: list[Array], kind: str, n: int | None) -> list[Probe]:
    """Probes with fewer key/value heads than query heads: W_k and W_v keep the columns of
    Hkv heads. The first has Hkv = H, so that a function that forgets to repeat the
    key/value heads still runs on it."""
    if kind == "gqa":
        shapes = [(x5, 4, 4), (x5, 4, 2), (x4, 2, 1)]
    else:
        assert n is not None
        shapes = [(x5, n, n), (x5, 2 * n, n)] + ([(x4, 4 * n, n)] if 4 * n <= _D_MODEL else [])
    found = []
    for x, h, hkv in shapes:
        width = hkv * (_D_MODEL // h)
        kv = "key/value head" if hkv == 1 else "key/value heads"
        found.append(
            Probe(
                f"{len(x)} tokens, {h} heads, {hkv} {kv}",
                "main",
                (x, w[0], w[1][:, :width], w[2][:, :width], w[3]),
                num_heads=h,
                num_kv_heads=hkv,
            )
        )
    large = dataclasses.replace(
        found[1], name="large scores", role="large", arrays=(8.0 * x5, *found[1].arrays[1:]), base=1
    )
    return [*found, large]


_SQUARE = "Lq=Lk=d_k=16"
_SQUARE_MULTI = "4 tokens, 4 heads of 4"
_MASKED_SELF = "5 tokens, masked keys"
_CROSS = "cross: 4 queries, 6 keys"
_CROSS_MASKED = "cross: 4 queries, 6 keys, masked keys"
_MASKED_ROW = "a fully masked row"


def _module_probes(
    rng: np.random.Generator, w: list[Array], heads: int, *, with_mask: bool, cross: bool
) -> list[Probe]:
    """The probes of an attention class's mask and cross-attention (kinds multi-head and
    head): masked keys in self-attention, then queries apart from the keys and values,
    unmasked and masked, and a fully masked row."""
    width = w[0].shape[0]
    x5, xq, xkv = (rng.normal(size=(n, width)) for n in (5, 4, 6))
    allow5 = np.ones((5, 5), dtype=bool)
    allow5[0, 3] = allow5[1, [0, 4]] = allow5[3, [1, 2]] = allow5[4, 0] = False
    allow = np.ones((4, 6), dtype=bool)
    allow[0, [1, 4]] = allow[1, 0] = allow[2, [2, 3, 5]] = allow[3, 5] = False
    found = []
    if with_mask:
        found.append(Probe(_MASKED_SELF, "main", (x5, *w), allow5, num_heads=heads))
    if cross:
        found.append(Probe(_CROSS, "main", (xq, *w), num_heads=heads, memory=xkv))
        if with_mask:
            found.append(Probe(_CROSS_MASKED, "main", (xq, *w), allow, heads, memory=xkv))
    if with_mask:
        empty = allow5.copy()
        empty[2, :] = False
        found.append(Probe(_MASKED_ROW, "masked-row", (x5, *w), empty, num_heads=heads))
    return found


def _head_probes(width: int, head_size: int, *, with_mask: bool, cross: bool) -> tuple[Probe, ...]:
    """The probes of kind head: one head of ``head_size`` on inputs of ``width``, W_o = I
    (a class without an output projection ignores it)."""
    rng = np.random.default_rng(20261129)
    w = [rng.normal(0.0, 0.5, (width, head_size)) for _ in range(3)]
    w.append(np.eye(head_size))
    x5, x3 = rng.normal(size=(5, width)), rng.normal(size=(3, width))
    xsq = rng.normal(size=(head_size, width))
    found = (
        Probe("5 tokens", "main", (x5, *w)),
        Probe("3 tokens", "main", (x3, *w)),
        Probe("large scores", "large", (8.0 * x5, *w), base=0),
        Probe(f"{head_size} tokens = head_size", "main", (xsq, *w)),
    )
    extra = _module_probes(rng, w, 1, with_mask=with_mask, cross=cross)
    return (*found, *extra, _again(found))


def _probes(
    kind: str, *, with_mask: bool, num_kv_heads: int | None = None, cross: bool = False
) -> tuple[Probe, ...]:
    rng = np.random.default_rng(20261123)
    found: tuple[Probe, ...]
    if kind in ("multi-head", "gqa"):
        w = [rng.normal(0.0, 0.25, (_D_MODEL, _D_MODEL)) for _ in range(4)]
        x5 = rng.normal(size=(5, _D_MODEL))
        x4 = rng.normal(size=(4, _D_MODEL))
        if kind == "gqa" or num_kv_heads is not None:
            found = tuple(_grouped(x5, x4, w, kind, num_kv_heads))
        else:
            found = (
                Probe("5 tokens, 4 heads", "main", (x5, *w), num_heads=4),
                Probe("4 tokens, 2 heads", "main", (x4, *w), num_heads=2),
                Probe("large scores", "large", (8.0 * x5, *w), num_heads=4, base=0),
                Probe(_SQUARE_MULTI, "main", (x4, *w), num_heads=4),
            )
        extra = _module_probes(rng, w, 4, with_mask=with_mask, cross=cross)
        return (*found, *extra, _again(found))
    q5, k5, v5 = rng.normal(size=(5, 16)), rng.normal(size=(5, 16)), rng.normal(size=(5, 3))
    q3, k6, v6 = rng.normal(size=(3, 16)), rng.normal(size=(6, 16)), rng.normal(size=(6, 3))
    big_q, big_k = q3.copy(), k6.copy()
    big_q[:, 0] = _LARGE
    big_k[:, 0] = _LARGE
    order_q, order_k = np.zeros((4, 16)), np.zeros((5, 16))
    order_q[:, 0], order_k[:, 0] = _ORDER_Q, _ORDER_K
    order = (order_q, order_k, np.eye(5))
    # Lk = d_k: Q·K without the transpose runs here (and fails on the others)
    square = (rng.normal(size=(16, 16)), rng.normal(size=(16, 16)), rng.normal(size=(16, 3)))
    if kind == "causal":
        big5q, big5k = q5.copy(), k5.copy()
        big5q[:, 0] = _LARGE
        big5k[:, 0] = _LARGE
        found = (
            Probe("5 tokens", "main", (q5, k5, v5)),
            Probe("Lq=3, Lk=6", "main", (q3, k6, v6)),
            Probe("known score order", "main", order),
            Probe("large scores", "large", (big5q, big5k, v5), base=0),
            Probe(_SQUARE, "main", square),
        )
    elif not with_mask:
        found = (
            Probe("Lq=Lk=5", "main", (q5, k5, v5)),
            Probe("Lq=3, Lk=6", "main", (q3, k6, v6)),
            Probe("known score order", "main", order),
            Probe("large scores", "large", (big_q, big_k, v6), base=1),
            Probe(_SQUARE, "main", square),
        )
    else:
        allow = np.ones((3, 6), dtype=bool)
        allow[0, [1, 4]] = False
        allow[1, 0] = False
        allow[2, [2, 3, 5]] = False
        empty_row = allow.copy()
        empty_row[1, :] = False
        found = (
            Probe("Lq=Lk=5, nothing masked", "main", (q5, k5, v5), np.ones((5, 5), dtype=bool)),
            Probe("Lq=3, Lk=6, masked keys", "main", (q3, k6, v6), allow),
            Probe("known score order", "main", order, np.ones((4, 5), dtype=bool)),
            Probe("large scores", "large", (big_q, big_k, v6), allow, base=1),
            Probe("a fully masked row", "masked-row", (q3, k6, v6), empty_row),
            Probe(_SQUARE, "main", square, np.ones((16, 16), dtype=bool)),
        )
    return (*found, _again(found))
