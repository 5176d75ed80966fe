"""Name the mistake: make each common slip on purpose and see which one gives the printed numbers.

For a wrong row, every slip that can affect its step is made, from two starting points: the
numbers as printed in the earlier steps ("claimed") and the correct ones ("exact"). A slip
explains the row when every printed number is within its allowance (printed precision plus
carried rounding, computed for that slip). When several rows of a step are wrong, the slip
that explains the most of them wins (one mistake repeated is likelier than several), then the
order of :data:`~qkv.check._findings.DIAGNOSES`, then the printed starting point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qkv.check._compare import EPSILON, Entry, Sensitivity, matches
from qkv.check._findings import DIAGNOSES
from qkv.check._pipeline import (
    NOT_SUMMED,
    SCALED_BY_DK,
    STEPS,
    SWAPPED,
    TRANSPOSED,
    UNSCALED,
    WRONG_AXIS,
    WRONG_QUERY,
    Candidate,
    Overrides,
    Setup,
    Slip,
    Values,
    forward,
    row_of,
)

__all__ = ["Problem", "diagnose_step", "slips_for"]

LOOSE = 10.0
"""A slip is checked closely only when it is within this many carried roundings (a cheap
screen: the carried rounding of a slip differs from that of the correct computation, by
about √d_k at most for ``unscaled``)."""


def _at_or_after(step: str, first: str) -> bool:
    return STEPS.index(step) >= STEPS.index(first)


def slips_for(setup: Setup, step: str, t: int) -> list[Slip]:
    """The slips that can change the row of token ``t`` in ``step``, in the order tried.

    Example:
        >>> from qkv.examples import builtin
        >>> setup = Setup.of(builtin("i-love-statistics"))
        >>> sorted({s.code for s in slips_for(setup, "weights", 1)})
        ['query-key-swapped', 'scaled-by-dk', 'softmax-wrong-axis', 'unscaled', 'wrong-query']
    """
    slips: list[Slip] = []
    if _at_or_after(step, "scaled"):
        if not np.isclose(setup.factor, 1.0):
            slips.append(Slip(UNSCALED))
        if setup.d_k > 1 and not np.isclose(setup.factor, 1.0 / setup.d_k):
            slips.append(Slip(SCALED_BY_DK))
    uses = {
        "Q": ("W_q",),
        "K": ("W_k",),
        "V": ("W_v",),
        "scores": ("W_q", "W_k"),
        "scaled": ("W_q", "W_k"),
        "weights": ("W_q", "W_k"),
        "context": ("W_q", "W_k", "W_v"),
        "output": ("W_q", "W_k", "W_v", "W_o"),
    }[step]
    square = []
    for name in uses:
        w = setup.matrix(name)
        if w is not None and w.shape[0] == w.shape[1] and not np.allclose(w, w.T):
            square.append(name)
    slips += [Slip(TRANSPOSED, weights=(name,)) for name in square]
    if len(square) > 1:
        slips.append(Slip(TRANSPOSED, weights=tuple(square)))
    if _at_or_after(step, "weights") and setup.length > 1:
        slips.append(Slip(WRONG_AXIS))
    if _at_or_after(step, "scores") and setup.length > 1:
        slips.append(Slip(SWAPPED))
    if step == "context":
        pairs = [(q, t) for q in range(setup.length)]
        pairs += [(t, j) for j in range(setup.length) if j != t]
        slips += [Slip(NOT_SUMMED, row=t, query=q, key=j) for q, j in pairs]
    if step != "K" and step != "V":
        others = [j for j in range(setup.length) if j != t]
        slips += [Slip(WRONG_QUERY, row=t, query=j) for j in others]
    return slips


@dataclass(frozen=True)
class Problem:
    """A wrong row to diagnose: its token, the printed numbers and their half units."""

    t: int
    claimed: np.ndarray
    half: np.ndarray


def _group(candidate: Candidate, t: int) -> tuple[object, ...]:
    """Candidates that are 'the same mistake' on different rows share this key."""
    slip = candidate.slip
    if slip.code == NOT_SUMMED:
        one_query = slip.key == t  # the terms of one query, each labelled by its key
        return (slip.code, candidate.start, "key" if one_query else "query", slip.query)
    return (slip.code, candidate.start, slip.weights)


_ORDER = {code: k for k, code in enumerate(DIAGNOSES)}


def diagnose_step(
    setup: Setup,
    step: str,
    problems: Sequence[Problem],
    entries: Sequence[Entry],
    starts: Sequence[tuple[str, Overrides, Sensitivity, Sequence[float] | None]],
) -> dict[int, Candidate | None]:
    """The slip that explains each wrong row of one step, or None (an arithmetic mistake).

    Args:
        setup: the example.
        step: the step whose rows are wrong.
        problems: the wrong rows.
        entries: every claimed number (their roundings carry into the slips' allowances).
        starts: the starting points: (name, rows put in, the correct computation's
            :class:`Sensitivity` from there, the ratios of its entries).

    Returns:
        token → the chosen candidate, or None where no slip reproduces the row.
    """
    forwards: dict[tuple[Slip, str], Values] = {}
    sensitivities: dict[tuple[Slip, str], Sensitivity] = {}
    found: dict[int, list[Candidate]] = {}
    for problem in problems:
        found[problem.t] = []
        for slip in slips_for(setup, step, problem.t):
            for name, base, plain, ratios in starts:
                key = (slip, name)
                if key not in forwards:
                    forwards[key] = forward(setup, slip, base)
                value = row_of(forwards[key], step, problem.t)
                plain_value = row_of(plain.values, step, problem.t)
                if np.allclose(value, plain_value, rtol=0, atol=EPSILON):
                    continue  # the slip changes nothing here
                carried = plain.carried(step, problem.t, ratios)
                off = np.abs(problem.claimed - value)
                if np.any(off > problem.half + LOOSE * carried + 10 * EPSILON):
                    continue
                if key not in sensitivities:
                    sensitivities[key] = Sensitivity(setup, slip, base, entries, until=step)
                close = sensitivities[key].carried(step, problem.t, ratios)
                if matches(problem.claimed, value, problem.half, close):
                    found[problem.t].append(Candidate(slip, name, value, forwards[key]))
    counts: dict[tuple[object, ...], int] = {}
    for t, candidates in found.items():
        for group in {_group(c, t) for c in candidates}:
            counts[group] = counts.get(group, 0) + 1
    start_order = {name: k for k, (name, *_) in enumerate(starts)}
    chosen: dict[int, Candidate | None] = {}
    for t, candidates in found.items():
        chosen[t] = min(
            candidates,
            key=lambda c: (
                -counts[_group(c, t)],
                _ORDER[c.slip.code],
                len(c.slip.weights),
                start_order[c.start],
            ),
            default=None,
        )
    return chosen
