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

__all__ = [
    "CODE_PARTS",
    "FLASH_PARTS",
    "PARTS",
    "PART_TITLES",
    "STEP_PARTS",
    "flash_part",
    "part_of",
]

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
    "flash-output",
    "flash-lse",
    "flash-causal",
    "flash-backward",
)
"""Every part a rubric may give points to, in the order of computation (the last four are
those of a FlashAttention assignment, ``--kind flash``)."""

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
    "flash-output": "forward output: O = softmax(QKᵀ/√d)·V, block by block",
    "flash-lse": "log-sum-exp: L = m + ln l, one per query",
    "flash-causal": "causal: query i sees keys 0 … i, block by block",
    "flash-backward": "backward: dQ, dK, dV from P = exp(S − L) and D = rowsum(dO ∘ O)",
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
    "flash-no-rescale": "flash-output",
    "flash-sum-not-rescaled": "flash-output",
    "flash-max-not-updated": "flash-output",
    "flash-final-divide-missing": "flash-output",
    "flash-last-tile-dropped": "flash-output",
    "flash-kv-tiles-from-q": "flash-output",
    "flash-raised": "flash-output",
    "flash-unrecognised": "flash-output",
    "flash-lse-wrong-base": "flash-lse",
    "flash-lse-without-max": "flash-lse",
    "flash-empty-tile-nan": "flash-causal",
    "flash-causal-diagonal": "flash-causal",
    "flash-causal-offset": "flash-causal",
    "flash-causal-ignored": "flash-causal",
    "flash-backward-D": "flash-backward",
    "flash-backward-scale": "flash-backward",
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


FLASH_PARTS: tuple[str, ...] = ("flash-output", "flash-lse", "flash-causal", "flash-backward")
"""The parts of a FlashAttention assignment (``qkv grade --kind flash``)."""

_FLASH_PLAIN = {"unscaled": "flash-output", "scaled-by-dk": "flash-output"}


def flash_part(code: str | None, step: str, causal: bool) -> str:
    """The part of a FlashAttention assignment a finding costs: its step (``lse``, ``dQ``,
    ``dK``, ``dV``) first, then a causal probe's output, then the code's part.

    Example:
        >>> flash_part("flash-raised", "output", True), flash_part("unscaled", "output", False)
        ('flash-causal', 'flash-output')
    """
    if step == "lse":
        return "flash-lse"
    if step in ("dQ", "dK", "dV"):
        return "flash-backward"
    part = _FLASH_PLAIN.get(code or "", CODE_PARTS.get(code or "", "flash-output"))
    if part not in FLASH_PARTS:
        part = "flash-causal" if causal else "flash-output"
    if causal and part == "flash-output" and code in ("flash-raised", "flash-unrecognised"):
        return "flash-causal"
    return part
