"""What went wrong, in the seeds' words: the sentence of each slip a worked example can show
(made on purpose by :func:`~qkv.check._pipeline.forward`, or seen in the printed row itself:
masks, digit slips, weights that are no softmax, exponentials rounded to 0, other weights)."""

from __future__ import annotations

import numpy as np

from qkv._format import number
from qkv.check._pipeline import (
    HEADS_AVERAGED,
    MASK_IGNORED,
    MASK_INVERTED,
    MISALIGNED,
    NOT_SUMMED,
    OTHER_WEIGHTS,
    SCALED_BY_DK,
    SCALED_BY_DMODEL,
    SUM_NORMALISED,
    SWAPPED,
    TRANSPOSED,
    UNSCALED,
    WRONG_AXIS,
    WRONG_QUERY,
    Candidate,
    row_of,
    step_of,
)
from qkv.check._row_words import RowWords, join_and, vector
from qkv.check._steps import words_of as _words_of

__all__ = ["SlipWords"]


def _subject(step: str) -> str:
    """How a sentence about one row of ``step`` starts: ``This query vector comes``,
    ``These weights come``."""
    words = _words_of(step)
    if words.countable:
        return f"This {words.singular} comes"
    return f"These {words.short or words.plural} come"


def _before_period(sentence: str, insert: str) -> str:
    """Put ``insert`` before the sentence's last period (or at its end)."""
    if insert and sentence.endswith("."):
        return sentence[:-1] + insert + "."
    return sentence + insert


class SlipWords(RowWords):
    """Sentences about the rows of one example, with what went wrong in a wrong row (the
    arguments of :class:`~qkv.check._row_words.RowWords`)."""

    def slip(self, step: str, t: int, candidate: Candidate, decimals: int) -> str:
        """What the slip was, in plain words (the message starts with this)."""
        step = step_of(step)
        printed = candidate.start == "claimed" and bool(self.printed_inputs(step))
        if candidate.slip.code == OTHER_WEIGHTS:
            return self.other_weights(t, candidate, printed)
        if candidate.slip.code == NOT_SUMMED:
            return self._not_summed(t, candidate, decimals, printed)
        source = f" (from {self.from_printed(step)})" if printed else ""
        return _before_period(self._at_slip(step, t, candidate), source)

    def _slip_phrase(self, t: int, candidate: Candidate) -> str:
        slip = candidate.slip
        if slip.code == UNSCALED:
            return f"scores that were not scaled: {self._left_out()}"
        if slip.code == SCALED_BY_DK:
            return f"scores divided by d_k = {self.setup.d_k}{self._instead_of_dk()}"
        if slip.code == TRANSPOSED:
            names = join_and([f"{w}ᵀ" for w in slip.weights])
            return f"{names} used instead of {join_and(list(slip.weights))} (X·Wᵀ instead of X·W)"
        if slip.code == WRONG_AXIS:
            return (
                "weights normalised over the queries (down each column) instead of over the "
                "keys (along each row)"
            )
        if slip.code == SWAPPED:
            return f"K·Qᵀ instead of Q·Kᵀ: scores of every query with the key of {self.label(t)}"
        if slip.code == SCALED_BY_DMODEL:
            d = self.setup.d_model
            return (
                f"scores divided by √d_model = √{d} instead of √d_head = √{self.setup.d_k} "
                "(d_head = d_model / heads)"
            )
        if slip.code == SUM_NORMALISED:
            return (
                "scores divided by their row sum instead of going through softmax "
                "(exponentiate, then divide by the sum of the exponentials)"
            )
        if slip.code in (MASK_IGNORED, MASK_INVERTED, MISALIGNED):
            return self.mask_rule(slip.code)
        if slip.code == HEADS_AVERAGED:
            return (
                "the heads' weights averaged and applied to all of V, instead of each head's "
                "context computed on its own slice of V and the heads put side by side"
            )
        return (
            f"the query vector of {self.label(slip.query)} used instead of that of {self.label(t)}"
        )

    def _instead_of_dk(self) -> str:
        """What the scores should have been divided or multiplied by instead of 1/d_k."""
        if self.scale is True:
            return f" instead of by {self._sqrt_dk()}"
        if self.scale is False:
            return ", but this example does not scale the scores"
        return f" instead of multiplied by the scale {self.scale:g}"

    def _left_out(self) -> str:
        if self.scale is True:
            return f"the division by {self._sqrt_dk()} was left out"
        return f"{self.proper_scaling()} was left out"

    def _at_slip(self, step: str, t: int, candidate: Candidate) -> str:
        """The slip said where it happens; in a later step, what the row comes from."""
        slip = candidate.slip
        who, s = self.label(t), self.sub(t)
        if slip.code == UNSCALED and step == "scaled":
            return f"These are the scores q_{s}·k_j themselves: {self._left_out()}."
        if slip.code == UNSCALED and step == "weights":
            return f"These weights are the softmax of unscaled scores: {self._left_out()}."
        if slip.code == SCALED_BY_DK and step in ("scaled", "weights"):
            what = (
                "These scores were"
                if step == "scaled"
                else "These weights are the softmax of scores"
            )
            return f"{what} divided by d_k = {self.setup.d_k}{self._instead_of_dk()}."
        if slip.code == TRANSPOSED and step in ("Q", "K", "V"):
            letter = step.lower()
            return (
                f"This is x_{s}·W_{letter}ᵀ: W_{letter} was used transposed (the "
                f"column-vector form {letter} = W·x mixed up with the row-vector form "
                f"{letter} = x·W_{letter})."
            )
        if slip.code == WRONG_AXIS and step == "weights":
            total = float(np.sum(row_of(candidate.values, "weights", t)))
            return (
                "The softmax was taken down each column (over the queries) instead of along "
                f"the row (over the keys): this row sums to {number(total, 4)}, not 1."
            )
        if slip.code == SWAPPED and step == "scores":
            return (
                f"This row holds k_{s}·q_j, the scores of every query with the key of {who} "
                "(a column of Q·Kᵀ): K·Qᵀ was computed instead of Q·Kᵀ."
            )
        if slip.code == WRONG_QUERY and step == "Q":
            o = self.sub(slip.query)
            return (
                f"This is the query vector of {self.label(slip.query)}, x_{o}·W_q, not that "
                f"of {who}."
            )
        return f"{_subject(step)} from {self._slip_phrase(t, candidate)}."

    def _not_summed(self, t: int, candidate: Candidate, decimals: int, printed: bool) -> str:
        slip = candidate.slip
        q, j = slip.query, slip.key
        weight = number(float(candidate.values["weights"][0, q, j]), 4)
        if self.setup.heads > 1:
            term = f"w_{self.sub(j)}·v_{self.sub(j)} (in each head)"
        else:
            term = f"{weight}·v_{self.sub(j)}"
        value = vector(candidate.value, decimals)
        if printed:
            value += " (with the printed weight and value vector)"
        if j == t and q != t:
            return (
                f"This is {term} = {value}, the term of {self.label(j)} in the weighted sum "
                f"of the query {self.label(q)}, not a context vector: a context vector adds "
                "up the terms w_j·v_j of every key."
            )
        return (
            f"This is only {term} = {value}, one term of the weighted sum of "
            f"{self.label(q)}: a context vector adds up the terms w_j·v_j of every key."
        )

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
        masked = f"the masked keys of {self.label(t)} are {join_and(keys)}" if keys else ""
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
