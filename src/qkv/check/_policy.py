"""The precision policy and the slips found by looking at the printed row itself.

The precision policy (``docs/check.md``, both formats): a claimed number equal to the exact
value from exact inputs is exact, so its rounding is not carried; a whole number whose correct
value is whole leaves no doubt at all; everything else carries half a unit of its last digit.

The slips here are not made by :func:`~qkv.check._pipeline.forward`: a digit wrong or two
swapped (``digit-slip``), weights no softmax of the scores gives (``not-softmax``, format 2
only: :attr:`~qkv.check._pipeline.Setup.names_not_softmax`), and masked scores (``-inf``) at
the wrong places (``mask-inverted``, ``causal-misaligned``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qkv._format import number
from qkv.check._pipeline import MASK_IGNORED, MASK_INVERTED, MISALIGNED, Setup

__all__ = [
    "MASKED_BELOW",
    "digit_slip",
    "exact_halves",
    "exp_variant",
    "mask_pattern",
    "not_softmax",
]

MASKED_BELOW = -1e4
"""A claimed score at or below this (``-1e9``, ``-inf``) stands for a masked key."""
_EPSILON = 1e-9


def exact_halves(
    claimed: np.ndarray,
    texts: Sequence[str],
    correct: np.ndarray,
    from_printed: np.ndarray | None,
    half: np.ndarray,
    effect: np.ndarray | None,
    rounding: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The half units of a row under the policy: (for judging the row, for carrying on).

    Args:
        claimed: the printed numbers, (n,).
        texts: the same numbers as printed (``"2"``, ``"0.50"``).
        correct: the exact values from the inputs, (n,).
        from_printed: the values computed from the numbers printed before, or None.
        half: half a unit of each number's last printed digit, (n,).
        effect: how far inputs printed rounded can move each value, or None.
        rounding: how far the computation in the format the example says (``dtype:
            float32``) can move each value, or None: a number that close to the exact value
            is that value, printed by float code (``2.46`` for 2.46, ``0.70000005`` for 0.7).

    Example:
        >>> own, carry = exact_halves(np.array([2.0, 0.5, 0.33]), ["2", "0.5", "0.33"],
        ...     np.array([2.0, 0.5, 1 / 3]), None, np.array([0.5, 0.05, 0.005]), None)
        >>> own.tolist(), carry.tolist()
        ([0.0, 0.05, 0.005], [0.0, 0.0, 0.005])
    """
    own, carry = half.copy(), half.copy()
    doubt = np.zeros_like(half) if effect is None else effect
    sure = doubt <= _EPSILON * (1.0 + np.abs(correct))
    for i, text in enumerate(texts):
        if not np.isfinite(claimed[i]) or not sure[i]:
            continue
        close = _EPSILON * (1.0 + abs(correct[i])) + (0.0 if rounding is None else rounding[i])
        whole = _is_whole_text(text) and abs(correct[i] - round(correct[i])) <= close
        if whole:
            own[i] = 0.0
        same = from_printed is not None and abs(claimed[i] - from_printed[i]) <= close
        if abs(claimed[i] - correct[i]) <= close or same:
            carry[i] = 0.0
    return own, carry


def _is_whole_text(text: str) -> bool:
    body = text.strip().lstrip("+-")
    return body.isdecimal()


def exp_variant(claimed: np.ndarray, plain: np.ndarray, scaled: np.ndarray) -> np.ndarray:
    """The exponentials a row of ``exp`` (or ``exp_sum``) is about: e^s, or e^(s − max s),
    whichever is closer to the printed numbers (both are how texts compute them).

    Args:
        claimed: the printed row.
        plain: e^s for the row (or its sum).
        scaled: the row's scaled scores (masked ones −inf), for the maximum.
    """
    finite = scaled[np.isfinite(scaled)]
    if finite.size == 0:
        return plain
    stable: np.ndarray = plain * np.exp(-float(np.max(finite)))
    if np.sum(np.abs(stable - claimed)) < np.sum(np.abs(plain - claimed)):
        return stable
    return plain


def mask_pattern(setup: Setup, t: int, masked: np.ndarray) -> str | None:
    """The mask slip whose masked keys are exactly the printed ``-inf`` of query ``t``.

    Example:
        >>> from qkv.examples import loads
        >>> ex = loads("format: 2\\ninputs: {scores: [[1, 2], [3, 4]]}\\n"
        ...            "options: {causal: true, scale: false}")
        >>> mask_pattern(Setup.of(ex), 0, np.array([True, False]))
        'mask-inverted'
    """
    for code in (MASK_INVERTED, MISALIGNED):
        if code == MISALIGNED and not (setup.causal and setup.lq != setup.lk):
            continue
        if np.array_equal(~setup.allowed(code)[t], masked):
            return code
    if not masked.any() and setup.masked:
        return None  # scores printed before masking: nothing to say
    if np.array_equal(~setup.allowed(MASK_IGNORED)[t], masked):
        return MASK_IGNORED
    return None


def digit_slip(text: str, correct: float) -> str | None:
    """The correct number printed with the same digits, when ``text`` has one digit wrong
    or two neighbouring digits swapped; else None.

    Example:
        >>> digit_slip("0.5053", 0.50349), digit_slip("0.2438", 0.24834), digit_slip("0.91", 0.5)
        ('0.5035', '0.2483', None)
    """
    decimals = len(text.split(".")[1]) if "." in text else 0
    if "e" in text.lower():
        return None
    right = number(correct, decimals)
    if right.startswith("-") != text.strip().startswith("-") or len(right) != len(text):
        return None
    diff = [i for i, (a, b) in enumerate(zip(text, right, strict=True)) if a != b]
    if len(diff) == 1 and text[diff[0]].isdigit():
        return right
    if (
        len(diff) == 2
        and diff[1] == diff[0] + 1
        and text[diff[0]] == right[diff[1]]
        and text[diff[1]] == right[diff[0]]
    ):
        return right
    return None


def not_softmax(
    weights: np.ndarray,
    candidates: Sequence[np.ndarray],
    allowed: np.ndarray,
    half: np.ndarray,
) -> tuple[int, int] | None:
    """Whether no softmax of these scores gives the weights, and the two keys that show it.

    The weights (non-negative, summing to 1) are not a softmax of the scaled scores ``s``
    when two keys are in the opposite order of their scores (or unequal for equal scores),
    or when no softmax(c·s) with c > 0 gives them (fitted on log w = c·s + b): invented
    weights. Returns (j, k): key j has the score at least as large but the smaller weight,
    or (−1, −1) when the order is kept but the ratios fit no softmax; None when some softmax
    of one of the ``candidates`` (the printed and the correct scores) gives them.

    Example:
        >>> not_softmax(np.array([0.3, 0.4, 0.3]), [np.array([1.0, 2.0, 3.0])],
        ...             np.ones(3, dtype=bool), np.full(3, 5e-5))
        (2, 1)
        >>> not_softmax(np.array([0.1, 0.3, 0.6]), [np.array([1.0, 2.0, 3.0])],
        ...             np.ones(3, dtype=bool), np.full(3, 0.005))
        (-1, -1)
    """
    unit = float(np.max(half, initial=0.0))
    if np.any(weights < -unit) or abs(float(np.sum(weights)) - 1.0) > len(weights) * unit + 0.01:
        return None
    keys = [j for j in range(len(weights)) if allowed[j]]
    found: tuple[int, int] | None = None
    for scores in candidates:
        if not all(np.isfinite(scores[j]) for j in keys):
            continue
        worst: tuple[float, tuple[int, int]] | None = None
        for j in keys:
            for k in keys:
                gap = weights[k] - weights[j] - half[j] - half[k]
                in_order = scores[j] >= scores[k] - 1e-9  # equal scores get equal weights
                if j != k and in_order and gap > 0 and (worst is None or gap > worst[0]):
                    worst = (gap, (j, k))
        if worst is not None:
            return worst[1]
        s, w = scores[keys], weights[keys]
        keep = w > 2 * half[keys]
        if keep.sum() >= 2 and np.ptp(s[keep]) > 0:
            slope = float(np.polyfit(s[keep], np.log(w[keep]), 1)[0])
            if slope > 0:
                e = np.exp(slope * (s - s.max()))
                if np.all(np.abs(e / e.sum() - w) <= 2 * half[keys] + 1e-9):
                    return None
        found = (-1, -1)
    return found
