"""The renderers' view of the one step vocabulary, :mod:`qkv.steps`.

A recorded step carries its own formula and description; a step loaded without them (a
hand-written JSON file) falls back to the words :mod:`qkv.steps` holds for it, the same words
the reference records.
"""

from __future__ import annotations

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


def latex_formula(name: str) -> str | None:
    """The step's formula in LaTeX, or None for a name :mod:`qkv.steps` does not know."""
    return WORDS[name].latex if name in WORDS else None
