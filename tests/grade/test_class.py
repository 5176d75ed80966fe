"""A teacher grades a generated class of 45 submissions: every row of grades.csv is asserted,
the hostile submissions touch nothing of the teacher's, and every student's files are there,
Gradescope's schema included."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from qkv.check._sandbox import choose
from qkv.cli import main
from tests.grade.class_maker import Row, write_attention_class
from tests.grade.schemas import check_gradescope_results

# the names grades.csv gives the students whose file names are not plain
_NAMES = {
    "Zoë Ånström": "Zoë_Ånström",
    "=HYPERLINK(evil)": "HYPERLINK_evil",
    "<script>alert(1)</script>": "script_alert_1__script",
    "report.pdf": "report.pdf",
}

# The time limit of each student's code. Two students never finish (a busy loop, a sleep at
# import) and each holds one of the two jobs for the whole limit, the loop a core too: the
# default of 20 s cost the class 40 s of a job. Every other student gets the same grade with
# a limit of 1 s (measured on a 2-core machine at load 2): 8 s leaves room for a loaded one.
TIMEOUT_S = 8


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Row], Path]:
    root = tmp_path_factory.mktemp("teacher")
    canary = root / "teachers_notes.txt"
    canary.write_text("the teacher's own file\n")
    expected = write_attention_class(root / "submissions", canary)
    out = root / "grades"
    os.environ["QKV_TEACHER_SECRET"] = "do not leak"
    try:
        status = main(
            [
                "grade", str(root / "submissions"), "-o", str(out),
                "--jobs", "2", "--timeout", str(TIMEOUT_S),
            ]
        )  # fmt: skip
    finally:
        del os.environ["QKV_TEACHER_SECRET"]
    assert status == 0
    return out, expected, canary


@pytest.mark.slow
def test_every_row_of_grades_csv(graded: tuple[Path, dict[str, Row], Path]) -> None:
    out, expected, _ = graded
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["student", "score", "max_score", "status", "first_slip", "slips"]
    got = {r[0]: r[1:] for r in rows[1:]}
    assert len(rows) - 1 == len(expected) >= 45
    want = {
        _NAMES.get(name, name): [f"{score:g}", "5", status, first, slips]
        for name, (_, score, status, first, slips) in expected.items()
    }
    assert got == want


@pytest.mark.slow
def test_the_hostile_class_touched_nothing_of_the_teachers(
    graded: tuple[Path, dict[str, Row], Path],
) -> None:
    out, _, canary = graded
    if choose("auto") != "bubblewrap":
        pytest.skip("only bubblewrap keeps a student's code from the teacher's files")
    assert canary.read_text() == "the teacher's own file\n"
    assert sorted(p.name for p in out.iterdir() if p.suffix not in (".json", ".md")) == [
        ".qkv-grade-files",  # the list of this run's files (a later --overwrite reads it)
        "class.html",
        "grades.csv",
    ]


@pytest.mark.slow
def test_every_student_has_gradescope_json_and_feedback(
    graded: tuple[Path, dict[str, Row], Path],
) -> None:
    out, expected, _ = graded
    for name, (_, score, status, first, _) in expected.items():
        student = _NAMES.get(name, name)
        data = json.loads((out / f"{student}.json").read_text(encoding="utf-8"))
        check_gradescope_results(data)
        assert data["score"] == score
        assert data["extra_data"]["qkv"]["status"] == status
        feedback = (out / f"{student}.md").read_text(encoding="utf-8")
        assert f"Score: **{score:g} / 5**" in feedback
        if first and first != "unrecognised":
            assert f"`{first}`" in feedback
        if status == "timeout":
            assert f"did not finish within {TIMEOUT_S} s (an infinite loop?)" in feedback
    # the student's own text reaches the files escaped
    raised = (out / "broken_raises.md").read_text(encoding="utf-8")
    assert "\x1b" not in raised and "\\x1b" in raised and "<b>" not in raised
    slipped = (out / "slip_unscaled.md").read_text(encoding="utf-8")
    assert "The scores are not divided by √d_k before the softmax" in slipped
    assert "| correct | 1.0845 | 1.3332 | 0.0848 |" in slipped


@pytest.mark.slow
def test_class_page_counts_and_escapes(graded: tuple[Path, dict[str, Row], Path]) -> None:
    out, expected, _ = graded
    page = (out / "class.html").read_text(encoding="utf-8")
    assert "<script>alert" not in page and "&lt;b&gt;bold" in page
    assert page.count('<details id="student-') == len(expected)
    unscaled = sum(1 for row in expected.values() if "unscaled" in row[4].split(";"))
    assert f"<td><code>unscaled</code></td><td class=n>{unscaled}</td>" in page
