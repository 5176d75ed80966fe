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


@pytest.mark.slow
def test_a_class_of_flash_submissions_is_graded_slip_by_slip(tmp_path: Path) -> None:
    folder = tmp_path / "class"
    folder.mkdir()
    for code in students.SUBMISSIONS:
        (folder / f"{code or 'right'}.py").write_text(_file(code), encoding="utf-8")
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "--kind", "flash"]
    assert main([*argv, "--function", "FlashAttention", "--jobs", "2"]) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = {r["student"]: r for r in csv.DictReader(handle)}
    assert rows["right"]["score"] == rows["right"]["max_score"] == "4"
    assert rows["right"]["status"] == "ok"
    for code in GRADED_CODES:
        row = rows[code]
        assert (row["status"], row["first_slip"]) == ("slip", code), code
        graded = json.loads((out / f"{code}.json").read_text(encoding="utf-8"))
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


_DOC = Path(__file__).resolve().parents[2] / "docs" / "flash.md"
_WHO = {"ada": "", "bo": "flash-no-rescale", "cy": "flash-causal-offset", "dee": "flash-backward-D"}


@pytest.mark.slow
def test_the_guides_class_grades_as_shown(tmp_path: Path) -> None:
    """docs/flash.md's "Grading a FlashAttention assignment": its grades.csv is what the
    command writes for its four students."""
    text = _DOC.read_text(encoding="utf-8").split("## Grading a FlashAttention assignment")[1]
    shown = text.split("$ cat graded/grades.csv\n")[1].split("```")[0]
    folder = tmp_path / "submissions"
    folder.mkdir()
    for student, code in _WHO.items():
        (folder / f"{student}.py").write_text(_file(code), encoding="utf-8")
    out = tmp_path / "graded"
    argv = ["grade", str(folder), "--kind", "flash", "--function", "FlashAttention"]
    assert main([*argv, "-o", str(out), "--jobs", "2"]) == 0
    assert (out / "grades.csv").read_text(encoding="utf-8") == shown
    assert "| ✗ forward output: O = softmax(QKᵀ/√d)·V, block by block | 0 / 1 |" in text
    assert "| ✗ forward output: O = softmax(QKᵀ/√d)·V, block by block | 0 / 1 |" in (
        out / "bo.md"
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
