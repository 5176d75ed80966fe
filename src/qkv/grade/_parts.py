"""The parts of the mechanism a grade gives points for, and which part each slip code costs.

A part is a step of attention as the seeds name it: the projections (Q = X·W_q, ...), the
scores Q·Kᵀ, their scaling by 1/√d_k, the mask, the softmax, the weighted sum of the value
vectors, and the heads (or the output projection W_o). A slip code of ``qkv check`` (both the
worked-example codes and those of ``--function``) belongs to one part: ``unscaled`` to
``scaling``, ``softmax-wrong-axis`` to ``softmax``. Codes that name no step (``arithmetic``,
``digit-slip``, ``unrecognised``) belong to the part of the step they were found at.

Example:
    >>> part_of("unscaled", "weights"), part_of("arithmetic", "context")
    ('scaling', 'weighted-sum')
    >>> PART_TITLES["softmax"]
    'softmax: each row of weights sums to 1'
"""

from __future__ import annotations

__all__ = ["CODE_PARTS", "PARTS", "PART_TITLES", "STEP_PARTS", "part_of"]

PARTS: tuple[str, ...] = (
    "projections",
    "scores",
    "scaling",
    "mask",
    "softmax",
    "weighted-sum",
    "heads",
    "output",
    "batched",
)
"""Every part a rubric may give points to, in the order of computation."""

PART_TITLES: dict[str, str] = {
    "projections": "projections: Q = X·W_q, K = X·W_k, V = X·W_v",
    "scores": "scores: Q·Kᵀ",
    "scaling": "scaling: scores / √d_k",
    "mask": "mask: a masked key gets weight 0",
    "softmax": "softmax: each row of weights sums to 1",
    "weighted-sum": "weighted sum: context = weights·V",
    "heads": "heads: each head on its own slice, concatenated, ·W_o",
    "output": "output: context·W_o",
    "batched": "batched inputs (B, H, L, d)",
}
"""Each part as a student reads it: its name and what it computes."""

CODE_PARTS: dict[str, str] = {
    "transposed-weights": "projections",
    "query-key-swapped": "scores",
    "wrong-query": "scores",
    "unscaled": "scaling",
    "scaled-by-ndim": "scaling",
    "scaled-by-num-heads": "scaling",
    "scaled-by-dk": "scaling",
    "scaled-by-dmodel": "scaling",
    "mask-ignored": "mask",
    "mask-inverted": "mask",
    "causal-misaligned": "mask",
    "masked-row-nan": "mask",
    "causal-off-by-one": "mask",
    "mask-after-softmax": "mask",
    "softmax-wrong-axis": "softmax",
    "sum-normalised": "softmax",
    "not-softmax": "softmax",
    "no-max-subtraction": "softmax",
    "exps-rounded-to-zero": "softmax",
    "dropout-at-inference": "softmax",
    "context-not-summed": "weighted-sum",
    "other-weights": "weighted-sum",
    "heads-averaged": "heads",
    "heads-split-without-transpose": "heads",
    "heads-merged-without-transpose": "heads",
    "kv-heads-not-repeated": "heads",
    "kv-heads-wrong-order": "heads",
    "unbatched": "batched",
    "qk-not-transposed": "scores",
    "head-scaled-by-width": "scaling",
    "mask-not-applied": "mask",
    "mask-filled-with-zero": "mask",
    "mask-filled-with-inf": "mask",
    "cross-mask-misaligned": "mask",
}
"""The part each slip code names; the codes not here belong to the step they were found at."""

STEP_PARTS: dict[str, str] = {
    "Q": "projections",
    "K": "projections",
    "V": "projections",
    "scores": "scores",
    "scaled": "scaling",
    "exp": "softmax",
    "exp_sum": "softmax",
    "weights": "softmax",
    "products": "weighted-sum",
    "context": "weighted-sum",
    "output": "output",
}
"""The part each step of ``qkv check`` belongs to (``output`` is ``heads`` with several)."""


def part_of(code: str | None, step: str, *, heads: int = 1) -> str:
    """The part a finding with ``code`` at ``step`` costs."""
    if code in CODE_PARTS:
        return CODE_PARTS[code]
    part = STEP_PARTS.get(step, "weighted-sum")
    return "heads" if part == "output" and heads > 1 else part
