"""The diagnosis of ``qkv check --function``: which slip an attention function makes.

What the function returned on each probe (:class:`~qkv.check._function_run.Outcome`) is
compared with the correct attention and with each slip of :data:`~qkv.check._probes.SLIPS`,
computed in NumPy float64. The first slip that reproduces every main probe names the mistake;
the probe with large scores catches a softmax without max-subtraction, the probe with a
fully masked row a NaN (a note).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from qkv._format import number
from qkv.check._findings import DIAGNOSES, Finding
from qkv.check._function_run import Outcome
from qkv.check._probes import ORDER_SCORES, SLIPS, Probe, causal_allow, per_slice, probes

__all__ = ["FUNCTION_DIAGNOSES", "diagnose"]

Array = NDArray[np.float64]

FUNCTION_DIAGNOSES = {
    "unscaled": "the scores are not divided by √d_k before the softmax; attention is "
    "softmax(Q·Kᵀ/√d_k)·V",
    "scaled-by-dk": "the scores are divided by d_k instead of √d_k",
    "scaled-by-dmodel": DIAGNOSES["scaled-by-dmodel"],
    "transposed-weights": "X·Wᵀ instead of X·W: with row vectors, Q = X·W_q (the same for K, "
    "V and the output W_o)",
    "softmax-wrong-axis": "softmax over the queries (axis -2) instead of over the keys: each "
    "row of weights, one per query, must sum to 1 (softmax over the last axis)",
    "query-key-swapped": "K·Qᵀ instead of Q·Kᵀ: row i of the scores must hold query i's "
    "scores against every key",
    "sum-normalised": DIAGNOSES["sum-normalised"],
    "mask-ignored": DIAGNOSES["mask-ignored"],
    "mask-inverted": DIAGNOSES["mask-inverted"],
    "causal-misaligned": DIAGNOSES["causal-misaligned"],
    "not-softmax": "the weights are not a softmax of the scores: each row must be "
    "exp(s_j) / Σ exp(s), so a larger score always gets a larger weight, in a fixed ratio "
    "e^(s_j − s_k)",
    "heads-averaged": DIAGNOSES["heads-averaged"],
    "no-max-subtraction": "softmax overflows to inf or NaN at large scores: subtract each "
    "row's maximum score before exp (softmax does not change)",
    "masked-row-nan": "a fully masked row gives NaN; qkv's policy gives it zero weights and a "
    "zero context (a note, not an error)",
    "unbatched": "right on (L, d) inputs but not on batched (B, H, L, d) inputs: use "
    "K.swapaxes(-1, -2) (NumPy) or K.transpose(-2, -1) (torch) instead of K.T, take d_k as "
    "Q.shape[-1], and take the softmax over the last axis",
    "unrecognised": "the outputs are not attention's and match none of the known slips",
}
"""Each code ``--function`` can report, with its sentence: what is wrong and what it should be.
Codes a worked example can show too share :data:`~qkv.check.DIAGNOSES`'s sentence; the others
say it in terms of code (axes, ``K.T``)."""

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
    finite = np.isfinite(want)
    scale = float(np.abs(want[finite]).max()) if finite.any() else 1.0
    with np.errstate(invalid="ignore"):
        return bool(
            np.allclose(value[finite], want[finite], rtol=rtol, atol=rtol * 0.01 * max(scale, 1.0))
        )


def _slipped(slip: Callable[[Probe], tuple[Array, Array]], p: Probe) -> tuple[Array, Array] | None:
    try:
        return slip(p)
    except ValueError:
        return None


def _first_wrong_row(got: Array, want: Array) -> int:
    for i in range(min(len(got), len(want))):
        g, w = np.atleast_1d(got[i]), np.atleast_1d(want[i])
        finite = np.isfinite(w)
        if g.shape != w.shape or not np.allclose(g[finite], w[finite], rtol=_RTOL, atol=_ATOL):
            return i
    return 0


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
            "ok" if np.isclose(c, e, rtol=_RTOL, atol=_ATOL) else "wrong"
            for c, e in zip(claimed, expected, strict=True)
        ),
    )


def _weights_findings(
    all_probes: Sequence[Probe],
    outcomes: Sequence[Outcome],
    main: Sequence[int],
    slips: Sequence[tuple[str | None, Callable[[Probe], tuple[Array, Array]]]],
    expected: dict[str | None, list[tuple[Array, Array] | None]],
) -> list[Finding]:
    """A finding when the context is right but the returned weights are not."""
    for j, i in enumerate(main):
        got, want = outcomes[i], expected[None][j]
        if got.weights is None or want is None or _agrees(got, want, weights=True):
            continue
        code = next(
            (c for c, _ in slips if c and _agrees(got, expected[c][j], weights=True)),
            "unrecognised",
        )
        return [_finding(code, all_probes[i], got, want, step="weights")]
    return []


def _not_softmax(probe: Probe, got: Outcome, allow: NDArray[np.bool_]) -> bool:
    """On the probe with known scores and V = I: rows of weights that sum to 1 but are no
    softmax of the scores (out of order, or not in the ratios e^(s_j − s_k) for any scale)."""
    w = got.context
    if w is None or w.shape != ORDER_SCORES.shape or not np.isfinite(w).all():
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
        if slope <= 0 or not np.allclose(np.exp(slope * x + icpt), y, rtol=1e-3, atol=1e-6):
            return True
    return False


def _order_allow(kind: str, probe: Probe, alignment: str) -> NDArray[np.bool_]:
    if kind == "causal":
        lq, lk = ORDER_SCORES.shape
        return causal_allow(lq, lk, alignment)
    return probe.allow if probe.allow is not None else np.ones(ORDER_SCORES.shape, dtype=bool)


def diagnose(
    kind: str,
    outcomes: Sequence[Outcome],
    *,
    with_mask: bool,
    alignment: str = "top-left",
    batched: bool = False,
) -> list[Finding]:
    """The findings about a function from its outcomes on the probes of ``kind``."""
    all_probes = probes(kind, with_mask=with_mask, batched=batched)
    slips = [(code, make(alignment)) for code, make in SLIPS[kind]]
    correct = slips[0][1]
    main = [i for i, p in enumerate(all_probes) if p.role == "main"]
    findings: list[Finding] = []
    expected = {code: [_slipped(s, all_probes[i]) for i in main] for code, s in slips}
    fits = [
        code
        for code, _ in slips
        if all(_agrees(outcomes[i], expected[code][j]) for j, i in enumerate(main))
    ]
    right = None in fits
    by_code = dict(slips)
    slip = correct
    if not right:
        code = next((c for c in fits if c is not None), "unrecognised")
        if code == "unrecognised":
            order = [i for i, p in enumerate(all_probes) if p.name == "known score order"]
            for i in order:
                if _not_softmax(
                    all_probes[i], outcomes[i], _order_allow(kind, all_probes[i], alignment)
                ):
                    code = "not-softmax"
        slip = by_code.get(code, correct)
        j, i = next(
            (j, i) for j, i in enumerate(main) if not _agrees(outcomes[i], expected[None][j])
        )
        findings.append(_finding(code, all_probes[i], outcomes[i], expected[None][j]))
    elif kind != "multi-head":
        findings += _weights_findings(all_probes, outcomes, main, slips, expected)
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
            bad = ~np.isfinite(got.context) & np.isfinite(want[0])
            if bad.any():
                row = int(np.argwhere(bad)[0][0])
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
            if got.context.ndim == 2 and not np.isfinite(got.context[empty]).all():
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
                        "zero weights (e.g. torch.nan_to_num on the weights).",
                    )
                )
    return findings
