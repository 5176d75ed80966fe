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

from qkv.check._compare import (
    ROUNDING,
    WRONG,
    Entry,
    Sensitivity,
    allowance,
    grade,
    half_units,
    input_effect,
    matches,
)
from qkv.check._diagnose import Problem, diagnose_step
from qkv.check._float_error import UNIT_ROUNDOFF, float_error
from qkv.check._pipeline import (
    STEPS,
    Candidate,
    Overrides,
    Setup,
    Values,
    correct_values,
    forward,
    row_of,
    step_of,
)
from qkv.check._policy import (
    MASKED_BELOW,
    digit_slip,
    exact_halves,
    exp_variant,
    mask_pattern,
    not_softmax,
)
from qkv.check._report import Finding, Report
from qkv.check._slip_words import SlipWords
from qkv.check._tiled_check import check_tiled
from qkv.examples import Claimed, Example, resolve
from qkv.examples._model import decimals_of

__all__ = ["check"]


@dataclass
class _Row:
    """One claimed row while it is being judged (``slot``: the step, or ``step@head``)."""

    step: str
    t: int
    slot: str
    head: int | None
    claimed: Claimed
    values: np.ndarray
    half: np.ndarray
    correct: np.ndarray
    decimals: int
    carry: np.ndarray | None = None
    masked: np.ndarray | None = None
    masked_ok: np.ndarray | None = None
    band: np.ndarray | None = None
    zero_sum: bool = False  # weights whose own printed exponentials sum to 0 (see _normalised)
    float_band: np.ndarray | None = None  # no dtype: float32 rounding, a note (see _apply_policy)
    float_notes: tuple[bool, ...] = ()  # the numbers noted only for float32 rounding
    marks: tuple[str, ...] = ()
    status: str = ""
    diagnosis: str | None = None
    message: str = ""
    cause: tuple[str, int] | None = None


def _feeds(source: _Row, step: str, t: int, allowed: np.ndarray) -> bool:
    """Whether the row ``source`` is an input (directly or not) of the row of ``t`` in ``step``."""
    if STEPS.index(source.step) >= STEPS.index(step):
        return False
    if source.step == "V" and step in ("scores", "scaled", "exp", "exp_sum", "weights"):
        return False
    if source.step in ("K", "V"):
        return bool(allowed[t, source.t])
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
    # Slips and finite inputs may overflow on the way: the findings (or the reference's one
    # error line) say so, never a NumPy RuntimeWarning printed before them.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _check(example)


def _check(example: Example) -> Report:
    setup = Setup.of(example)
    correct = correct_values(example)
    assumed = _assumed(example)
    rows = _claimed_rows(example, setup, correct, assumed)
    entries = [
        Entry(row.slot, row.t, i, float(h))
        for row in rows
        for i, h in enumerate(row.half if row.carry is None else row.carry)
    ]
    offsets = {id(row): sum(len(r.half) for r in rows[:k]) for k, row in enumerate(rows)}
    ratios = [1.0] * len(entries)
    exact = Sensitivity(setup, None, assumed, entries)
    claimed_steps = [s for s in STEPS if any(r.step == s for r in rows)]
    words = SlipWords(
        example.tokens, setup, example.scale, correct, claimed_steps, example.queries_named
    )
    for step in STEPS:
        here = [row for row in rows if row.step == step]
        if not here:
            continue
        for row in here:
            carried = exact.carried(row.slot, row.t, ratios)
            row.marks = grade(row.values, row.correct, row.half, carried, row.band)
            if row.float_band is not None and ROUNDING in row.marks:
                assert row.band is not None
                plain = grade(row.values, row.correct, row.half, carried, row.band - row.float_band)
                row.float_notes = tuple(
                    p == WRONG and m == ROUNDING for p, m in zip(plain, row.marks, strict=True)
                )
            row.marks = _normalised(row)
            for i, mark in enumerate(row.marks):  # how far later steps may carry this number
                if mark != WRONG and row.half[i] > 0:
                    off = abs(row.values[i] - row.correct[i]) / row.half[i]
                    ratios[offsets[id(row)] + i] = max(1.0, float(off))
            if WRONG not in row.marks:
                _settle(row, words)
        pending = [row for row in here if not row.status]
        if pending:
            _judge(setup, step, pending, rows, entries, exact, ratios, words, assumed)
    tiled = check_tiled(example, setup, correct)
    return Report(
        name=example.name,
        source=_source(example),
        tokens=tuple(example.tokens),
        findings=(*(_finding(row, example) for row in rows), *tiled),
        query_tokens=example.query_tokens,
    )


def _assumed(example: Example) -> dict[str, dict[int, np.ndarray]]:
    return {
        step: {t: np.asarray(c.values, dtype=np.float64) for t, c in rows.items()}
        for step, rows in example.assumed.items()
    }


def _claimed_rows(
    example: Example, setup: Setup, correct: Values, assumed: Overrides
) -> list[_Row]:
    claims: list[tuple[str, int | None, int, Claimed]] = []
    for step in STEPS:
        for t, claimed in sorted(example.claimed.get(step, {}).items()):
            claims.append((step, None, t, claimed))
        for h, by_step in enumerate(example.head_claimed):
            for t, claimed in sorted(by_step.get(step, {}).items()):
                claims.append((step, h, t, claimed))
    effect = input_effect(setup, rounding=False)
    declared = float_error(setup, setup.dtype) if setup.dtype in UNIT_ROUNDOFF else None
    auto = float_error(setup, "float32") if setup.dtype is None else None
    allowed = setup.allowed()
    rows: list[_Row] = []
    printed: Values | None = None
    printed_step = ""
    for step, head, t, claimed in claims:
        slot = step if head is None else f"{step}@{head}"
        decimals = claimed.decimals()
        values = np.asarray(claimed.values, dtype=np.float64)
        right = np.array(row_of(correct, slot, t), dtype=np.float64)
        half = half_units(decimals)
        row = _Row(
            step=step,
            t=t,
            slot=slot,
            head=head,
            claimed=claimed,
            values=values,
            half=half,
            correct=right,
            decimals=min(max(max(decimals, default=0), 2), 8),
        )
        if printed_step != step:  # the step computed from the rows printed before it
            base: dict[str, dict[int, np.ndarray]] = {k: dict(v) for k, v in assumed.items()}
            for r in rows:
                base.setdefault(r.slot, {})[r.t] = r.values
            printed, printed_step = forward(setup, None, base), step
        _apply_policy(row, correct, printed, effect, allowed, auto, declared)
        rows.append(row)
    return rows


def _apply_policy(
    row: _Row,
    correct: Values,
    printed: Values | None,
    effect: Values | None,
    allowed: np.ndarray,
    auto: Values | None = None,
    declared: Values | None = None,
) -> None:
    """Masked scores, the variant of the exponentials, and the precision policy (both
    formats): a whole number that the exact inputs make whole leaves no doubt; with no
    ``dtype:``, a number off only by the rounding of a float32 computation (``auto``) is a
    rounding note; with ``dtype: float32`` (``declared``), a number within the rounding of
    float32 of the exact value is that value, printed by float code."""
    if row.step in ("scores", "scaled"):
        masked = ~np.isfinite(row.values) | (row.values <= MASKED_BELOW)
        if masked.any():
            row.masked = masked
            ok = masked & ~allowed[row.t]
            row.masked_ok = ok
            row.values = np.where(ok, 0.0, row.values)  # masked as it must be: compared as equal
            row.correct = np.where(ok, 0.0, row.correct)
            row.half = np.where(masked, 0.0, row.half)
    if row.step in ("exp", "exp_sum"):
        scaled = row_of(correct, "scaled" if row.head is None else f"scaled@{row.head}", row.t)
        scaled = np.where(allowed[row.t], scaled, -np.inf)
        row.correct = exp_variant(row.values, row.correct, scaled)
    if row.step == "weights" and printed is not None and allowed[row.t].any():
        total = row_of(printed, row.slot.replace("weights", "exp_sum"), row.t)
        row.zero_sum = bool(np.all(total == 0))
    from_printed = None if printed is None else row_of(printed, row.slot, row.t)
    doubt = None if effect is None else row_of(effect, row.slot, row.t)
    row.band = np.array(
        [0.0 if decimals_of(t) == 0 else 0.5 * 10.0 ** -decimals_of(t) for t in row.claimed.texts]
    )
    rounding = None if declared is None else row_of(declared, row.slot, row.t)
    row.half, row.carry = exact_halves(
        row.values, row.claimed.texts, row.correct, from_printed, row.half, doubt, rounding
    )
    if auto is not None:
        row.float_band = np.nan_to_num(np.asarray(row_of(auto, row.slot, row.t)), posinf=0.0)
        row.band = row.band + row.float_band


def _settle(row: _Row, words: SlipWords) -> None:
    """A row with no wrong number: ok, or a rounding note."""
    if ROUNDING in row.marks:
        row.status, row.diagnosis = "note", "rounding"
        if any(row.float_notes):
            row.message = words.float_rounding(row.claimed.texts, row.correct, row.float_notes)
        else:
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
    words: SlipWords,
    assumed: Overrides,
) -> None:
    """Consequential or a mistake of its own (with a diagnosis), for the wrong rows of a step."""
    base: dict[str, dict[int, np.ndarray]] = {k: dict(v) for k, v in assumed.items()}
    for row in rows:
        if STEPS.index(row.step) < STEPS.index(step):
            base.setdefault(row.slot, {})[row.t] = row.values
    starts: list[tuple[str, Overrides, Sensitivity, Sequence[float] | None]] = []
    printed: Sensitivity | None = None
    if any(step_of(k) not in assumed for k in base):
        printed = Sensitivity(setup, None, base, entries, until=step)
        starts.append(("claimed", base, printed, None))
    starts.append(("exact", assumed, exact, ratios))
    allowed = setup.allowed()

    mistakes = []
    for row in pending:
        causes = [
            source
            for source in rows
            if source.status in ("mismatch", "consequential")
            and _feeds(source, step, row.t, allowed)
        ]
        if printed is not None and causes:
            value = row_of(printed.values, row.slot, row.t)
            if matches(row.values, value, row.half, printed.carried(row.slot, row.t)):
                row.status = "consequential"
                roots = [c for c in causes if c.status == "mismatch"]
                if not roots:
                    roots = [c for c in rows if (c.step, c.t) in {s.cause for s in causes}]
                row.cause = roots[0].step, roots[0].t
                row.message = (
                    words.consequential(
                        row.slot, [(c.step, c.t) for c in roots], value, row.decimals
                    )
                    + " "
                    + words.correct_line(row.slot, row.t, row.decimals)
                )
                continue
        mistakes.append(row)
    if not mistakes:
        return
    problems = [Problem(row.t, row.values, row.half, row.slot) for row in mistakes]
    chosen = diagnose_step(setup, step, problems, entries, starts)
    for row in mistakes:
        row.status = "mismatch"
        if row.zero_sum:
            row.diagnosis = ROUNDED_TO_ZERO
            largest = float(
                np.max(row_of(words.correct, row.slot.replace("weights", "exp"), row.t))
            )
            row.message = (
                f"{words.rounded_to_zero(row.t, largest)} "
                f"{words.correct_line(row.slot, row.t, row.decimals)}"
            )
            continue
        candidate = chosen[row.t, row.slot]
        row.diagnosis = "arithmetic" if candidate is None else candidate.slip.code
        if candidate is None:
            message = _look_at_row(row, setup, printed, words)
            if message:
                row.message = message
                continue
        row.message = _mistake_message(row, candidate, printed, words)


ROUNDED_TO_ZERO = "exps-rounded-to-zero"


def _normalised(row: _Row) -> tuple[str, ...]:
    """The marks of a row, with weights that cannot follow from the row's own printed
    exponentials marked wrong when those sum to 0: rounded numbers carried from earlier steps
    may move each weight by their allowance, which has no bound near a sum of 0."""
    if not row.zero_sum:
        return row.marks
    slack = row.half + (0.0 if row.band is None else row.band)  # a rounding note at most
    off = np.abs(row.values - row.correct) > slack + 1e-12
    return tuple(WRONG if o else m for o, m in zip(off, row.marks, strict=True))


def _look_at_row(
    row: _Row, setup: Setup, printed: Sensitivity | None, words: SlipWords
) -> str | None:
    """The slips seen in the printed row itself: masked scores at the wrong keys, one digit
    wrong with the rest right, and (format 2) weights out of the order of their scores.
    Sets the diagnosis."""
    p = row.decimals
    if row.masked is not None:
        code = mask_pattern(setup, row.t, row.masked)
        if code is not None:
            row.diagnosis = code
            return f"{words.mask_slip(code, row.t)} {words.correct_line(row.slot, row.t, p)}"
    refs: list[tuple[np.ndarray, list[int]]] = []
    wrong = [i for i, mark in enumerate(row.marks) if mark == WRONG]
    if all(mark == "ok" for i, mark in enumerate(row.marks) if i not in wrong):
        refs.append((row.correct, wrong))
    if printed is not None:  # a slip in a number computed from the printed ones
        value = row_of(printed.values, row.slot, row.t)
        near = allowance(row.half, printed.carried(row.slot, row.t), value)
        off = np.abs(row.values - value) > near  # the rest of the row is right
        refs.append((value, [int(i) for i in np.flatnonzero(off)]))
    for ref, bad in refs:
        if len(bad) != 1 or len(row.marks) < 2 or not np.isfinite(ref[bad[0]]):
            continue
        i = bad[0]
        right = digit_slip(row.claimed.texts[i], float(ref[i]))
        if right is not None:
            row.diagnosis = "digit-slip"
            said = words.digit_slip(row.claimed.texts[i], right, i, row.step)
            return f"{said} {words.correct_line(row.slot, row.t, p)}"
    if row.step == "weights" and setup.names_not_softmax:
        scaled_slot = row.slot.replace("weights", "scaled")
        candidates = [row_of(words.correct, scaled_slot, row.t)]
        if printed is not None:
            candidates.insert(0, row_of(printed.values, scaled_slot, row.t))
        pair = not_softmax(row.values, candidates, setup.allowed()[row.t], row.half)
        if pair is not None:
            row.diagnosis = "not-softmax"
            said = words.not_softmax(row.t, pair, candidates[0], row.values, printed is not None)
            return f"{said} {words.correct_line(row.slot, row.t, p)}"
    return None


def _mistake_message(
    row: _Row, candidate: Candidate | None, printed: Sensitivity | None, words: SlipWords
) -> str:
    p = row.decimals
    if candidate is not None:
        said = words.slip(row.slot, row.t, candidate, p)
        return f"{said} {words.correct_line(row.slot, row.t, p)}"
    parts = [words.arithmetic(row.step, row.claimed.texts, row.correct, row.marks, p)]
    if printed is not None and words.printed_inputs(row.step):
        value = row_of(printed.values, row.slot, row.t)
        finite = np.isfinite(value) & np.isfinite(row.correct)
        if not np.allclose(
            value[finite], row.correct[finite], rtol=0, atol=float(np.min(row.half, initial=1))
        ):
            parts.append(words.not_from_printed(row.step, value, p))
    if row.step == "weights":
        parts.append(words.weights_sum(row.values, row.half, p))
    parts.append(words.correct_line(row.slot, row.t, p))
    return " ".join(part for part in parts if part)


def _source(example: Example) -> str | None:
    if example.slug:
        return f"built-in {example.slug}"
    return example.source


def _finding(row: _Row, example: Example) -> Finding:
    tokens = example.tokens if row.step in ("K", "V") else example.queries_named
    return Finding(
        step=row.step,
        token=tokens[row.t],
        position=row.t,
        claimed=tuple(
            float(v if m is None or not m else c)
            for v, c, m in zip(
                row.values,
                row.claimed.values,
                [None] * len(row.values) if row.masked is None else row.masked,
                strict=True,
            )
        ),
        printed=tuple(row.claimed.texts),
        expected=tuple(
            float(v)
            for v in (
                row.correct
                if row.masked_ok is None
                else np.where(row.masked_ok, -np.inf, row.correct)
            )
        ),
        status=row.status,
        diagnosis=row.diagnosis,
        message=row.message,
        marks=row.marks,
        line=row.claimed.line,
        cause=row.cause,
        decimals=row.decimals,
        head=row.head,
    )
