"""``qkv grade --kind flash`` on a class of FlashAttention submissions (issue 37): every
slip of ``tests/check/flash_students.py`` handed in as its own file, run sandboxed, graded
on the parts forward output, log-sum-exp, causal and backward; the right one full marks."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.grade._parts import CODE_PARTS, FLASH_PARTS, PART_TITLES
from tests.check import flash_students as students

GRADED_CODES = frozenset(code for code in students.SUBMISSIONS if code)
"""The codes this class grades (the guard of tests/grade/test_kinds.py may read it)."""

_PART = {
    "unscaled": "flash-output",
    "scaled-by-dk": "flash-output",
    "causal-off-by-one": "flash-causal",
}


def _file(code: str) -> str:
    name, text = students.SUBMISSIONS[code]
    return text + ("" if name == "FlashAttention" else f"\nFlashAttention = {name}\n")


_DOC = Path(__file__).resolve().parents[2] / "docs" / "flash.md"
_WHO = {"ada": "", "bo": "flash-no-rescale", "cy": "flash-causal-offset", "dee": "flash-backward-D"}
# each student of the class by the code of the file handed in: the guide's four by their
# names (the guide's class is part of this one), the others by their code
_NAMES = {code: student for student, code in _WHO.items()}


def _student(code: str) -> str:
    return _NAMES.get(code, code)


@pytest.fixture(scope="module")
def flash_class(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every submission of tests/check/flash_students.py graded as one class, once for the
    tests of this file (each student is a sandboxed process of a second or more); the
    folder of the grades."""
    root = tmp_path_factory.mktemp("flash-class")
    folder = root / "class"
    folder.mkdir()
    for code in students.SUBMISSIONS:
        (folder / f"{_student(code)}.py").write_text(_file(code), encoding="utf-8")
    out = root / "graded"
    argv = ["grade", str(folder), "--kind", "flash", "--function", "FlashAttention"]
    assert main([*argv, "-o", str(out), "--jobs", "2"]) == 0
    return out


@pytest.mark.slow
def test_a_class_of_flash_submissions_is_graded_slip_by_slip(flash_class: Path) -> None:
    out = flash_class
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = {r["student"]: r for r in csv.DictReader(handle)}
    assert len(rows) == len(students.SUBMISSIONS)
    right = rows[_student("")]
    assert right["score"] == right["max_score"] == "4"
    assert right["status"] == "ok"
    for code in GRADED_CODES:
        row = rows[_student(code)]
        assert (row["status"], row["first_slip"]) == ("slip", code), code
        graded = json.loads((out / f"{_student(code)}.json").read_text(encoding="utf-8"))
        failed = [t["name"] for t in graded["tests"] if t["status"] == "failed"]
        part = _PART.get(code, CODE_PARTS[code])  # flash-raised: on n_q != n_k, not causal
        # a forward-only submission also gives no backward to grade: 0 for it, said so
        backward = next(t for t in graded["tests"] if t["name"] == PART_TITLES["flash-backward"])
        lost = [part]
        if "no backward of its own" in backward["output"] and part != "flash-backward":
            lost.append("flash-backward")
        assert failed == [PART_TITLES[p] for p in lost], code
        assert row["score"] == str(4 - len(lost)), code  # the other parts earned
        assert code in graded["output"]


def test_every_flash_code_costs_a_flash_part() -> None:
    for code in GRADED_CODES - set(_PART):
        assert CODE_PARTS[code] in FLASH_PARTS


@pytest.mark.slow
def test_the_guides_class_grades_as_shown(flash_class: Path) -> None:
    """docs/flash.md's "Grading a FlashAttention assignment": the rows of its four students
    in grades.csv are what it shows (graded in the class above, with the guide's command:
    a student's row depends on the student's file only)."""
    text = _DOC.read_text(encoding="utf-8").split("## Grading a FlashAttention assignment")[1]
    assert "$ qkv grade submissions/ --kind flash --function FlashAttention -o graded" in text
    shown = text.split("$ cat graded/grades.csv\n")[1].split("```")[0]
    lines = (flash_class / "grades.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    guides = [lines[0]] + [line for line in lines[1:] if line.split(",")[0] in _WHO]
    assert "".join(guides) == shown
    assert "| ✗ forward output: O = softmax(QKᵀ/√d)·V, block by block | 0 / 1 |" in text
    assert "| ✗ forward output: O = softmax(QKᵀ/√d)·V, block by block | 0 / 1 |" in (
        flash_class / "bo.md"
    ).read_text(encoding="utf-8")


def test_the_cs336_contract_grades_part_a_without_the_causal_part(tmp_path: Path) -> None:
    """CS336's part (a) lets is_causal be ignored and the backward wait: a submission that
    ignores it earns every point, and the grade has no causal and no backward part; a slip
    inside the contract still costs."""
    folder = tmp_path / "class"
    folder.mkdir()
    for code in ("flash-causal-ignored", "flash-no-rescale"):
        (folder / f"{code}.py").write_text(_file(code), encoding="utf-8")
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "--kind", "flash", "--contract", "cs336"]
    assert main([*argv, "--function", "FlashAttention", "--jobs", "2"]) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = {r["student"]: r for r in csv.DictReader(handle)}
    assert (rows["flash-causal-ignored"]["score"], rows["flash-causal-ignored"]["status"]) == (
        "2",
        "ok",
    )
    assert rows["flash-causal-ignored"]["max_score"] == "2"  # part (a): output and L
    assert rows["flash-no-rescale"]["first_slip"] == "flash-no-rescale"


def test_a_contract_goes_with_kind_flash_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ada.py").write_text("def attention(Q, K, V):\n    return V\n")
    assert main(["grade", str(tmp_path), "-o", str(tmp_path / "o"), "--contract", "cs336"]) == 2
    assert "--contract goes with --kind flash" in capsys.readouterr().err
