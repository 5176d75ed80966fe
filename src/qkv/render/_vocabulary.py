"""The renderers' view of the one step vocabulary, :mod:`qkv.steps`.

A recorded step carries its own formula and description; a step loaded without them (a
hand-written JSON file) falls back to the words :mod:`qkv.steps` holds for it, the same words
the reference records.
"""

from __future__ import annotations

import re

from qkv._format import latex_escape
from qkv.steps import WORDS
from qkv.steps import meaning as step_meaning
from qkv.trace import Step

__all__ = ["TITLES", "latex_formula", "meaning", "plain_formula"]

TITLES: dict[str, str] = {name: words.title for name, words in WORDS.items()}
"""The title of each step, in the seeds' vocabulary (``"Attention weights"``)."""


def meaning(step: Step) -> str:
    """The step's description without a leading ``"attention scores: "``, capitalised."""
    return step_meaning(step.name, step.description)


def plain_formula(step: Step) -> str:
    """The formula the step recorded, else the one :mod:`qkv.steps` holds for it."""
    return step.formula or (WORDS[step.name].formula if step.name in WORDS else step.name)


_PROJECTION = re.compile(
    r"(?P<letter>[QKV])(?: = (?P<made>(?:RoPE\(|norm\(|\(|\)|[XY]|·|W_[qkv]|b_[qkv]| \+ "
    r"| / √d_k| × [0-9][0-9.e+-]*)+))?"
    r"(?:, split into [0-9]+ heads)?"
)
"""The formulas of Q, K and V that qkv records: ``Q``, ``Q = X·W_q, split into 2 heads``,
``Q = RoPE(X·W_q + b_q)``, ``Q = (X·W_q + b_q) / √d_k``
(:func:`qkv.steps.projection_formula`)."""

_PROJECTION_LATEX = (
    ("RoPE(", r"\operatorname{RoPE}("),
    ("norm(", r"\operatorname{norm}("),
    ("·", " "),
    (" / √d_k", r" / \sqrt{d_k}"),
    (" × ", r" \times "),
)


def latex_formula(step: Step) -> str | None:
    """The step's formula in LaTeX, or None for a name :mod:`qkv.steps` does not know.

    Q, K and V are written as the call recorded them (``Q = RoPE(X·W_q + b_q)`` for a
    model's own; ``Q`` alone when they were given), never as a projection they may not be;
    any other formula a file gives them is shown as text.
    """
    if step.name not in ("Q", "K", "V"):
        return WORDS[step.name].latex if step.name in WORDS else None
    plain = plain_formula(step)
    found = _PROJECTION.fullmatch(plain)
    if found is None or found["letter"] != step.name:
        return r"\text{" + latex_escape(plain) + "}"
    made = found["made"]
    if made is None:
        return step.name
    for text, latex in _PROJECTION_LATEX:
        made = made.replace(text, latex)
    return f"{step.name} = {made}"
