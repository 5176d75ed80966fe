"""Every code ``qkv check --function`` (and ``--module``) reports, declared once: the part
of the mechanism it costs in ``qkv grade``, its sentence, and the slips that give it
(:mod:`~qkv.check._function_slips`).

Several variants may share a code (a causal mask off by one hides the diagonal, or shows one
future key); each says which in its ``detail``. Codes found otherwise than by making the
slip (``not-softmax``, ``no-max-subtraction``, ``dropout-at-inference``, ``masked-row-nan``,
``unbatched``, ``unrecognised``) have no variant: :mod:`~qkv.check._function_diagnose` finds
them.

To add a code: one :class:`FunctionCode` in :data:`CODES` with the part it costs in ``qkv
grade`` (the order there is the order the slips are tried), a buggy function in the tests
that makes it, and its line in ``docs/check-function.md`` (docs/architecture.md has the
checklist).
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.check._findings import DIAGNOSES, Diagnosis
from qkv.check._function_slips import (
    DIAGONAL_HIDDEN,
    IGNORED,
    INVERTED,
    INVERTED_DIAGONAL,
    ONE_AHEAD,
    OTHER_CORNER,
    RIGHT,
    Slip,
    SlipMaker,
    multi,
    single,
)
from qkv.check._probes import Spec

__all__ = ["CODES", "FUNCTION_DIAGNOSES", "FunctionCode", "SlipVariant", "Tried", "slips_of"]


@dataclass(frozen=True)
class SlipVariant:
    """One way to make a slip: a maker (None where it does not apply to a kind of function)
    and, where a code has several, a sentence saying which one it was."""

    make: SlipMaker
    detail: str = ""


@dataclass(frozen=True)
class FunctionCode(Diagnosis):
    """A code of ``qkv check --function``: a :class:`~qkv.check._findings.Diagnosis` (the
    code, the part of the mechanism it costs in ``qkv grade``, what is wrong and what it
    should be; ``unrecognised`` costs no part of its own) with the slips that give it, in
    the order tried (none for a code found otherwise)."""

    variants: tuple[SlipVariant, ...] = ()


def _both(
    *,
    rule: str = RIGHT,
    scale: str = "",
    normalise: str = "softmax",
    swap: bool = False,
    after_softmax: bool = False,
    fill: str = "-inf",
) -> tuple[SlipVariant, SlipVariant]:
    """The same slip for single-head and multi-head functions (``scale``: none or dk)."""
    common = {
        "rule": rule,
        "normalise": normalise,
        "swap": swap,
        "after_softmax": after_softmax,
        "fill": fill,
    }
    return (
        SlipVariant(single(scale=scale or "sqrt", **common)),  # type: ignore[arg-type]
        SlipVariant(multi(scale=scale or "head", **common)),  # type: ignore[arg-type]
    )


def _mask_argument(maker: SlipMaker) -> SlipMaker:
    """A slip of an attention class that takes a mask argument (not the causal rule)."""

    def make(spec: Spec) -> Slip | None:
        return maker(spec) if spec.with_mask and not spec.causal else None

    return make


def _cross_only(maker: SlipMaker) -> SlipMaker:
    """A slip that shows only in cross-attention (an attention class's forward(q, k, v))."""

    def make(spec: Spec) -> Slip | None:
        return maker(spec) if spec.cross else None

    return make


_HIDDEN = "Here the diagonal is hidden: query i sees keys 0 … i − 1, and the first sees none."
_AHEAD = "Here one future key is shown: query i sees keys 0 … i + 1."
_TRIU = (
    "A causal mask built with triu where tril was meant keeps the diagonal: each query "
    "attends itself and the keys after it."
)

CODES: tuple[FunctionCode, ...] = (
    FunctionCode(
        "unscaled",
        "scaling",
        "the scores are not divided by √d_k before the softmax; attention is softmax(Q·Kᵀ/√d_k)·V",
        _both(scale="none"),
    ),
    FunctionCode(
        "scaled-by-dk",
        "scaling",
        "the scores are divided by d_k instead of √d_k",
        _both(scale="dk"),
    ),
    FunctionCode(
        "scaled-by-dmodel",
        "scaling",
        DIAGNOSES["scaled-by-dmodel"],
        (SlipVariant(multi(scale="dmodel")),),
    ),
    FunctionCode(
        "scaled-by-ndim",
        "scaling",
        "the scores are divided by the square root of the number of axes of the array "
        "(Q.ndim, Q.dim(), len(Q.shape)) instead of √d_k, the size of the last axis: take d_k "
        "as Q.shape[-1]",
        (
            SlipVariant(single(scale="ndim")),
            *(SlipVariant(multi(scale="ndim", ndim=n)) for n in (2, 3, 4)),
        ),
    ),
    FunctionCode(
        "scaled-by-num-heads",
        "scaling",
        "each head's scores are divided by √num_heads instead of √d_head (d_head = d_model / "
        "num_heads, the size of one head's query and key vectors)",
        (SlipVariant(multi(scale="heads")),),
    ),
    FunctionCode(
        "head-scaled-by-width",
        "scaling",
        "one head's scores are divided by √(the model's width C, the size of x's last axis) "
        "instead of √head_size: the scale belongs to the head, k.shape[-1] ** -0.5",
        (SlipVariant(multi(scale="width", heads="one")),),
    ),
    FunctionCode(
        "qk-not-transposed",
        "scores",
        "Q·K instead of Q·Kᵀ: did you mean Q·Kᵀ? The scores are each query's dot products "
        "with every key: Q @ K.T (NumPy), Q @ K.transpose(-2, -1) (torch)",
        (
            SlipVariant(single(transpose=False)),
            SlipVariant(multi(transpose=False)),
        ),
    ),
    FunctionCode(
        "transposed-weights",
        "projections",
        "X·Wᵀ instead of X·W: with row vectors, Q = X·W_q (the same for K, V and the output W_o)",
        (
            SlipVariant(
                multi(transposed=("W_q", "W_k", "W_v")),
                "Here W_q, W_k and W_v were used transposed and W_o as it is (the habit of "
                "nn.Linear, whose weight is stored as Wᵀ).",
            ),
            SlipVariant(
                multi(transposed=("W_q", "W_k", "W_v", "W_o")),
                "Here all four, W_q, W_k, W_v and W_o, were used transposed.",
            ),
            SlipVariant(multi(transposed=("W_o",)), "Here only W_o was used transposed."),
        ),
    ),
    FunctionCode(
        "softmax-wrong-axis",
        "softmax",
        "softmax over the queries (axis -2) instead of over the keys: each row of weights, one "
        "per query, must sum to 1 (softmax over the last axis)",
        _both(normalise="columns"),
    ),
    FunctionCode(
        "softmax-over-batch",
        "softmax",
        "the softmax is taken over a leading axis (the batch, dim 0, or the heads, dim 1), not "
        "over the keys: on one sequence every weight is exp(0) = 1 (NaN where a key is masked "
        "with −inf), so each context vector is the sum of the value vectors. Take it over the "
        "last axis, softmax(scores, dim=-1); F.softmax without dim picks dim 0 for 3-D scores "
        "and dim 1 for 4-D ones",
        (SlipVariant(single(normalise="batch")),),
    ),
    FunctionCode(
        "query-key-swapped",
        "scores",
        "K·Qᵀ instead of Q·Kᵀ: row i of the scores must hold query i's scores against every key",
        _both(swap=True),
    ),
    FunctionCode("sum-normalised", "softmax", DIAGNOSES["sum-normalised"], _both(normalise="sum")),
    FunctionCode(
        "mask-not-applied",
        "mask",
        "the mask changes nothing: the masked scores are computed but never used. "
        "masked_fill returns a new tensor: assign it (scores = scores.masked_fill(...)) or "
        "use masked_fill_, and pass the mask on to where the scores are made",
        (SlipVariant(_mask_argument(multi(rule=IGNORED))),),
    ),
    FunctionCode("mask-ignored", "mask", DIAGNOSES["mask-ignored"], _both(rule=IGNORED)),
    FunctionCode(
        "mask-filled-with-zero",
        "mask",
        "the masked scores are set to 0 (or a tiny number such as 1e-9) before the softmax, "
        "and exp(0) = 1 still weights every masked key: set them to −inf (or a large "
        "negative number such as -1e9)",
        _both(fill="zero"),
    ),
    FunctionCode(
        "mask-filled-with-inf",
        "mask",
        "the masked scores are set to +inf instead of −inf, so each row with a masked key "
        "is NaN after the softmax (inf − inf): use float('-inf')",
        _both(fill="+inf"),
    ),
    FunctionCode(
        "cross-mask-misaligned",
        "mask",
        "in cross-attention (fewer queries than keys) the causal mask is misaligned: query i "
        "sees the keys 0 … i, the mask's rows and columns both counted from the start "
        "(mask[:Lq, :Lk])",
        (
            SlipVariant(
                _cross_only(multi(rule=OTHER_CORNER)),
                "Here the causal rule was aligned at the bottom-right corner (query i sees "
                "keys 0 … i + Lk − Lq) where the top-left one was meant.",
            ),
        ),
    ),
    FunctionCode(
        "mask-inverted",
        "mask",
        DIAGNOSES["mask-inverted"],
        (
            *_both(rule=INVERTED),
            SlipVariant(single(rule=INVERTED_DIAGONAL), _TRIU),
            SlipVariant(multi(rule=INVERTED_DIAGONAL), _TRIU),
        ),
    ),
    FunctionCode(
        "causal-misaligned",
        "mask",
        DIAGNOSES["causal-misaligned"],
        (SlipVariant(single(rule=OTHER_CORNER)),),
    ),
    FunctionCode(
        "causal-off-by-one",
        "mask",
        "the causal mask is off by one: query i must see the keys 0 … i, itself included "
        "(np.tril(ones) keeps the diagonal; torch.triu(ones, diagonal=1) marks the masked "
        "keys)",
        (
            SlipVariant(single(rule=DIAGONAL_HIDDEN), _HIDDEN),
            SlipVariant(multi(rule=DIAGONAL_HIDDEN), _HIDDEN),
            SlipVariant(single(rule=ONE_AHEAD), _AHEAD),
            SlipVariant(multi(rule=ONE_AHEAD), _AHEAD),
        ),
    ),
    FunctionCode(
        "mask-after-softmax",
        "mask",
        "the mask is applied after the softmax and the weights are not renormalised, so a row "
        "no longer sums to 1: set the masked scores to −inf before the softmax",
        _both(after_softmax=True),
    ),
    FunctionCode(
        "heads-averaged",
        "heads",
        DIAGNOSES["heads-averaged"],
        (
            SlipVariant(multi(averaged="weights")),
            SlipVariant(
                multi(averaged="outputs"),
                "Here each head's context went through its rows of W_o and the heads' outputs "
                "were averaged, not added: the output is 1/num_heads of attention's.",
            ),
        ),
    ),
    FunctionCode(
        "heads-split-without-transpose",
        "heads",
        "the heads are split with a reshape (or view) to (heads, L, d_head) without a "
        "transpose, so each head mixes the rows of several tokens: reshape to (L, heads, "
        "d_head), then transpose to (heads, L, d_head)",
        (
            SlipVariant(
                multi(split="reshape", merge="reshape"),
                "The heads were put back together with the same reshape.",
            ),
            SlipVariant(multi(split="reshape"), "The heads were put back together right."),
        ),
    ),
    FunctionCode(
        "heads-merged-without-transpose",
        "heads",
        "the heads' context vectors, (heads, L, d_head), are merged with a reshape to (L, "
        "d_model) without transposing (permuting) them back first, so the tokens' rows are "
        "scrambled: transpose to (L, heads, d_head), then reshape",
        (SlipVariant(multi(merge="reshape")),),
    ),
    FunctionCode(
        "kv-heads-wrong-order",
        "heads",
        "query head h must use key/value head h // (H/Hkv): consecutive query heads share one "
        "(torch.repeat_interleave, np.repeat). This used key/value head h % Hkv (torch.repeat "
        "or np.tile puts the copies in the wrong order)",
        (SlipVariant(multi(kv="tile")),),
    ),
    FunctionCode(
        "kv-heads-not-repeated",
        "heads",
        "the key/value heads are not repeated for the query heads of their group: with Hkv < H, "
        "repeat each key/value head H/Hkv times (repeat_interleave) before Q·Kᵀ",
        (SlipVariant(multi(kv="broadcast")), SlipVariant(multi(kv="loop"))),
    ),
    FunctionCode(
        "not-softmax",
        "softmax",
        "the weights are not a softmax of the scores: each row must be exp(s_j) / Σ exp(s), so "
        "a larger score always gets a larger weight, in a fixed ratio e^(s_j − s_k)",
    ),
    FunctionCode(
        "no-max-subtraction",
        "softmax",
        "softmax overflows to inf or NaN at large scores: subtract each row's maximum score "
        "before exp (softmax does not change)",
    ),
    FunctionCode(
        "dropout-at-inference",
        "softmax",
        "the outputs change between two calls with the same inputs: dropout is left on when "
        "the function is used, not trained. Apply dropout only while training "
        "(F.dropout(w, p, training=self.training), or model.eval() with nn.Dropout)",
    ),
    FunctionCode(
        "masked-row-nan",
        "mask",
        "a fully masked row gives NaN; qkv's policy gives it zero weights and a zero context "
        "(a note, not an error)",
    ),
    FunctionCode(
        "unbatched",
        "batched",
        "right on (L, d) inputs but not on batched (B, H, L, d) inputs: use K.swapaxes(-1, -2) "
        "(NumPy) or K.transpose(-2, -1) (torch) instead of K.T, take d_k as Q.shape[-1], and "
        "take the softmax over the last axis",
    ),
    FunctionCode(
        "unrecognised", None, "the outputs are not attention's and match none of the known slips"
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
    correct = (multi() if spec.multi else single())(spec)
    assert correct is not None
    found = [Tried(None, correct)]
    for entry in CODES:
        for variant in entry.variants:
            slip = variant.make(spec)
            if slip is not None:
                found.append(Tried(entry.code, slip, variant.detail))
    return found
