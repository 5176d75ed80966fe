"""The files other graders read, as they document them: checked field by field, so that a
file qkv writes is one they accept, without their servers.

Gradescope's ``results.json``: "Autograder Specifications", section "Output format"
(https://gradescope-autograders.readthedocs.io/en/latest/specs/): a top-level ``score``
(required unless every test has one), optional ``execution_time``, ``output``,
``output_format``, ``test_output_format``, ``test_name_format``, ``visibility``,
``stdout_visibility``, ``extra_data``, ``tests`` and ``leaderboard``; each test optional
``score``, ``max_score``, ``status`` (``passed`` or ``failed``), ``name``, ``name_format``,
``number``, ``output``, ``output_format``, ``tags``, ``visibility``, ``extra_data``.
Visibility is ``hidden``, ``after_due_date``, ``after_published`` or ``visible``.
"""

from __future__ import annotations

from typing import Any

GRADESCOPE_TOP: dict[str, type | tuple[type, ...]] = {
    "score": (int, float),
    "execution_time": (int, float),
    "output": str,
    "output_format": str,
    "test_output_format": str,
    "test_name_format": str,
    "visibility": str,
    "stdout_visibility": str,
    "extra_data": dict,
    "tests": list,
    "leaderboard": list,
}
GRADESCOPE_TEST: dict[str, type | tuple[type, ...]] = {
    "score": (int, float),
    "max_score": (int, float),
    "status": str,
    "name": str,
    "name_format": str,
    "number": str,
    "output": str,
    "output_format": str,
    "tags": list,
    "visibility": str,
    "extra_data": dict,
}
VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}
FORMATS = {"text", "html", "simple_format", "md", "ansi"}


def check_gradescope_results(data: Any) -> None:
    """Raise AssertionError where ``data`` is not a results.json Gradescope reads."""
    assert isinstance(data, dict), "results.json must be an object"
    for key, value in data.items():
        assert key in GRADESCOPE_TOP, f"unknown top-level key {key!r}"
        assert isinstance(value, GRADESCOPE_TOP[key]), f"{key} has type {type(value).__name__}"
        assert not isinstance(value, bool), f"{key} must not be true/false"
    tests = data.get("tests", [])
    assert "score" in data or all("score" in t for t in tests), "a score is required"
    for key in ("visibility", "stdout_visibility"):
        if key in data:
            assert data[key] in VISIBILITIES, f"{key} {data[key]!r}"
    for key in ("output_format", "test_output_format", "test_name_format"):
        if key in data:
            assert data[key] in FORMATS, f"{key} {data[key]!r}"
    for test in tests:
        assert isinstance(test, dict), "each test must be an object"
        for key, value in test.items():
            assert key in GRADESCOPE_TEST, f"unknown test key {key!r}"
            assert isinstance(value, GRADESCOPE_TEST[key]), f"test {key}: {type(value).__name__}"
            assert not isinstance(value, bool), f"test {key} must not be true/false"
        if "status" in test:
            assert test["status"] in ("passed", "failed"), test["status"]
        if "visibility" in test:
            assert test["visibility"] in VISIBILITIES, test["visibility"]
        if "score" in test and "max_score" in test:
            assert 0 <= test["score"] <= test["max_score"] or test["max_score"] == 0
    if tests and "score" in data:
        assert abs(data["score"] - sum(t.get("score", 0) for t in tests)) < 1e-9
