"""``qkv.testing.grade_attention`` runs the function in the caller's process: the judge keeps
its own references to the NumPy functions it compares with (issue 35, item 1), so that a
function that replaces them cannot change its grade."""

from __future__ import annotations

from typing import Any

import numpy as np

from qkv.testing import check_attention, grade_attention


def _cheat(Q: Any, K: Any, V: Any) -> Any:
    """Every comparison made true, then sevens."""
    np.allclose = lambda *a, **k: True
    np.isclose = lambda a, b, *r, **k: np.ones(np.broadcast(a, b).shape, dtype=bool)  # type: ignore[assignment]
    np.isfinite = lambda x, *a, **k: np.ones(np.shape(x), dtype=bool)  # type: ignore[assignment]
    np.asarray = lambda *a, **k: np.full((Q.shape[0], V.shape[1]), 0.5)
    return np.full((Q.shape[0], V.shape[1]), 7.0)


def test_a_function_that_patches_numpy_gets_no_marks_for_sevens() -> None:
    saved = {n: getattr(np, n) for n in ("allclose", "isclose", "isfinite", "asarray")}
    try:
        grade = grade_attention(_cheat)
        report = check_attention(_cheat)
    finally:
        for name, fn in saved.items():
            setattr(np, name, fn)
    assert grade.score < grade.max_score and grade.status == "slip"
    assert not report.ok and report.findings[0].diagnosis == "unrecognised"
