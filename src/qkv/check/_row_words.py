"""What each row of a worked example is, in the seeds' words: the names of tokens, the
scaling, the correct row with its numbers, and the sentences of arithmetic mistakes,
consequential rows and rounding notes. :class:`~qkv.check._slip_words.SlipWords` adds what
went wrong (the slips)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from qkv._format import number
from qkv.check._pipeline import Setup, Values, row_of, slot_head, step_of
from qkv.check._steps import words_of as _words_of
from qkv.examples._model import decimals_of

__all__ = ["RowWords", "join_and", "vector"]

_INPUTS = {
    "scores": ("Q", "K"),
    "scaled": ("scores",),
    "exp": ("scaled",),
    "exp_sum": ("exp",),
    "weights": ("exp",),
    "products": ("weights", "V"),
    "context": ("products",),
    "output": ("context",),
}
_PLAIN_NAME = re.compile(r"[^\W\d][\w'-]{0,19}")
_MAX_TERMS = 8  # a weighted sum with more terms is written Σ_j w_j·v_j


def vector(values: Sequence[float] | np.ndarray, decimals: int) -> str:
    """``[0.50, 0.80]``."""
    return "[" + ", ".join(number(float(v), decimals) for v in values) + "]"


def join_and(items: Sequence[str]) -> str:
    """``a, b and c``."""
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


class RowWords:
    """Sentences about the rows of one example: what each row is and should be.

    Args:
        tokens: the example's tokens.
        setup: its inputs and options.
        scale: the example's scale option (True, False or a number).
        correct: the correct values of every step.
        claimed_steps: the steps the example claims rows of.
        queries: the names of the queries when they are not ``tokens`` (Lq ≠ Lk).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        setup: Setup,
        scale: bool | float,
        correct: Values,
        claimed_steps: Sequence[str],
        queries: Sequence[str] | None = None,
    ) -> None:
        self.keys = tuple(tokens)
        self.tokens = self.keys if queries is None else tuple(queries)
        self.setup = setup
        self.scale = scale
        self.correct = correct
        self.claimed_steps = tuple(claimed_steps)

    # -- names ---------------------------------------------------------------------------

    def label(self, t: int, *, key: bool = False) -> str:
        """``"love"``, or ``"the" (position 4)`` for a token that appears more than once;
        ``key``: a key's name (they differ from the queries' when Lq ≠ Lk)."""
        names = self.keys if key else self.tokens
        token = names[t]
        if names.count(token) > 1:
            return f'"{token}" (position {t})'
        return f'"{token}"'

    def sub(self, t: int, *, key: bool = False) -> str:
        """The subscript of a token in a formula: ``love`` in q_love, or its position."""
        names = self.keys if key else self.tokens
        token = names[t]
        if names.count(token) == 1 and _PLAIN_NAME.fullmatch(token):
            return token
        return str(t)

    def printed_inputs(self, step: str) -> list[str]:
        """The claimed steps a step is computed from, nearest first (``["weights", "V"]``)."""
        found: list[str] = []
        for source in _INPUTS.get(step, ()):
            if source in self.claimed_steps:
                found.append(source)
            else:
                found += [s for s in self.printed_inputs(source) if s not in found]
        return found

    def from_printed(self, step: str) -> str:
        """``"the printed attention weights and value vectors"``."""
        nouns = [_words_of(s).noun(2) for s in self.printed_inputs(step)]
        if len(nouns) > 1 and all(n.endswith(" vectors") for n in nouns):
            return (
                "the printed " + join_and([n.removesuffix(" vectors") for n in nouns]) + " vectors"
            )
        return "the printed " + join_and(nouns)

    # -- the scaling ---------------------------------------------------------------------

    def _sqrt_dk(self) -> str:
        d_k = self.setup.d_k
        root = math.sqrt(d_k)
        if root.is_integer():
            return f"√d_k = √{d_k} = {int(root)}"
        return f"√d_k = √{d_k} ≈ {root:.4f}"

    def proper_scaling(self) -> str:
        """What this example does to the scores: ``dividing them by √d_k = √2 ≈ 1.4142``."""
        if self.scale is True:
            return f"dividing them by {self._sqrt_dk()}"
        if self.scale is False:
            return "leaving them as they are (this example does not scale the scores)"
        return f"multiplying them by the scale {self.scale:g}"

    # -- what a row should be ------------------------------------------------------------

    def correct_line(self, step: str, t: int, decimals: int) -> str:
        """What the row is, computed correctly, with its numbers (``step``: a step or a slot,
        ``weights@1`` for head 2)."""
        slot, step, head = step, step_of(step), slot_head(step)
        key = step in ("K", "V")
        who, s = self.label(t, key=key), self.sub(t, key=key)
        row = vector(row_of(self.correct, slot, t), decimals)
        in_head = "" if head is None else f" in head {head}"
        if step in ("Q", "K", "V"):
            letter = step.lower()
            noun = _words_of(step).noun(1)
            if step in self.setup.given:
                return f"The {noun} of {who}{in_head} is as given: {row}."
            return (
                f"The {noun} of {who}{in_head} is its embedding times W_{letter}: "
                f"{letter}_{s} = x_{s}·W_{letter} = {row}."
            )
        if step == "scores":
            if "scores" in self.setup.given:
                return f"The attention scores of {who} are as given: {row}{self._before_mask()}."
            return (
                f"The attention scores of {who}{in_head} are the dot products of its query "
                f"vector with every key vector, q_{s}·k_j: {row}{self._before_mask()}."
            )
        if step == "scaled":
            if self.scale is True:
                how = f"divided by {self._sqrt_dk()}"
            elif self.scale is False:
                how = "unchanged (this example does not scale the scores)"
            else:
                how = f"multiplied by the scale {self.scale:g}"
            return (
                f"The scaled scores of {who}{in_head} are its scores {how}: "
                f"{row}{self._before_mask()}."
            )
        if step == "exp":
            return (
                f"The exponentials of {who}{in_head} are e^s for each scaled score s (0 for a "
                f"masked key): {row}."
            )
        if step == "exp_sum":
            return f"The sum of the exponentials of {who}{in_head} is {row[1:-1]}."
        if step == "weights":
            over = "(over the keys)"
            if self.setup.version == 1 and self.setup.causal:
                over += " (keys after it get weight 0)"
            elif self.setup.masked:
                over = "(over the keys; a masked key gets weight 0)"
            return (
                f"The attention weights of {who}{in_head} are the softmax of its scaled "
                f"scores along the row {over}, so they sum to 1: {row}."
            )
        if step == "products":
            return (
                f"The terms w_j·v_j of {who}{in_head}, each value vector times its weight, "
                f"key after key: {row}."
            )
        if step == "context":
            if head is not None:
                return (
                    f"The context vector of {who} in head {head} is the weighted sum of "
                    f"that head's value vectors: {row}."
                )
            return f"The context vector of {who} is {self._weighted_sum(t, decimals)}."
        if self.setup.W_o is None:
            return f"The output of {who} is its context vector (this example has no W_o): {row}."
        return (
            f"The output of {who} is its context vector (all heads side by side) times W_o: {row}."
        )

    def _before_mask(self) -> str:
        if self.setup.version == 2 and self.setup.masked:
            return " (before the mask; a masked key's score may be printed as −∞)"
        return ""

    def _weighted_sum(self, t: int, decimals: int) -> str:
        row = vector(row_of(self.correct, "context", t), decimals)
        if self.setup.heads > 1:
            return (
                "in each head the weighted sum of that head's value vectors, the heads side by "
                f"side: {row}"
            )
        weights = self.correct["weights"][0, t]
        terms = [
            f"{number(float(w), 4)}·v_{self.sub(j, key=True)}" for j, w in enumerate(weights) if w
        ]
        if len(terms) > _MAX_TERMS:
            return f"the weighted sum of the value vectors, Σ_j w_j·v_j = {row}"
        return (
            f"the weighted sum of the value vectors: c_{self.sub(t)} = {' + '.join(terms)} = {row}"
        )

    def arithmetic(
        self,
        step: str,
        printed: Sequence[str],
        expected: np.ndarray,
        marks: Sequence[str],
        decimals: int,
    ) -> str:
        """The sentence of an arithmetic mistake, naming the wrong numbers."""
        wrong = [i for i, m in enumerate(marks) if m == "wrong"]
        near = [i for i, m in enumerate(marks) if m == "rounding"]
        fixes = [f"{printed[i]} should be {number(float(expected[i]), decimals)}" for i in wrong]
        if len(fixes) > 4:
            detail = f"{len(wrong)} of {len(marks)} numbers are wrong"
        else:
            detail = "; ".join(fixes)
        if near and len(near) <= 4:
            offs = ", ".join(
                f"{printed[i]} for {number(float(expected[i]), decimals)}" for i in near
            )
            detail += f"; off by one in the last digit: {offs}"
        return f"No common slip gives these numbers: an arithmetic mistake ({detail})."

    def not_from_printed(self, step: str, value: np.ndarray, decimals: int) -> str:
        """``From the printed scores it would be [...], not what was printed either.``"""
        return (
            f"From {self.from_printed(step)} it would be {vector(value, decimals)}, not what "
            "was printed either."
        )

    def weights_sum(self, claimed: np.ndarray, half: np.ndarray, decimals: int) -> str:
        """A remark when printed weights do not sum to 1."""
        total = float(np.sum(claimed))
        if abs(total - 1.0) <= float(np.sum(half)) + 1e-9:
            return ""
        return f"The printed weights sum to {number(total, decimals)}, not 1."

    def consequential(
        self, step: str, causes: Sequence[tuple[str, int]], value: np.ndarray, p: int
    ) -> str:
        """The sentence of a correct step done on wrong numbers printed before it."""
        by_step: dict[str, list[int]] = {}
        for cause_step, row in causes:
            by_step.setdefault(cause_step, []).append(row)
        parts = []
        for cause_step, rows in by_step.items():
            noun = _words_of(cause_step).noun(len(rows))
            parts.append(f"the wrong {noun} of {join_and([self.label(r) for r in rows])}")
        return (
            f"Follows from {join_and(parts)}: this step, done right on {self.from_printed(step)}, "
            f"gives {vector(value, p)}, as printed."
        )

    def rounding(self, printed: Sequence[str], expected: np.ndarray, marks: Sequence[str]) -> str:
        """The sentence of a rounding note."""
        near = [i for i, m in enumerate(marks) if m == "rounding"]
        offs = ", ".join(
            f"{printed[i]} for {number(float(expected[i]), decimals_of(printed[i]) + 2)}"
            for i in near[:4]
        )
        return f"Off only beyond the printed digits ({offs}): a rounding note, not an error."

    def float_rounding(
        self, printed: Sequence[str], expected: np.ndarray, notes: Sequence[bool]
    ) -> str:
        """The sentence of a rounding note for numbers off by float32 rounding only."""
        near = [i for i, note in enumerate(notes) if note]
        offs = ", ".join(
            f"{printed[i]} for {number(float(expected[i]), decimals_of(printed[i]) + 2)}"
            for i in near[:4]
        )
        return (
            f"Off only by the rounding of a computation in float32 ({offs}: a few units in the "
            "last place of a float32): a rounding note, not an error. Write dtype: float32 in "
            "the file when its numbers come from float32 code, or dtype: float64 to hold every "
            "printed digit."
        )
