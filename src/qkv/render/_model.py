"""The narrative: what every renderer shows, built once from a trace.

A :class:`Narrative` is a header (:class:`Fact` lines) and :class:`Section` objects (one per
head of a multi-head run, or one for a single head), each a list of :class:`StepView`:
a title in the seeds' words, a formula, one line on what it means, a :class:`Table` with
token labels, and worked :class:`Equation` lines (dot products, softmax, weighted sums).
Renderers only lay these out; none of them decides what to say.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Equation", "Fact", "Math", "Narrative", "Section", "StepView", "Table"]


@dataclass(frozen=True)
class Math:
    """One piece of mathematics in two spellings.

    Attributes:
        plain: Unicode text, e.g. ``"0.3046·v_I"``.
        latex: LaTeX math mode, e.g. ``"0.3046\\,v_{\\text{I}}"``.
    """

    plain: str
    latex: str


@dataclass(frozen=True)
class Equation:
    """A worked line: sides joined by ``=``, each side a sum of terms.

    Example:
        >>> eq = Equation(((Math("c", "c"),), (Math("1·v_a", "1v_a"), Math("0·v_b", "0v_b"))))
        >>> eq.plain
        'c = 1·v_a + 0·v_b'
    """

    sides: tuple[tuple[Math, ...], ...]

    @property
    def plain(self) -> str:
        return " = ".join(" + ".join(term.plain for term in side) for side in self.sides)


@dataclass(frozen=True)
class Table:
    """A 2-D block of numbers with labelled rows and columns.

    Attributes:
        corner: the label above the row labels, e.g. ``"query \\ key"`` or ``"token"``.
        rows: one label per row (tokens, or ``e1``, ``d1``... for matrix rows).
        columns: one label per column.
        values: float array of shape (len(rows), len(columns)); masked scores are −inf.
        sums: the sum of each row (shown for attention weights), or None.
    """

    corner: str
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    values: np.ndarray
    sums: np.ndarray | None = None


@dataclass(frozen=True)
class StepView:
    """One step of the computation as a learner reads it.

    Attributes:
        name: the trace step name (``"scores"``).
        number: the step number shown (the same step has the same number in every head).
        title: the title in the seeds' words (``"Attention scores"``).
        formula: the formula, e.g. ``S = Q·Kᵀ``.
        meaning: one line on what the step means.
        table: the numbers, or None for a scalar step.
        equations: worked lines (dot products, softmax, weighted sums).
        notes: short remarks in plain text (rows left out, masked terms left out, ...).
    """

    name: str
    number: int
    title: str
    formula: Math
    meaning: str
    table: Table | None
    equations: tuple[Equation, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Section:
    """A group of steps: everything of a single-head run, or one head, or the inputs."""

    title: str | None
    steps: tuple[StepView, ...]


@dataclass(frozen=True)
class Fact:
    """A header line: ``label`` and its value in plain text and in LaTeX text mode."""

    label: str
    plain: str
    latex: str


@dataclass(frozen=True)
class Narrative:
    """Everything a renderer shows about a trace, in order.

    Attributes:
        title: the example's name, or a generic title.
        description: one or two sentences, or ``""``.
        facts: header lines (tokens, d_model, d_k, heads, scale, mask, queries shown).
        sections: the steps, grouped by head where there are several.
        precision: decimals of every number.
    """

    title: str
    description: str
    facts: tuple[Fact, ...]
    sections: tuple[Section, ...]
    precision: int = 4
