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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qkv.check._pipeline import (
    ROW_STEPS,
    STEPS,
    Overrides,
    Setup,
    Slip,
    Values,
    forward,
    row_of,
)

__all__ = ["Entry", "Sensitivity", "allowance", "grade", "half_units", "matches"]

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
    """One claimed number: its step, token, place in the row and half unit."""

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
        # step → (entries, *shape of the step): how much each entry's half unit moves it.
        self._stack = {
            name: np.zeros((len(self.entries), *v.shape)) for name, v in self.values.items()
        }
        for k, entry in enumerate(self.entries):
            if STEPS.index(entry.step) >= stop:
                continue
            row = np.array(row_of(self.values, entry.step, entry.row), dtype=np.float64)
            for sign in (1.0, -1.0):
                moved = row.copy()
                moved[entry.index] += sign * entry.half
                values = forward(setup, slip, _with(base, entry.step, entry.row, moved))
                for name in STEPS[STEPS.index(entry.step) + 1 : stop + 1]:
                    change = np.abs(values[name] - self.values[name])
                    np.maximum(self._stack[name][k], change, out=self._stack[name][k])

    def carried(self, step: str, t: int, ratios: Sequence[float] | None = None) -> np.ndarray:
        """The carried rounding of each number in the row of token ``t`` of ``step``.

        Args:
            step: the step of the row (before ``until``, or ``until`` itself).
            t: the token.
            ratios: per entry, how many half units it may be off (default 1 each).
        """
        stack = self._stack[step]
        rows = stack[:, t] if step in ROW_STEPS else stack[:, 0, t]  # (entries, n)
        weights = np.ones(len(self.entries)) if ratios is None else np.asarray(ratios, dtype=float)
        carried: np.ndarray = SAFETY * (weights @ rows)
        return carried


def allowance(half: np.ndarray, carried: np.ndarray, computed: np.ndarray) -> np.ndarray:
    """Half a printed unit plus the carried rounding plus floating-point noise."""
    total: np.ndarray = half + carried + EPSILON * (1.0 + np.abs(computed))
    return total


def grade(
    claimed: np.ndarray, computed: np.ndarray, half: np.ndarray, carried: np.ndarray
) -> tuple[str, ...]:
    """Each claimed number: ``"ok"``, ``"rounding"`` (off by at most one unit of its last
    printed digit, beyond the allowance) or ``"wrong"``.

    Example:
        >>> half = half_units([2, 2, 2])
        >>> grade(np.array([0.50, 0.81, 0.90]), np.array([0.502, 0.8, 0.8]), half, 0 * half)
        ('ok', 'rounding', 'wrong')
    """
    off = np.abs(claimed - computed)
    ok = allowance(half, carried, computed)
    near = ok + half  # one full unit of the last digit, plus the carried rounding
    return tuple(
        OK if d <= a else ROUNDING if d <= n else WRONG
        for d, a, n in zip(off, ok, near, strict=True)
    )


def matches(
    claimed: np.ndarray, computed: np.ndarray, half: np.ndarray, carried: np.ndarray
) -> bool:
    """Whether every claimed number is within its allowance of the computed one."""
    return bool(np.all(np.abs(claimed - computed) <= allowance(half, carried, computed)))
