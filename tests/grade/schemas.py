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
``output_format`` (and ``test_output_format``, a test's ``output_format``) is ``text``,
``html``, ``simple_format`` (the default: rendered as HTML), ``md`` or ``ansi``: a file whose
outputs quote a student's text must say ``text`` (or escape for the format it names).

PrairieLearn's external grader ``results.json``: "External Grading", section "Grading
results" (https://prairielearn.readthedocs.io/en/latest/externalGrading/; PrairieLearn's
``docs/externalGrading.md``): written to ``/grade/results/results.json``, at most 1 MB;
``score`` (a number in [0, 1]) is the one mandatory field of a gradable submission;
``gradable`` (a boolean, true when left out) false marks an invalid submission ("for example
if it has a syntax error"), which then needs no score, and ``format_errors`` (a string or a
list of strings) says why; ``message`` and ``output`` are strings; ``tests`` is a list of
objects with ``name``, ``description``, ``points``, ``max_points``, ``message``, ``output``
(and ``images``); any other field may be added. ``partial_scores`` (per part: ``score`` in
[0, 1], ``weight``, ``feedback``) is the shape of a question's ``data["partial_scores"]``
(PrairieLearn's "Questions" page), added by qkv as such a field.
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
    # qkv's outputs quote students' text: none may be rendered as HTML (simple_format, the
    # default, is)
    if "output" in data:
        assert data.get("output_format") in ("text", "ansi"), "the output would be HTML"
    for test in tests:
        if "output" in test:
            shown = test.get("output_format", data.get("test_output_format", "simple_format"))
            assert shown in ("text", "ansi"), "a test's output would be HTML"


PL_TEST: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "description": str,
    "points": (int, float),
    "max_points": (int, float),
    "message": str,
    "output": str,
    "images": list,
}
PL_LIMIT = 1 << 20


def check_prairielearn_results(text: str) -> dict[str, Any]:
    """Raise AssertionError where ``text`` is not a results.json PrairieLearn reads; return
    the data."""
    import json

    assert len(text.encode()) <= PL_LIMIT, "results.json is over PrairieLearn's 1 MB"
    data = json.loads(text)
    assert isinstance(data, dict), "results.json must be an object"
    gradable = data.get("gradable", True)
    assert isinstance(gradable, bool), "gradable must be true or false"
    if gradable:
        assert "score" in data, "a gradable submission needs a score"
    if "score" in data:
        score = data["score"]
        assert isinstance(score, int | float) and not isinstance(score, bool), "score"
        assert 0.0 <= score <= 1.0, f"score {score} is not in [0, 1]"
    if "format_errors" in data:
        errors = data["format_errors"]
        assert isinstance(errors, str) or (
            isinstance(errors, list) and all(isinstance(e, str) for e in errors)
        ), "format_errors must be a string or a list of strings"
    for key in ("message", "output"):
        if key in data:
            assert isinstance(data[key], str), f"{key} must be a string"
    for test in data.get("tests", []):
        assert isinstance(test, dict), "each test must be an object"
        for key, value in test.items():
            assert key in PL_TEST, f"unknown test key {key!r}"
            assert isinstance(value, PL_TEST[key]), f"test {key}: {type(value).__name__}"
            assert not isinstance(value, bool), f"test {key} must not be true/false"
        if "points" in test and "max_points" in test:
            assert 0 <= test["points"] <= test["max_points"]
    for name, part in data.get("partial_scores", {}).items():
        assert isinstance(name, str) and isinstance(part, dict)
        assert 0.0 <= part["score"] <= 1.0 and part["weight"] >= 0
        assert isinstance(part.get("feedback", ""), str)
    return data
