"""Name the mistake: make each common slip on purpose and see which one gives the printed numbers.

For a wrong row, every slip that can affect its step is made, from two starting points: the
numbers as printed in the earlier steps ("claimed") and the correct ones ("exact"). A slip
explains the row when every printed number is within its allowance (printed precision plus
carried rounding, computed for that slip). When several rows of a step are wrong, the slip
that explains the most of them wins (one mistake repeated is likelier than several), then the
order of :data:`~qkv.check._findings.DIAGNOSES`, then the printed starting point.
``other-weights`` is tried only for a row that no named slip explains: weights solved for
from the row itself can reproduce almost any context row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from qkv.check._compare import EPSILON, Entry, Sensitivity, matches
from qkv.check._findings import DIAGNOSES
from qkv.check._pipeline import (
    HEADS_AVERAGED,
    MASK_IGNORED,
    MASK_INVERTED,
    MISALIGNED,
    NOT_SUMMED,
    OTHER_WEIGHTS,
    SCALED_BY_DK,
    SCALED_BY_DMODEL,
    STEPS,
    SUM_NORMALISED,
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

__all__ = ["Problem", "diagnose_step", "other_weights", "slips_for"]

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
        ['query-key-swapped', 'scaled-by-dk', 'softmax-wrong-axis', 'sum-normalised',
         'unscaled', 'wrong-query']
    """
    slips: list[Slip] = []
    if _at_or_after(step, "scaled"):
        if not np.isclose(setup.factor, 1.0):
            slips.append(Slip(UNSCALED))
        if setup.d_k > 1 and not np.isclose(setup.factor, 1.0 / setup.d_k):
            slips.append(Slip(SCALED_BY_DK))
        dmodel = 1.0 / np.sqrt(max(setup.d_model, 1))
        if setup.heads > 1 and not np.isclose(setup.factor, dmodel):
            slips.append(Slip(SCALED_BY_DMODEL))
    uses = {
        "Q": ("W_q",),
        "K": ("W_k",),
        "V": ("W_v",),
        "context": ("W_q", "W_k", "W_v"),
        "products": ("W_q", "W_k", "W_v"),
        "output": ("W_q", "W_k", "W_v", "W_o"),
    }.get(step, ("W_q", "W_k"))
    square = []
    for name in uses:
        w = setup.matrix(name)
        if w is not None and w.shape[0] == w.shape[1] and not np.allclose(w, w.T):
            square.append(name)
    slips += [Slip(TRANSPOSED, weights=(name,)) for name in square]
    if len(square) > 1:
        slips.append(Slip(TRANSPOSED, weights=tuple(square)))
    if _at_or_after(step, "exp") and setup.masked:
        slips += [Slip(MASK_IGNORED), Slip(MASK_INVERTED)]
        if setup.causal and setup.lq != setup.lk:
            slips.append(Slip(MISALIGNED))
    if _at_or_after(step, "weights") and setup.lq > 1:
        slips.append(Slip(WRONG_AXIS))
    if _at_or_after(step, "weights"):
        slips.append(Slip(SUM_NORMALISED))
    if _at_or_after(step, "scores") and setup.length > 1 and setup.lq == setup.lk:
        slips.append(Slip(SWAPPED))
    if step == "context":
        pairs = [(q, t) for q in range(setup.lq)] if setup.lq == setup.lk else []
        pairs += [(t, j) for j in range(setup.lk) if j != t]
        slips += [Slip(NOT_SUMMED, row=t, query=q, key=j) for q, j in pairs]
    if setup.heads > 1 and step in ("context", "output"):
        slips.append(Slip(HEADS_AVERAGED))
    if step != "K" and step != "V" and "scores" not in setup.given:
        others = [j for j in range(setup.lq) if j != t]
        slips += [Slip(WRONG_QUERY, row=t, query=j) for j in others]
    return slips


def other_weights(
    setup: Setup, t: int, claimed: np.ndarray, values: Values, printed: Values | None
) -> list[Slip]:
    """``other-weights`` slips for a context row: the printed or correct weights rounded to
    0–3 decimals, and (when there are at most d_v + 1 keys) the one weighting (summing to
    1) whose sum of value vectors (times W_o for an output row) is the printed row, if it
    is ≥ 0."""
    if setup.heads != 1 or not setup.has_values:
        return []
    found: list[tuple[float, ...]] = []
    sources = [values["weights"][0, t]]
    if printed is not None:
        sources.insert(0, printed["weights"][0, t])
    for weights in sources:
        for decimals in range(4):
            rounded = tuple(float(w) for w in np.round(weights, decimals))
            if rounded not in found and not np.allclose(rounded, weights, rtol=0, atol=1e-12):
                found.append(rounded)
    v = values["V"]  # (Lk, Dv)
    if claimed.shape[-1] != v.shape[1]:  # an output row: Σ_j w_j·(v_j·W_o)
        w_o = setup.W_o
        if w_o is None or w_o.shape != (v.shape[1], claimed.shape[-1]):
            return [Slip(OTHER_WEIGHTS, row=t, other=w) for w in found]
        v = v @ w_o  # (Lk, E)
    a = np.vstack([v.T, np.ones((1, v.shape[0]))])  # Σ_j w_j·v_j = c and Σ_j w_j = 1
    if v.shape[0] <= v.shape[1] + 1 and np.linalg.matrix_rank(a) == v.shape[0]:
        solved, *_ = np.linalg.lstsq(a, np.concatenate([claimed, [1.0]]), rcond=None)
        like = bool(np.all(solved >= -0.005))
        if like and not np.allclose(solved, values["weights"][0, t], rtol=0, atol=5e-3):
            found.append(tuple(float(w) for w in solved))
    return [Slip(OTHER_WEIGHTS, row=t, other=w) for w in found]


@dataclass(frozen=True)
class Problem:
    """A wrong row to diagnose: its token, the printed numbers and their half units."""

    t: int
    claimed: np.ndarray
    half: np.ndarray
    slot: str = ""


def _group(candidate: Candidate, t: int) -> tuple[object, ...]:
    """Candidates that are 'the same mistake' on different rows share this key."""
    slip = candidate.slip
    if slip.code == OTHER_WEIGHTS:
        return (slip.code, candidate.start, t)
    if slip.code == NOT_SUMMED:
        one_query = slip.key == t  # the terms of one query, each labelled by its key
        return (slip.code, candidate.start, "key" if one_query else "query", slip.query)
    return (slip.code, candidate.start, slip.weights)


_ORDER = {code: k for k, code in enumerate(DIAGNOSES)}


@dataclass
class _Cache:
    """The slipped computations of one step, shared by its wrong rows."""

    step: str
    forwards: dict[tuple[Slip, str], Values] = field(default_factory=dict)
    sensitivities: dict[tuple[Slip, str], Sensitivity] = field(default_factory=dict)


def _explains(
    setup: Setup,
    slip: Slip,
    problem: Problem,
    slot: str,
    entries: Sequence[Entry],
    starts: Sequence[tuple[str, Overrides, Sensitivity, Sequence[float] | None]],
    cache: _Cache,
) -> list[Candidate]:
    """The starting points from which ``slip`` gives the printed row, as candidates."""
    found = []
    for name, base, plain_sens, ratios in starts:
        key = (slip, name)
        if key not in cache.forwards:
            cache.forwards[key] = forward(setup, slip, base)
        value = row_of(cache.forwards[key], slot, problem.t)
        plain_value = row_of(plain_sens.values, slot, problem.t)
        if np.allclose(value, plain_value, rtol=0, atol=EPSILON):
            continue  # the slip changes nothing here
        carried = plain_sens.carried(slot, problem.t, ratios)
        off = np.abs(problem.claimed - value)
        if np.any(off > problem.half + LOOSE * carried + 10 * EPSILON):
            continue
        if key not in cache.sensitivities:
            cache.sensitivities[key] = Sensitivity(setup, slip, base, entries, until=cache.step)
        close = cache.sensitivities[key].carried(slot, problem.t, ratios)
        if matches(problem.claimed, value, problem.half, close):
            found.append(Candidate(slip, name, value, cache.forwards[key]))
    return found


def diagnose_step(
    setup: Setup,
    step: str,
    problems: Sequence[Problem],
    entries: Sequence[Entry],
    starts: Sequence[tuple[str, Overrides, Sensitivity, Sequence[float] | None]],
) -> dict[tuple[int, str], Candidate | None]:
    """The slip that explains each wrong row of one step, or None (an arithmetic mistake).

    Args:
        setup: the example.
        step: the step whose rows are wrong.
        problems: the wrong rows.
        entries: every claimed number (their roundings carry into the slips' allowances).
        starts: the starting points: (name, rows put in, the correct computation's
            :class:`Sensitivity` from there, the ratios of its entries).

    Returns:
        (token, slot) → the chosen candidate, or None where no slip reproduces the row.
    """
    cache = _Cache(step)
    found: dict[tuple[int, str], list[Candidate]] = {}
    for problem in problems:
        slot = problem.slot or step
        where = (problem.t, slot)
        found[where] = []
        for slip in slips_for(setup, step, problem.t):
            found[where] += _explains(setup, slip, problem, slot, entries, starts, cache)
        if not found[where] and step in ("context", "output") and slot == step:
            # other weights can be solved for from almost any context row: only a last resort
            printed = next((b for n, b, *_ in starts if n == "claimed"), None)
            printed_values = None if printed is None else forward(setup, None, printed)
            plain = starts[-1][2].values
            others = other_weights(setup, problem.t, problem.claimed, plain, printed_values)
            for slip in others:
                found[where] += _explains(setup, slip, problem, slot, entries, starts, cache)
    counts: dict[tuple[object, ...], int] = {}
    for (t, _), candidates in found.items():
        for group in {_group(c, t) for c in candidates}:
            counts[group] = counts.get(group, 0) + 1
    start_order = {name: k for k, (name, *_) in enumerate(starts)}
    chosen: dict[tuple[int, str], Candidate | None] = {}
    for (t, slot), candidates in found.items():
        chosen[t, slot] = min(
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
