"""The sentences of the newer slips: masks, digit slips, weights that are no softmax, and
a context from other weights. :class:`~qkv.check._words.Words` has them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from qkv._format import number
from qkv.check._pipeline import MASK_IGNORED, MASK_INVERTED, Candidate, Setup

__all__ = ["Format2Words", "vector"]


def vector(values: Sequence[float] | np.ndarray, decimals: int) -> str:
    """``[0.50, 0.80]``."""
    return "[" + ", ".join(number(float(v), decimals) for v in values) + "]"


def _and(items: Sequence[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


class Format2Words(ABC):
    """What :class:`~qkv.check._words.Words` says about masks, digit slips and not-softmax."""

    setup: Setup

    @abstractmethod
    def label(self, t: int, *, key: bool = False) -> str:
        """How a token is named in a sentence (Words says it)."""

    def mask_rule(self, code: str) -> str:
        """The mask slip as a phrase."""
        if code == MASK_IGNORED:
            return (
                "the mask (or the causal rule) not applied: a masked key must get weight 0 "
                "(its score −inf before the softmax)"
            )
        if code == MASK_INVERTED:
            return (
                "the mask applied the wrong way round: the query attends exactly the keys it "
                "must not"
            )
        meant = self.setup.alignment
        other = "top-left" if meant == "bottom-right" else "bottom-right"
        return (
            f"the causal rule aligned {other} instead of {meant} (Lq = {self.setup.lq}, "
            f"Lk = {self.setup.lk}; bottom-right: query i sees keys 0 … i + Lk − Lq)"
        )

    def mask_slip(self, code: str, t: int) -> str:
        """The sentence of masked scores (−inf) printed at the wrong keys."""
        allowed = self.setup.allowed()[t]
        keys = [self.label(j, key=True) for j in range(len(allowed)) if not allowed[j]]
        masked = f"the masked keys of {self.label(t)} are {_and(keys)}" if keys else ""
        masked = masked or f"no key of {self.label(t)} is masked"
        return f"The −inf are at the wrong keys: {self.mask_rule(code)}; {masked}."

    def rounded_to_zero(self, t: int, largest: float) -> str:
        """The sentence of exponentials rounded to 0 and carried on (a sum of 0)."""
        return (
            f"The exponentials of {self.label(t)} were rounded to 0 and carried on (the largest "
            f"is {largest:.3g}): their sum is 0 and the weights 0/0, not a number. Subtract the "
            "row's largest score before exp (the softmax is the same, and the largest "
            "exponential becomes 1), or keep more digits."
        )

    def digit_slip(self, printed: str, right: str, index: int, step: str) -> str:
        """The sentence of a digit slip."""
        return (
            f"A digit slip: {printed} should be {right} (number {index + 1} of the row); "
            "the other numbers are right."
        )

    def not_softmax(
        self,
        t: int,
        pair: tuple[int, int],
        scores: np.ndarray,
        weights: np.ndarray,
        printed: bool,
    ) -> str:
        """The sentence of weights no softmax of the scores gives."""
        j, k = pair
        which = "printed" if printed else "correct"
        if j < 0:
            return (
                f"These weights are not a softmax of the {which} scaled scores: they keep the "
                "order of the scores, but no softmax of them (at any scale) gives these "
                "ratios: e^s makes equal steps in the score equal ratios of the weights."
            )
        a = self.label(j, key=True)
        return (
            f"These weights are not a softmax of the {which} scaled scores: {a} has a score "
            f"at least as large ({number(float(scores[j]), 4)} ≥ {number(float(scores[k]), 4)}) "
            f"but a smaller weight ({number(float(weights[j]), 4)} < "
            f"{number(float(weights[k]), 4)}); softmax keeps the order of the scores."
        )

    def other_weights(self, t: int, candidate: Candidate, printed: bool) -> str:
        other = vector(candidate.slip.other, 4)
        whose = "the printed weights" if printed else "its weights"
        return (
            f"This context vector is the weighted sum of the value vectors with the weights "
            f"{other}, not with {whose}: it was computed from other weights (rounded, or "
            "assumed)."
        )
