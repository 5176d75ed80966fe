"""The diagnosis of ``qkv check --function``: which slip an attention function makes.

What the function returned on each probe (:class:`~qkv.check._function_run.Outcome`) is
compared with the correct attention and with each slip of
:func:`~qkv.check._function_codes.slips_of`, computed in NumPy float64. Outputs that change
between two calls on the same inputs are dropout left on; otherwise the first slip that
reproduces every main probe names the mistake; the probe with large scores catches a softmax
without max-subtraction (when the same rows are finite at ordinary scores), the probe with a
fully masked row a NaN (a note).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from qkv._format import number
from qkv.check._findings import Finding
from qkv.check._function_codes import FUNCTION_DIAGNOSES, Tried, slips_of
from qkv.check._function_run import Outcome
from qkv.check._probes import ORDER_SCORES, Probe, Spec, causal_allow, per_slice, probes_of

__all__ = ["FUNCTION_DIAGNOSES", "diagnose"]

Array = NDArray[np.float64]

# The judge's own references to the NumPy functions it compares with, bound when qkv is
# imported: a student's function that replaces np.allclose (say) changes no verdict.
_allclose = np.allclose
_isclose = np.isclose
_isfinite = np.isfinite
_isnan = np.isnan
_isposinf = np.isposinf
_abs = np.abs
_any = np.any

_RTOL = 1e-4
_ATOL = 1e-6
_LARGE_RTOL = 1e-2  # scores near 3000 leave float32 only ~4 significant digits of softmax


def _agrees(
    got: Outcome,
    expected: tuple[Array, Array] | None,
    *,
    weights: bool = False,
    rtol: float = _RTOL,
) -> bool:
    """Whether the function's outcome is the slip's: both raise, or the numbers agree where
    the slip's are finite."""
    if expected is None:
        return got.error is not None
    value = got.weights if weights else got.context
    if got.error is not None or value is None:
        return False
    want = expected[1] if weights else expected[0]
    if value.shape != want.shape:
        return False
    spoilt = _isposinf(want)  # a slip's NaN rows (+inf filled): must not be numbers here
    if bool(_any(spoilt)) and bool(_any(_isfinite(value[spoilt]))):
        return False
    finite = _isfinite(want)
    scale = float(_abs(want[finite]).max()) if finite.any() else 1.0
    with np.errstate(invalid="ignore"):
        return bool(
            _allclose(value[finite], want[finite], rtol=rtol, atol=rtol * 0.01 * max(scale, 1.0))
        )


def _slipped(slip: Callable[[Probe], tuple[Array, Array]], p: Probe) -> tuple[Array, Array] | None:
    try:
        return slip(p)
    except ValueError:
        return None


def _first_wrong_row(got: Array, want: Array) -> int:
    for i in range(min(len(got), len(want))):
        g, w = np.atleast_1d(got[i]), np.atleast_1d(want[i])
        finite = _isfinite(w)
        if g.shape != w.shape or not _allclose(g[finite], w[finite], rtol=_RTOL, atol=_ATOL):
            return i
    return 0


def _numbers(row: Array) -> str:
    return "[" + ", ".join(number(float(x), 4) for x in np.atleast_1d(row)) + "]"


def _noun(probe: Probe, step: str) -> str:
    return "weights" if step == "weights" else "output" if probe.num_heads > 1 else "context"


def _finding(
    code: str,
    probe: Probe,
    got: Outcome,
    want: tuple[Array, Array] | None,
    *,
    status: str = "mismatch",
    step: str = "context",
    row: int | None = None,
    extra: str = "",
) -> Finding:
    claimed: tuple[float, ...] = ()
    expected: tuple[float, ...] = ()
    value = got.weights if step == "weights" else got.context
    if want is not None and value is not None:
        target = want[1] if step == "weights" else want[0]
        if value.ndim == target.ndim and value.ndim >= 1:
            r = _first_wrong_row(value, target) if row is None else row
            if value.ndim == 2 and value.shape == target.shape:
                claimed = tuple(float(x) for x in value[r])
                expected = tuple(float(x) for x in target[r])
            row = r
    elif want is not None and got.error is not None:  # it raised: the first correct row
        target = want[1] if step == "weights" else want[0]
        if target.ndim == 2:
            row = row or 0
            expected = tuple(float(x) for x in target[row])
    what = f"On the probe {probe.name!r}"
    if want is None and value is not None:
        what += f", row {row} of the {_noun(probe, step)} is not a number (NaN or inf)"
    elif got.error is not None:
        what += f" it raised {got.error}"
    elif value is not None and want is not None:
        target = want[1] if step == "weights" else want[0]
        if value.shape != target.shape:
            what += f" it returned shape {value.shape}; expected {target.shape}"
        else:
            what += f", row {row} of the {_noun(probe, step)} is off"
    message = f"{FUNCTION_DIAGNOSES[code][0].upper()}{FUNCTION_DIAGNOSES[code][1:]}. {what}."
    if extra:
        message += f" {extra}"
    return Finding(
        step=step,
        token=probe.name,
        position=row or 0,
        claimed=claimed,
        printed=tuple("nan" if np.isnan(x) else number(x, 4) for x in claimed),
        expected=expected,
        status=status,
        diagnosis=code,
        message=message,
        marks=tuple(
            "ok" if _isclose(c, e, rtol=_RTOL, atol=_ATOL) else "wrong"
            for c, e in zip(claimed, expected, strict=False)
        ),
    )


def _weights_findings(
    all_probes: Sequence[Probe],
    outcomes: Sequence[Outcome],
    main: Sequence[int],
    tried: Sequence[Tried],
    expected: Sequence[Sequence[tuple[Array, Array] | None]],
) -> list[Finding]:
    """A finding when the context is right but the returned weights are not."""
    for j, i in enumerate(main):
        got, want = outcomes[i], expected[0][j]
        if got.weights is None or want is None or _agrees(got, want, weights=True):
            continue
        k = next(
            (k for k in range(1, len(tried)) if _agrees(got, expected[k][j], weights=True)), None
        )
        code = "unrecognised" if k is None else tried[k].code
        assert code is not None
        extra = "" if k is None else tried[k].detail
        return [_finding(code, all_probes[i], got, want, step="weights", extra=extra)]
    return []


def _not_softmax(probe: Probe, got: Outcome, allow: NDArray[np.bool_]) -> bool:
    """On the probe with known scores and V = I: rows of weights that sum to 1 but are no
    softmax of the scores (out of order, or not in the ratios e^(s_j − s_k) for any scale)."""
    w = got.context
    if w is None or w.shape != ORDER_SCORES.shape or not _isfinite(w).all():
        return False
    for row, keep in zip(w, allow, strict=True):
        if keep.any() and (abs(row.sum() - 1.0) > 1e-4 or (row < -1e-9).any()):
            return False
    for row, s, keep in zip(w, ORDER_SCORES, allow, strict=True):
        x, y = s[keep], row[keep]
        if keep.sum() < 3 or np.ptp(x) == 0:
            continue
        if (y <= 0).any():
            return True
        slope, icpt = np.polyfit(x, np.log(y), 1)
        if slope <= 0 or not _allclose(np.exp(slope * x + icpt), y, rtol=1e-3, atol=1e-6):
            return True
    return False


def _order_allow(spec: Spec, probe: Probe) -> NDArray[np.bool_]:
    if spec.causal:
        lq, lk = ORDER_SCORES.shape
        return causal_allow(lq, lk, spec.alignment)
    return probe.allow if probe.allow is not None else np.ones(ORDER_SCORES.shape, dtype=bool)


def _changed(first: Outcome, again: Outcome) -> int | None:
    """The first row whose numbers differ between two calls on the same inputs, or None."""
    if first.context is None or again.context is None or first.context.shape != again.context.shape:
        return None
    a, b = first.context, again.context
    with np.errstate(invalid="ignore"):
        same = _isclose(a, b, rtol=1e-9, atol=1e-12) | (_isnan(a) & _isnan(b))
    if same.all():
        return None
    return int(np.argwhere(~same)[0][0]) if a.ndim >= 1 else 0


def _overflows(got: Outcome, base: Outcome, want: tuple[Array, Array]) -> int | None:
    """The first row that is not a number on the large probe while the slip's is, and the
    same row is a number at ordinary scores (a row with no allowed key is NaN at any scale:
    that is no overflow)."""
    assert got.context is not None
    bad = ~_isfinite(got.context) & _isfinite(want[0])
    if base.context is not None and base.context.shape == got.context.shape:
        bad &= _isfinite(base.context)
    return int(np.argwhere(bad)[0][0]) if bad.any() else None


def diagnose(
    spec: Spec, outcomes: Sequence[Outcome], *, lifted: bool = False, batched: bool = False
) -> list[Finding]:
    """The findings about a function from its outcomes on the probes of ``spec``.

    Args:
        spec: what the function is checked as.
        outcomes: what it returned on each probe of ``probes(spec.kind, ...)``, in order.
        lifted: the probes were given with two leading axes of 1, (1, 1, L, d): a slip that
            depends on the number of axes (``scaled-by-ndim``) sees 4.
        batched: the probes include the batched one.
    """
    all_probes = probes_of(spec, batched=batched)
    if lifted:
        all_probes = tuple(dataclasses.replace(p, seen_ndim=4) for p in all_probes)
    for i, probe in enumerate(all_probes):
        if probe.role == "repeat":
            row = _changed(outcomes[probe.base], outcomes[i])
            if row is not None:
                first, again = outcomes[probe.base], outcomes[i]
                assert first.context is not None and again.context is not None
                twice = (
                    f"Two calls gave row {row} as {_numbers(first.context[row])} and then "
                    f"{_numbers(again.context[row])}."
                )
                right_row = _slipped(slips_of(spec)[0].slip, probe)
                return [
                    _finding("dropout-at-inference", probe, again, right_row, row=row, extra=twice)
                ]
    tried = slips_of(spec)
    main = [i for i, p in enumerate(all_probes) if p.role == "main"]
    findings: list[Finding] = []
    expected = [[_slipped(t.slip, all_probes[i]) for i in main] for t in tried]
    fits = [
        k
        for k in range(len(tried))
        if all(_agrees(outcomes[i], expected[k][j]) for j, i in enumerate(main))
    ]
    right = 0 in fits
    chosen = 0
    if not right:
        chosen = next((k for k in fits if k != 0), 0)
        code = tried[chosen].code or "unrecognised"
        if code == "unrecognised":
            order = [i for i, p in enumerate(all_probes) if p.name == "known score order"]
            for i in order:
                if _not_softmax(all_probes[i], outcomes[i], _order_allow(spec, all_probes[i])):
                    code = "not-softmax"
        j, i = next((j, i) for j, i in enumerate(main) if not _agrees(outcomes[i], expected[0][j]))
        extra = tried[chosen].detail
        if code == "qk-not-transposed":  # shown where it ran: the probe with Lk = d_k
            j, i = next((j, i) for j, i in enumerate(main) if outcomes[i].error is None)
            extra = "On the other probes it raised a shape error."
        findings.append(_finding(code, all_probes[i], outcomes[i], expected[0][j], extra=extra))
    elif not spec.multi:
        findings += _weights_findings(all_probes, outcomes, main, tried, expected)
    slip = tried[chosen].slip
    correct = tried[0].slip
    for i, probe in enumerate(all_probes):
        got = outcomes[i]
        if probe.role == "batched" and right:
            try:
                want: tuple[Array, Array] | None = per_slice(correct, probe)
            except ValueError:
                want = None
            if not _agrees(got, want):
                findings.append(_finding("unbatched", probe, got, want, row=0))
        if probe.role == "large":
            want = _slipped(slip, probe)
            if want is not None and got.error is not None:
                findings.append(_finding("unrecognised", probe, got, want))
                continue
            if want is None or got.context is None:
                continue
            if got.context.shape != want[0].shape:
                continue
            row = _overflows(got, outcomes[probe.base], want)
            if row is not None:
                findings.append(_finding("no-max-subtraction", probe, got, want, row=row))
            elif right and not _agrees(got, want, rtol=_LARGE_RTOL):
                findings.append(_finding("unrecognised", probe, got, want))
        elif probe.role == "masked-row" and right:
            want = _slipped(correct, probe)
            if got.error is not None:
                findings.append(_finding("unrecognised", probe, got, want))
                continue
            if not _agrees(got, want):
                findings.append(_finding("unrecognised", probe, got, want))
                continue
            assert probe.allow is not None and got.context is not None
            empty = ~probe.allow.any(axis=-1)
            if got.context.ndim == 2 and not _isfinite(got.context[empty]).all():
                row = int(np.flatnonzero(empty)[0])
                findings.append(
                    _finding(
                        "masked-row-nan",
                        probe,
                        got,
                        None,
                        status="note",
                        row=row,
                        extra="Fine if your course allows it; to follow qkv, give such a row "
                        "zero weights (nan_to_num on the weights: np.nan_to_num for NumPy "
                        "arrays, torch.nan_to_num for tensors).",
                    )
                )
    return findings
