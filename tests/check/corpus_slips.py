"""The slips the independent corpus verdict tries, in order, on the first wrong row.

Each slip is made on purpose, in float64, from the exact inputs and from the numbers the text
printed before the row; the first one that reproduces every number of the row (within its
allowance plus one unit of its last digit) names the mistake. Never imports qkv.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.check.corpus_model import softmax_rows
from tests.check.corpus_verdicts import MASKED, SLIPS, Judge, Row

__all__ = ["name_slip"]

ENVELOPE = {"unscaled", "scaled-by-dk", "scaled-by-dmodel", "sum-normalised"}
"""Slips whose predictions (from the exact and the printed numbers) bound one range."""
WEIGHT_STEPS = ("scaled", "exp", "weights", "products", "context")


def name_slip(j: Judge, row: Row) -> str:
    """The first code of :data:`SLIPS` whose slip gives this row, else ``arithmetic``."""
    for code in SLIPS[:-1]:
        if code == "digit-slip":
            if digit_slip(j, row):
                return code
        elif code == "not-softmax":
            if not_softmax(j, row):
                return code
        else:
            preds = PREDICT[code](j, row)
            groups = [preds] if code in ENVELOPE else [[p] for p in preds]
            if any(g and j.fits(row, g, 1.0) for g in groups):
                return code
    return "arithmetic"


def _per(j: Judge, row: Row) -> Any:
    return j.exact["per"][row.head or 0]


def _scores(j: Judge, row: Row) -> list[np.ndarray]:
    """The row's scores before scaling: exact, and as printed."""
    out = [_per(j, row)["scores"][row.index]]
    got = j.printed("scores", row.head, row.index)
    if got:
        out.append(np.where(got[0] <= MASKED, 0.0, got[0]))
    return out


def _values(j: Judge, row: Row) -> np.ndarray:
    return j._values(row.head or 0)[0]


def _from_z(j: Judge, row: Row, z: np.ndarray, mask: np.ndarray) -> Any:
    """The row of ``row.step`` when the scaled scores are ``z`` under ``mask``."""
    z = np.where(mask, z, -np.inf)
    if row.step == "scaled":
        return z
    w = softmax_rows(z[None, :])[0]
    if row.step == "exp":
        return np.where(mask, np.exp(np.where(mask, z, 0.0)), 0.0)
    return _from_w(j, row, w)


def _from_w(j: Judge, row: Row, w: np.ndarray) -> Any:
    if row.step == "weights":
        return w
    if row.step == "products":
        return (w[:, None] * _values(j, row)).ravel()
    if row.step == "context" and row.head is not None:
        return w @ _values(j, row)
    return None


def _rescaled(j: Judge, row: Row, factor: float | None) -> list[np.ndarray]:
    """The row when the scores are multiplied by ``factor`` instead of the right one."""
    if row.step not in WEIGHT_STEPS or factor is None:
        return []
    mask = j.ex.mask[row.index]
    preds = [_from_z(j, row, s * factor, mask) for s in _scores(j, row)]
    return [p for p in preds if p is not None]


def unscaled(j: Judge, row: Row) -> list[np.ndarray]:
    if float(_per(j, row)["factor"]) == 1.0:
        return []
    return _rescaled(j, row, 1.0)


def scaled_by_dk(j: Judge, row: Row) -> list[np.ndarray]:
    if j.ex.scale_opt is not True:
        return []
    d = j.ex.d_k_opt or _d_head(j)
    return _rescaled(j, row, 1.0 / d if d and d != 1 else None)


def scaled_by_dmodel(j: Judge, row: Row) -> list[np.ndarray]:
    if j.ex.scale_opt is not True or j.ex.heads == 1:
        return []
    return _rescaled(j, row, 1.0 / math.sqrt(_d_head(j) * j.ex.heads))


def _d_head(j: Judge) -> int:
    q = j.exact["Q"]
    return 0 if q is None else q.shape[1] // j.ex.heads


def transposed_weights(j: Judge, row: Row) -> list[np.ndarray]:
    x = j.ex.inputs
    if row.step not in ("Q", "K", "V") or "X" not in x or j.ex.heads != 1:
        return []
    w = x["W_" + row.step.lower()]
    return [x["X"][row.index] @ w.T] if w.shape[0] == w.shape[1] else []


def softmax_wrong_axis(j: Judge, row: Row) -> list[np.ndarray]:
    per = _per(j, row)
    if row.step not in ("weights", "products", "context") or per["scaled"].shape[0] < 2:
        return []
    cols = softmax_rows(per["scaled"].T).T
    p = _from_w(j, row, cols[row.index])
    return [] if p is None else [p]


def query_key_swapped(j: Judge, row: Row) -> list[np.ndarray]:
    per = _per(j, row)
    s = per["scores"]
    if s.shape[0] != s.shape[1] or row.step not in ("scores", *WEIGHT_STEPS):
        return []
    if row.step == "scores":
        return [s.T[row.index]]
    p = _from_z(j, row, s.T[row.index] * float(per["factor"]), j.ex.mask[row.index])
    return [] if p is None else [p]


def context_not_summed(j: Judge, row: Row) -> list[np.ndarray]:
    if row.step != "context" or row.head is None:
        return []
    per, v = _per(j, row), _values(j, row)
    if row.index >= v.shape[0]:
        return []
    preds = []
    for q in range(per["weights"].shape[0]):
        weights = [per["weights"][q]]
        got = j.printed("weights", row.head, q)
        if got:
            weights.append(got[0])
        preds += [w[row.index] * v[row.index] for w in weights]
    return preds


def wrong_query(j: Judge, row: Row) -> list[np.ndarray]:
    if row.step not in ("scores", "scaled", "weights", "context", "exp"):
        return []
    if row.step == "context" and row.head is None:
        src = j.exact["context"]
    else:
        src = _per(j, row)[row.step]
    return [np.asarray(src[i]).ravel() for i in range(src.shape[0]) if i != row.index]


def sum_normalised(j: Judge, row: Row) -> list[np.ndarray]:
    if row.step not in ("weights", "products", "context"):
        return []
    mask, preds = j.ex.mask[row.index], []
    for s in _scores(j, row):
        tot = s[mask].sum()
        if tot != 0:
            p = _from_w(j, row, np.where(mask, s / tot, 0.0))
            if p is not None:
                preds.append(p)
    return preds


def _masked_variant(j: Judge, row: Row, mask: np.ndarray) -> list[np.ndarray]:
    per = _per(j, row)
    if not mask.any():
        return []
    p = _from_z(j, row, per["scores"][row.index] * float(per["factor"]), mask)
    return [] if p is None else [p]


def mask_ignored(j: Judge, row: Row) -> list[np.ndarray]:
    mask = j.ex.mask[row.index]
    if mask.all() or row.step not in WEIGHT_STEPS:
        return []
    return _masked_variant(j, row, np.ones_like(mask))


def mask_inverted(j: Judge, row: Row) -> list[np.ndarray]:
    mask = j.ex.mask[row.index]
    if mask.all() or row.step not in WEIGHT_STEPS:
        return []
    return _masked_variant(j, row, ~mask)


def causal_misaligned(j: Judge, row: Row) -> list[np.ndarray]:
    causal = j.ex.data.get("options", {}).get("causal", False)
    lq, lk = j.ex.mask.shape
    if causal is False or lq == lk or row.step not in WEIGHT_STEPS:
        return []
    i, k = row.index, np.arange(lk)
    other = k <= i + lk - lq if causal in (True, "top-left") else k <= i
    return _masked_variant(j, row, other)


def other_weights(j: Judge, row: Row) -> list[np.ndarray]:
    if row.step != "context" or row.head is None:
        return []
    if not j.printed("weights", row.head, row.index):
        return []
    v = _values(j, row)
    if v.shape[0] > v.shape[1] + 1:
        return []
    a = np.vstack([v.T, np.ones((1, v.shape[0]))])
    b = np.concatenate([row.values, [1.0]])
    w, *_ = np.linalg.lstsq(a, b, rcond=None)
    return [w @ v] if (w >= -0.01).all() else []


def heads_averaged(j: Judge, row: Row) -> list[np.ndarray]:
    if row.step != "output" or j.ex.heads == 1:
        return []
    parts = [p["context"][row.index] for p in j.exact["per"]]
    return [np.mean(parts, axis=0)]


def digit_slip(j: Judge, row: Row) -> bool:
    """One number wrong, and it differs from the right one by one digit or a swap."""
    refs = [j.exact_row(row.step, row.head, row.index)]
    refs += [c for c, bad in j.candidates(row.step, row.head, row.index) if not bad]
    refs = [np.ravel(r) for r in refs if np.size(r) == len(row.nums)]
    wrong = [k for k in range(len(row.nums)) if not j.fits_at(row, k, [r[k] for r in refs], 1.0)]
    if len(wrong) != 1:
        return False
    k, num = wrong[0], row.nums[wrong[0]]
    return any(
        np.isfinite(r[k]) and _one_digit(num.text.strip(), f"{r[k]:.{num.decimals}f}") for r in refs
    )


def _one_digit(printed: str, right: str) -> bool:
    a, b = printed.lstrip("+"), right.lstrip("+")
    if len(a) != len(b):
        return False
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(diff) == 1:
        return a[diff[0]].isdigit() and b[diff[0]].isdigit()
    return (
        len(diff) == 2
        and diff[1] == diff[0] + 1
        and a[diff[0]] == b[diff[1]]
        and a[diff[1]] == b[diff[0]]
    )


def not_softmax(j: Judge, row: Row) -> bool:
    """Weights that no softmax of these scores gives: out of order, or not exp-linear."""
    if row.step != "weights":
        return False
    w, mask = row.values, j.ex.mask[row.index]
    half = 0.5 * 10.0 ** (-min(n.decimals for n in row.nums))
    if (w < -half).any() or abs(w.sum() - 1.0) > len(w) * half + 0.01:
        return False
    for s in _scores(j, row):
        s, ww = s[mask], w[mask]
        for a in range(s.size):
            for b in range(s.size):
                if s[a] > s[b] + 1e-9 and ww[a] < ww[b] - 2 * half:
                    return True
        keep = ww > 2 * half
        if keep.sum() >= 2 and np.ptp(s[keep]) > 0:
            slope, _icpt = np.polyfit(s[keep], np.log(ww[keep]), 1)
            if slope > 0:
                fitted = np.where(mask, 0.0, 0.0)
                fitted[mask] = softmax_rows((slope * s)[None, :])[0]
                if j.fits(row, [fitted], 1.0):
                    return False
    return True


PREDICT = {
    "unscaled": unscaled,
    "scaled-by-dk": scaled_by_dk,
    "scaled-by-dmodel": scaled_by_dmodel,
    "transposed-weights": transposed_weights,
    "softmax-wrong-axis": softmax_wrong_axis,
    "query-key-swapped": query_key_swapped,
    "context-not-summed": context_not_summed,
    "wrong-query": wrong_query,
    "sum-normalised": sum_normalised,
    "mask-ignored": mask_ignored,
    "mask-inverted": mask_inverted,
    "causal-misaligned": causal_misaligned,
    "other-weights": other_weights,
    "heads-averaged": heads_averaged,
}
