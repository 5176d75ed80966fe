"""The words for every step a check can claim: those of :data:`qkv.steps.WORDS`, and the
intermediate steps of format 2 (``exp``, ``exp_sum``, ``products``)."""

from __future__ import annotations

from qkv.steps import TILED_WORDS, WORDS, StepWords

__all__ = ["words_of"]

_MORE = {
    "exp": StepWords(
        "exp",
        "Exponentials of the scaled scores",
        "E = exp(S')",
        r"E = \exp(S')",
        "exponentials: e to the power of each scaled score (0 for a masked key)",
        "exponentials",
        "exponentials",
    ),
    "exp_sum": StepWords(
        "exp_sum",
        "Sums of the exponentials",
        "Σ_j E_j",
        r"\sum_j E_j",
        "the sum of a row of exponentials: the softmax divides by it",
        "sum of the exponentials",
        "sums of the exponentials",
    ),
    "products": StepWords(
        "products",
        "Weighted value vectors w_j·v_j",
        "w_j·v_j",
        r"w_j v_j",
        "the terms of a context vector: each value vector times its weight",
        "weighted value vectors",
        "weighted value vectors",
    ),
}


def words_of(step: str, *, tiled: bool = False) -> StepWords:
    """The words of a step: ``words_of("exp").title`` is ``"Exponentials of the scaled scores"``;
    with ``tiled``, a step of the tiled algorithm (``running_max``, its ``output`` O / l).

    Example:
        >>> words_of("weights").title, words_of("products").noun(2)
        ('Attention weights', 'weighted value vectors')
    """
    if tiled:
        return TILED_WORDS[step]
    return _MORE[step] if step in _MORE else WORDS[step]
