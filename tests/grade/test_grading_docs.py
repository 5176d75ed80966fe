"""docs/grading.md works as written: its grades.csv and feedback are what ``qkv grade``
writes, and its Gradescope, otter-grader and nbgrader files are read the way those graders
read them (without their servers):

- Gradescope runs ``run_autograder`` and reads ``/autograder/results/results.json``
  (https://gradescope-autograders.readthedocs.io/en/latest/specs/): the script runs here
  with ``/autograder`` moved to a temporary folder, and the file is checked field by field.
- otter-grader executes an OK-format test file and takes its ``test`` dict: one suite of
  type ``doctest``, no setup or teardown, each case's ``code`` run as a doctest in the
  student's global environment (``otter/test_files/ok_test.py``: ``OKTestFile.from_spec``
  and ``run_doctest``); the same is done here with :mod:`doctest`.
- nbgrader gives an autograder cell its points when it runs without an error; its metadata
  (schema version 3) has ``grade``, ``grade_id``, ``locked``, ``points``, ``solution``.
"""

from __future__ import annotations

import doctest
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from qkv.cli import main
from tests.grade.class_maker import RIGHT, _attention
from tests.grade.schemas import check_gradescope_results

DOC = Path(__file__).resolve().parents[2] / "docs" / "grading.md"


def block(marker: str) -> str:
    """The fenced block after ``<!-- marker -->`` in docs/grading.md."""
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- {re.escape(marker)} -->\n```\w*\n(.*?)```", text, re.S)
    assert found, f"no block {marker!r} in {DOC}"
    return found.group(1)


def _env(source: str) -> dict[str, Any]:
    env: dict[str, Any] = {}
    exec(compile(source, "<student>", "exec"), env)
    return env


@pytest.mark.slow
def test_the_walkthroughs_grades_and_feedback_are_what_qkv_grade_writes(tmp_path: Path) -> None:
    folder = tmp_path / "submissions"
    folder.mkdir()
    (folder / "ada.py").write_text(RIGHT)
    (folder / "bo.py").write_text(_attention(scale=""))
    (folder / "cy.py").write_text(
        "def attention(Q, K, V, mask=None):\n    while True:\n        pass\n"
    )
    out = tmp_path / "grades"
    assert main(["grade", str(folder), "-o", str(out), "--timeout", "3", "-j", "2"]) == 0
    assert (out / "grades.csv").read_text() == block("grades.csv")
    assert (out / "bo.md").read_text().startswith(block("bo.md"))


def test_run_autograder_writes_the_results_gradescope_reads(tmp_path: Path) -> None:
    root = tmp_path / "autograder"
    (root / "submission").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "submission" / "attention.py").write_text(_attention(scale=""))
    script = root / "run_autograder"
    script.write_text(block("run_autograder").replace("/autograder", str(root)))
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": path}, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads((root / "results" / "results.json").read_text())
    check_gradescope_results(data)
    assert data["score"] == 4.0
    assert data["extra_data"]["qkv"]["first_slip"] == "unscaled"


def _run_case(code: str, env: dict[str, Any]) -> tuple[bool, str]:
    """One OK-format case run as otter-grader runs it: a doctest in the student's globals."""
    examples = doctest.DocTestParser().parse(code, "q1")
    test = doctest.DocTest(
        [e for e in examples if isinstance(e, doctest.Example)], env, "q1", None, None, code
    )
    runner = doctest.DocTestRunner(verbose=False)
    out = io.StringIO()
    with redirect_stdout(out):
        runner.run(test, out=out.write, clear_globs=False)
    return runner.summarize(verbose=False).failed == 0, out.getvalue()


def test_the_otter_test_file_passes_a_right_function_and_names_a_slip() -> None:
    spec: dict[str, Any] = {}
    exec(compile(block("otter"), "tests/q1.py", "exec"), spec)
    test = spec["test"]
    # what otter's OKTestFile.from_spec asserts
    assert "name" in test and len(test["suites"]) == 1
    suite = test["suites"][0]
    assert suite.get("type", "doctest") == "doctest"
    assert not suite.get("setup") and not suite.get("teardown")
    assert all(isinstance(c["code"], str) and isinstance(c["hidden"], bool) for c in suite["cases"])
    assert test["points"] == len(suite["cases"]) == 5
    right = [_run_case(c["code"], _env(RIGHT)) for c in suite["cases"]]
    assert all(passed for passed, _ in right)
    slipped = [_run_case(c["code"], _env(_attention(scale=""))) for c in suite["cases"]]
    assert [passed for passed, _ in slipped] == [True, False, True, True, True]
    assert "The scores are not divided by √d_k before the softmax" in slipped[1][1]


def test_the_nbgrader_cell_and_its_metadata() -> None:
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    found = re.search(r'`(\{"grade": true.*?\})`', text)
    assert found
    metadata = json.loads(found.group(1))
    assert metadata["schema_version"] == 3
    assert metadata["grade"] is True and metadata["solution"] is False
    assert metadata["locked"] is True and isinstance(metadata["grade_id"], str)
    assert isinstance(metadata["points"], int | float) and metadata["points"] > 0
    cell = block("nbgrader")
    # the cell as a notebook holds it (nbformat 4): a code cell, its source and metadata
    notebook = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {},
        "cells": [
            {"cell_type": "code", "id": "scaling", "metadata": {"nbgrader": metadata},
             "source": cell, "outputs": [], "execution_count": None}
        ],
    }  # fmt: skip
    assert json.loads(json.dumps(notebook))["cells"][0]["metadata"]["nbgrader"] == metadata
    exec(compile(cell, "<cell>", "exec"), _env(RIGHT))  # runs: the points are given
    with pytest.raises(AssertionError, match="The scores are not divided by √d_k"):
        exec(compile(cell, "<cell>", "exec"), _env(_attention(scale="")))
