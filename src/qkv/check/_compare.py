"""Printed precision and carried rounding: how far a claimed number may be from a computed one.

A number printed with n decimals stands for anything within half a unit of its last digit:
``0.50`` for [0.495, 0.505]. An author who computes the scores from a query printed as
``[0.50, 0.80]`` carries that rounding forward, so the allowance of a later step is widened by
how much the earlier printed roundings can move it:

    tolerance = ½·10⁻ⁿ  +  SAFETY · Σ_u r_u · |Δ_u|

where u runs over the claimed numbers of earlier steps, Δ_u is the change of this number when
u moves by its own half unit (measured by recomputing, the larger of +½ and −½), and r_u is 1,
or more for an earlier number that is itself off by a rounding (so what follows it honestly is
not blamed). SAFETY covers the second-order terms (two roundings multiplied).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qkv.check._float_error import UNIT_ROUNDOFF, float_error
from qkv.check._pipeline import (
    STEPS,
    Overrides,
    Setup,
    Slip,
    Values,
    forward,
    index_of,
    row_of,
    slot_head,
    step_of,
)

__all__ = ["Entry", "Sensitivity", "allowance", "grade", "half_units", "input_effect", "matches"]

SAFETY = 1.5
"""Carried rounding is a first-order estimate; this factor covers products of two roundings."""
EPSILON = 1e-9
"""Floating-point noise: a computed number is exact to about this."""

OK = "ok"
ROUNDING = "rounding"
WRONG = "wrong"


def half_units(decimals: Sequence[int]) -> np.ndarray:
    """Half a unit of the last printed digit: 2 decimals → 0.005.

    Example:
        >>> half_units([2, 4, 0]).tolist()
        [0.005, 5e-05, 0.5]
    """
    return 0.5 * 10.0 ** -np.asarray(decimals, dtype=np.float64)


@dataclass(frozen=True)
class Entry:
    """One claimed number: its slot (step, or ``step@head``), token, place in the row and
    half unit (0 for a number that leaves no doubt: it is not moved)."""

    step: str
    row: int
    index: int
    half: float


def _with(overrides: Overrides, step: str, row: int, values: np.ndarray) -> Overrides:
    merged = {name: dict(rows) for name, rows in overrides.items()}
    merged.setdefault(step, {})[row] = values
    return merged


class Sensitivity:
    """How much each claimed number's rounding moves every later step, for one computation.

    The computation is :func:`~qkv.check._pipeline.forward` with a slip (or none) and base
    overrides (none: the correct numbers; the claimed rows: "from what was printed").

    Args:
        setup: the example.
        slip: the slip of the computation, or None.
        base: the rows put in (step → token → row).
        entries: every claimed number of the example.
        until: only numbers of steps before this one matter (default: all).
    """

    def __init__(
        self,
        setup: Setup,
        slip: Slip | None,
        base: Overrides,
        entries: Sequence[Entry],
        until: str | None = None,
    ) -> None:
        self.values: Values = forward(setup, slip, base)
        self.entries = tuple(entries)
        stop = len(STEPS) if until is None else STEPS.index(until)
        self._heads = int(self.values["scores"].shape[0])
        self._effect = input_effect(setup)
        # step → (entries, *shape of the step): how much each entry's half unit moves it.
        self._stack = {
            name: np.zeros((len(self.entries), *v.shape)) for name, v in self.values.items()
        }
        for k, entry in enumerate(self.entries):
            first = STEPS.index(step_of(entry.step))
            if first >= stop or entry.half == 0:
                continue
            row = np.array(row_of(self.values, entry.step, entry.row), dtype=np.float64)
            if not np.isfinite(row[entry.index]):
                continue
            for sign in (1.0, -1.0):
                moved = row.copy()
                moved[entry.index] += sign * entry.half
                values = forward(setup, slip, _with(base, entry.step, entry.row, moved))
                for name in STEPS[first + 1 : stop + 1]:
                    change = _change(values[name], self.values[name])
                    np.maximum(self._stack[name][k], change, out=self._stack[name][k])

    def carried(self, step: str, t: int, ratios: Sequence[float] | None = None) -> np.ndarray:
        """The carried rounding of each number in the row of token ``t`` of ``step``.

        Args:
            step: the step of the row (before ``until``, or ``until`` itself).
            t: the token.
            ratios: per entry, how many half units it may be off (default 1 each).
        """
        name = step_of(step)
        where = index_of(self._stack[name].shape[1:], name, slot_head(step), t, self._heads)
        rows = self._stack[name][(slice(None), *where)]  # (entries, n)
        weights = np.ones(len(self.entries)) if ratios is None else np.asarray(ratios, dtype=float)
        carried: np.ndarray = SAFETY * (weights @ rows)
        if self._effect is not None:
            carried = carried + self._effect[name][where]
        return carried


def _change(moved: np.ndarray, base: np.ndarray) -> np.ndarray:
    """|moved − base|, 0 where both are the same infinity (a masked score stays masked)."""
    with np.errstate(invalid="ignore"):
        change = np.abs(moved - base)
    clean: np.ndarray = np.nan_to_num(change, nan=0.0, posinf=0.0)
    return clean


_EFFECTS: dict[tuple[int, bool], tuple[Setup, Values | None]] = {}


def input_effect(setup: Setup, *, rounding: bool = True) -> Values | None:
    """How far the inputs printed rounded (``precision:``) and the rounding of the format the
    example says it computed in (``dtype: float32``, ...) can move every step, or None.

    Each input number is moved by half a unit of its printed precision, and the changes of
    every step are added up (a first-order bound, times :data:`SAFETY` for the products of
    two roundings), the way carried rounding is. A declared float32, float16 or bfloat16 adds
    :func:`~qkv.check._float_error.float_error` (not with ``rounding=False``).

    Example:
        >>> from qkv.examples import loads
        >>> ex = loads("format: 2\\ninputs: {scores: [[1.5, 2]]}\\nprecision: 1\\n"
        ...            "options: {scale: false}")
        >>> float(input_effect(Setup.of(ex))["scores"][0, 0, 0])
        0.075
    """
    declared = rounding and setup.dtype in UNIT_ROUNDOFF
    if not setup.precision and not declared:
        return None
    cached = _EFFECTS.get((id(setup), declared))
    if cached is not None and cached[0] is setup:
        return cached[1]
    base = forward(setup)
    total = {name: np.zeros_like(value) for name, value in base.items()}
    arrays = {"embeddings": "X", "W_q": "W_q", "W_k": "W_k", "W_v": "W_v", "W_o": "W_o"}
    for name, decimals in setup.precision.items():
        half = 0.5 * 10.0**-decimals
        if name in setup.given:
            source = setup.given[name]
        else:
            found = getattr(setup, arrays[name])
            if found is None:
                continue
            source = found
        for where in np.ndindex(source.shape):
            moved = source.copy()
            moved[where] += half
            if name in setup.given:
                changed = dataclasses.replace(setup, given={**setup.given, name: moved})
            elif name == "embeddings":
                changed = dataclasses.replace(setup, X=moved)
            elif name == "W_q":
                changed = dataclasses.replace(setup, W_q=moved)
            elif name == "W_k":
                changed = dataclasses.replace(setup, W_k=moved)
            elif name == "W_v":
                changed = dataclasses.replace(setup, W_v=moved)
            else:
                changed = dataclasses.replace(setup, W_o=moved)
            values = forward(changed)
            for step in total:
                total[step] += _change(values[step], base[step])
    effect = {step: SAFETY * value for step, value in total.items()}
    if declared:
        assert setup.dtype is not None
        own = float_error(setup, setup.dtype)
        effect = {step: value + own[step] for step, value in effect.items()}
    if len(_EFFECTS) > 2:
        _EFFECTS.clear()
    _EFFECTS[id(setup), declared] = (setup, effect)
    return effect


def allowance(half: np.ndarray, carried: np.ndarray, computed: np.ndarray) -> np.ndarray:
    """Half a printed unit plus the carried rounding plus floating-point noise."""
    total: np.ndarray = half + carried + EPSILON * (1.0 + np.abs(computed))
    return total


def grade(
    claimed: np.ndarray,
    computed: np.ndarray,
    half: np.ndarray,
    carried: np.ndarray,
    band: np.ndarray | None = None,
) -> tuple[str, ...]:
    """Each claimed number: ``"ok"``, ``"rounding"`` (off by at most one unit of its last
    printed digit, beyond the allowance) or ``"wrong"``. ``band``: how far beyond the
    allowance a rounding note reaches (default ``half``; the policy gives whole numbers none).

    Example:
        >>> half = half_units([2, 2, 2])
        >>> grade(np.array([0.50, 0.81, 0.90]), np.array([0.502, 0.8, 0.8]), half, 0 * half)
        ('ok', 'rounding', 'wrong')
    """
    off = np.abs(claimed - computed)
    ok = allowance(half, carried, computed)
    near = ok + (half if band is None else band)  # one full unit of the last digit
    return tuple(
        OK if d <= a else ROUNDING if d <= n else WRONG
        for d, a, n in zip(off, ok, near, strict=True)
    )


def matches(
    claimed: np.ndarray, computed: np.ndarray, half: np.ndarray, carried: np.ndarray
) -> bool:
    """Whether every claimed number is within its allowance of the computed one."""
    return bool(np.all(np.abs(claimed - computed) <= allowance(half, carried, computed)))
