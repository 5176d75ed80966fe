"""The check itself: every claimed row, in the order of computation, against the correct one.

For each claimed row (step by step: Q, K, V, scores, scaled, weights, context, output):

1. **ok** when every number is within its allowance of the correct value: half a unit of its
   last printed digit, widened by the rounding carried from the claimed numbers before it.
2. **note** (``rounding``) when no number is further off than one unit of its last digit.
3. **consequential** when the step, recomputed from the numbers *printed* before it, gives the
   printed row, and a wrong row feeds it: the step was done right on wrong input.
4. **mismatch** otherwise: the row holds a mistake of its own, named by the slip that
   reproduces it (``unscaled``, ``context-not-summed``, ...) or ``arithmetic``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qkv.check._compare import ROUNDING, WRONG, Entry, Sensitivity, grade, half_units, matches
from qkv.check._diagnose import Problem, diagnose_step
from qkv.check._pipeline import (
    STEPS,
    Candidate,
    Overrides,
    Setup,
    Values,
    correct_values,
    row_of,
)
from qkv.check._report import Finding, Report
from qkv.check._words import Words
from qkv.examples import Claimed, Example, resolve

__all__ = ["check"]


@dataclass
class _Row:
    """One claimed row while it is being judged."""

    step: str
    t: int
    claimed: Claimed
    values: np.ndarray
    half: np.ndarray
    correct: np.ndarray
    decimals: int
    marks: tuple[str, ...] = ()
    status: str = ""
    diagnosis: str | None = None
    message: str = ""
    cause: tuple[str, int] | None = None


def _feeds(source: _Row, step: str, t: int, causal: bool) -> bool:
    """Whether the row ``source`` is an input (directly or not) of the row of ``t`` in ``step``."""
    if STEPS.index(source.step) >= STEPS.index(step):
        return False
    if source.step == "V" and step in ("scores", "scaled", "weights"):
        return False
    if source.step in ("K", "V"):
        return not causal or source.t <= t
    return source.t == t


def check(example: Example | str | os.PathLike[str]) -> Report:
    """Compare every claimed row of a worked example with the correct one, and name mistakes.

    Args:
        example: an :class:`~qkv.examples.Example`, a built-in name or the path of an
            example file.

    Returns:
        A :class:`Report` with one finding per claimed row, in the order of computation.

    Raises:
        ExampleError: a name or file that is no usable example.

    Example:
        >>> report = check("i-love-statistics")
        >>> report.ok, report.first_wrong.step, report.first_wrong.token
        (False, 'Q', 'love')
        >>> [(f.step, f.token, f.diagnosis) for f in report.findings][-1]
        ('context', 'statistics', 'context-not-summed')
    """
    if not isinstance(example, Example):
        example = resolve(example)
    setup = Setup.of(example)
    correct = correct_values(example)
    rows = _claimed_rows(example, correct)
    entries = [Entry(row.step, row.t, i, float(h)) for row in rows for i, h in enumerate(row.half)]
    offsets = {id(row): sum(len(r.half) for r in rows[:k]) for k, row in enumerate(rows)}
    ratios = [1.0] * len(entries)
    exact = Sensitivity(setup, None, {}, entries)
    words = Words(
        example.tokens, setup, example.scale, correct, [s for s in STEPS if example.claimed.get(s)]
    )
    for step in STEPS:
        here = [row for row in rows if row.step == step]
        if not here:
            continue
        for row in here:
            carried = exact.carried(step, row.t, ratios)
            row.marks = grade(row.values, row.correct, row.half, carried)
            for i, mark in enumerate(row.marks):  # how far later steps may carry this number
                if mark != WRONG:
                    off = abs(row.values[i] - row.correct[i]) / row.half[i]
                    ratios[offsets[id(row)] + i] = max(1.0, float(off))
            if WRONG not in row.marks:
                _settle(row, words)
        pending = [row for row in here if not row.status]
        if pending:
            _judge(setup, step, pending, rows, entries, exact, ratios, words)
    return Report(
        name=example.name,
        source=_source(example),
        tokens=tuple(example.tokens),
        findings=tuple(_finding(row, example.tokens) for row in rows),
    )


def _claimed_rows(example: Example, correct: Values) -> list[_Row]:
    rows = []
    for step in STEPS:
        for t, claimed in sorted(example.claimed.get(step, {}).items()):
            decimals = claimed.decimals()
            rows.append(
                _Row(
                    step=step,
                    t=t,
                    claimed=claimed,
                    values=np.asarray(claimed.values, dtype=np.float64),
                    half=half_units(decimals),
                    correct=row_of(correct, step, t),
                    decimals=min(max(max(decimals, default=0), 2), 8),
                )
            )
    return rows


def _settle(row: _Row, words: Words) -> None:
    """A row with no wrong number: ok, or a rounding note."""
    if ROUNDING in row.marks:
        row.status, row.diagnosis = "note", "rounding"
        row.message = words.rounding(row.claimed.texts, row.correct, row.marks)
    else:
        row.status = "ok"
        row.message = words.correct_line(row.step, row.t, row.decimals)


def _judge(
    setup: Setup,
    step: str,
    pending: list[_Row],
    rows: Sequence[_Row],
    entries: Sequence[Entry],
    exact: Sensitivity,
    ratios: Sequence[float],
    words: Words,
) -> None:
    """Consequential or a mistake of its own (with a diagnosis), for the wrong rows of a step."""
    base: dict[str, dict[int, np.ndarray]] = {}
    for row in rows:
        if STEPS.index(row.step) < STEPS.index(step):
            base.setdefault(row.step, {})[row.t] = row.values
    starts: list[tuple[str, Overrides, Sensitivity, Sequence[float] | None]] = []
    printed: Sensitivity | None = None
    if base:
        printed = Sensitivity(setup, None, base, entries, until=step)
        starts.append(("claimed", base, printed, None))
    starts.append(("exact", {}, exact, ratios))

    mistakes = []
    for row in pending:
        causes = [
            source
            for source in rows
            if source.status in ("mismatch", "consequential")
            and _feeds(source, step, row.t, setup.causal)
        ]
        if printed is not None and causes:
            value = row_of(printed.values, step, row.t)
            if matches(row.values, value, row.half, printed.carried(step, row.t)):
                row.status = "consequential"
                roots = [c for c in causes if c.status == "mismatch"]
                if not roots:
                    roots = [c for c in rows if (c.step, c.t) in {s.cause for s in causes}]
                row.cause = roots[0].step, roots[0].t
                row.message = (
                    words.consequential(step, [(c.step, c.t) for c in roots], value, row.decimals)
                    + " "
                    + words.correct_line(step, row.t, row.decimals)
                )
                continue
        mistakes.append(row)
    if not mistakes:
        return
    problems = [Problem(row.t, row.values, row.half) for row in mistakes]
    chosen = diagnose_step(setup, step, problems, entries, starts)
    for row in mistakes:
        row.status = "mismatch"
        candidate = chosen[row.t]
        row.diagnosis = "arithmetic" if candidate is None else candidate.slip.code
        row.message = _mistake_message(row, candidate, printed, words)


def _mistake_message(
    row: _Row, candidate: Candidate | None, printed: Sensitivity | None, words: Words
) -> str:
    p = row.decimals
    if candidate is not None:
        said = words.slip(row.step, row.t, candidate, p)
        return f"{said} {words.correct_line(row.step, row.t, p)}"
    parts = [words.arithmetic(row.step, row.claimed.texts, row.correct, row.marks, p)]
    if printed is not None and words.printed_inputs(row.step):
        value = row_of(printed.values, row.step, row.t)
        if not np.allclose(value, row.correct, rtol=0, atol=float(np.min(row.half))):
            parts.append(words.not_from_printed(row.step, value, p))
    if row.step == "weights":
        parts.append(words.weights_sum(row.values, row.half, p))
    parts.append(words.correct_line(row.step, row.t, p))
    return " ".join(part for part in parts if part)


def _source(example: Example) -> str | None:
    if example.slug:
        return f"built-in {example.slug}"
    return example.source


def _finding(row: _Row, tokens: Sequence[str]) -> Finding:
    return Finding(
        step=row.step,
        token=tokens[row.t],
        position=row.t,
        claimed=tuple(float(v) for v in row.values),
        printed=tuple(row.claimed.texts),
        expected=tuple(float(v) for v in row.correct),
        status=row.status,
        diagnosis=row.diagnosis,
        message=row.message,
        marks=row.marks,
        line=row.claimed.line,
        cause=row.cause,
        decimals=row.decimals,
    )
