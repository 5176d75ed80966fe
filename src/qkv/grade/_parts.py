"""The parts of the mechanism a grade gives points for, and which part each slip code costs.

A part is a step of attention as the seeds name it: the projections (Q = X·W_q, ...), the
scores Q·Kᵀ, their scaling by 1/√d_k, the mask, the softmax, the weighted sum of the value
vectors, and the heads (or the output projection W_o). A slip code of ``qkv check`` declares
the part it belongs to where it is declared (``part`` of the worked examples' ``DIAGNOSED``,
of ``--function``'s ``CODES`` and of ``--kind flash``'s ``FLASH_CODES``): ``unscaled`` to
``scaling``, ``softmax-wrong-axis`` to ``softmax``. Codes that name no step (``arithmetic``,
``digit-slip``, ``unrecognised``) belong to the part of the step they were found at.

Example:
    >>> part_of("unscaled", "weights"), part_of("arithmetic", "context")
    ('scaling', 'weighted-sum')
    >>> PART_TITLES["softmax"]
    'softmax: each row of weights sums to 1'
"""

from __future__ import annotations

from qkv.check._findings import DIAGNOSED
from qkv.check._flash_codes import FLASH_CODES, PLAIN_IN_FLASH
from qkv.check._function_codes import CODES

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


def _declared_parts() -> dict[str, str]:
    """The part each code declares where it is declared: the worked examples' diagnoses,
    the codes of ``--function`` and those of ``--kind flash``; a code declared in several
    declares one part (``tests/core/test_registry.py`` checks it)."""
    found: dict[str, str] = {}
    for declared in (DIAGNOSED, CODES, FLASH_CODES):
        found.update({c.code: c.part for c in declared if c.part is not None})
    return found


CODE_PARTS: dict[str, str] = _declared_parts()
"""The part each slip code names, from its declaration; the codes not here (``arithmetic``,
``unrecognised``, ...) belong to the step they were found at."""

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
    if code in PLAIN_IN_FLASH:
        part = PLAIN_IN_FLASH[code] or ""
    else:
        part = CODE_PARTS.get(code or "", "flash-output")
    if part not in FLASH_PARTS:
        part = "flash-causal" if causal else "flash-output"
    if causal and part == "flash-output" and code in ("flash-raised", "flash-unrecognised"):
        return "flash-causal"
    return part
