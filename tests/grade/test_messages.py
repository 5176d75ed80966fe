"""What a teacher and a student read: a note is never taken for an earlier slip, a hand-in's
mistake is on its own lines, a rubric that grades nothing and a deeply nested one are one
line, the class page keeps line breaks, the counts read right, an empty zip is refused, the
student reads no option of qkv's command line, and the check commands point the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.grade import RubricError, parse_rubric
from tests.grade.class_maker import RIGHT, _attention

_INPUTS = """\
name: I love statistics
tokens: [I, love, statistics]
embeddings: [[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]]
weights:
  W_q: [[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]]
  W_k: [[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]]
  W_v: [[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]]
options: {queries: [love]}
"""


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.slow
def test_a_note_is_no_earlier_slip_and_its_advice_fits_the_students_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "class"
    folder.mkdir()
    # right, but a fully masked row comes out NaN (-inf fill): the masked-row-nan note
    (folder / "ada.py").write_text(_attention(mask="np.where(mask, s, -np.inf)"))
    out = tmp_path / "out"
    assert main(["grade", str(folder), "-o", str(out)]) == 0
    assert "graded 1 submission (1 ok" in capsys.readouterr().err
    data = json.loads((out / "ada.json").read_text())
    assert data["score"] == 5.0
    outputs = {t["name"].split(":")[0]: t["output"] for t in data["tests"]}
    assert outputs["mask"].startswith("note masked-row-nan:")
    assert "np.nan_to_num" in outputs["mask"]  # a NumPy student is told NumPy's function
    for part in ("softmax", "weighted sum"):
        assert outputs[part] == "Right.", outputs[part]  # no "follow-through credit"
    assert "follow-through" not in (out / "ada.md").read_text()


def test_a_hand_in_names_its_own_lines(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs.yaml"
    inputs.write_text(_INPUTS)
    folder = tmp_path / "handins"
    folder.mkdir()
    # three lines: a claim, and a key the inputs give too
    (folder / "ada.yaml").write_text(
        "claimed:\n  weights: {love: [0.3, 0.3, 0.4]}\noptions: {scale: false}\n"
    )
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "--kind", "example", "--inputs", str(inputs)]
    assert main(argv) == 0
    said = (out / "ada.md").read_text()
    assert "ada.yaml, line 3: options: the inputs of the assignment give 'options'" in said
    assert "line 11" not in said
    # graded on the parts of the inputs everyone used, as the others are
    assert (out / "grades.csv").read_text().splitlines()[1] == "ada,0,5,error,,"


def test_a_rubric_that_grades_nothing_or_nests_deeply_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "class").mkdir()
    (tmp_path / "class" / "ada.py").write_text(RIGHT)
    argv = ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "out"), "--rubric"]
    zero = tmp_path / "zero.yaml"
    zero.write_text(
        "points: {scores: 0, scaling: 0, mask: 0, softmax: 0, weighted-sum: 0}\n"
    )  # the five parts of kind attention; others keep 1 point, but not here
    err = _one_line([*argv, str(zero)], capsys)
    assert "are all worth 0, so every submission would be graded 0 / 0" in err
    deep = tmp_path / "deep.yaml"
    deep.write_text("points: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply to be a rubric" in _one_line([*argv, str(deep)], capsys)
    assert not (tmp_path / "out").exists()
    with pytest.raises(RubricError, match="every part is worth 0"):
        parse_rubric("points: {" + ", ".join(f"{p}: 0" for p in _all_parts()) + "}\n")


def _all_parts() -> tuple[str, ...]:
    from qkv.grade import PARTS

    return PARTS


@pytest.mark.slow
def test_the_class_page_keeps_each_slips_lines(tmp_path: Path) -> None:
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "bo.py").write_text(_attention(scale=""))
    (folder / "cy.py").write_text(RIGHT)
    out = tmp_path / "out"
    assert main(["grade", str(folder), "-o", str(out), "-j", "2"]) == 0
    page = (out / "class.html").read_text()
    assert "\\n" not in page  # no line break written out as backslash-n
    assert "The scores are not divided by √d_k" in page
    assert "\n  computed: " in page
    assert "2 submissions: 1 ok, 1 slip." in page


def test_an_empty_zip_or_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "class.zip"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("__MACOSX/", b"")
    err = _one_line(["grade", str(empty), "-o", str(tmp_path / "out")], capsys)
    assert "holds no submission" in err and "qkv-grade-" not in err
    (tmp_path / "none").mkdir()
    err = _one_line(["grade", str(tmp_path / "none"), "-o", str(tmp_path / "out")], capsys)
    assert "holds no submission (it is empty)" in err
    assert not (tmp_path / "out").exists()


def test_the_student_reads_no_option_of_qkvs_command_line(tmp_path: Path) -> None:
    folder = tmp_path / "class"
    (folder / "ada").mkdir(parents=True)
    (folder / "ada" / "main.py").write_text(RIGHT)
    (folder / "bo.py").write_text("x = 1\n")
    (folder / "cy.yaml").write_text("claimed: {}\n")
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "--file", "attention.py", "--kind", "example"]
    assert main(argv) == 0
    for student in ("ada", "bo", "cy"):
        said = (out / f"{student}.md").read_text() + (out / f"{student}.json").read_text()
        assert " --" not in said and "'--" not in said, (student, said)
    assert "the assignment asks for your code in attention.py" in (out / "ada.md").read_text()


def test_a_failing_assert_attention_shows_the_students_test_not_qkvs_lines(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_student.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            from qkv.testing import assert_attention

            def attention(Q, K, V):
                w = np.exp(Q @ K.T)
                return (w / w.sum(-1, keepdims=True)) @ V

            def test_attention():
                assert_attention(attention)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "test_student.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "assert_attention(attention)" in done.stdout
    assert "unscaled" in done.stdout
    assert "report = check_attention(" not in done.stdout  # qkv's own source stays hidden
    assert "qkv/testing.py" not in done.stdout


def test_the_check_commands_point_to_the_right_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    student = tmp_path / "student.py"
    student.write_text(RIGHT)
    err = _one_line(["check", "--module", str(student)], capsys)
    assert "--module must be FILE.py:CLASS" in err and "--function" not in err
    err = _one_line(["check", str(student)], capsys)
    assert f"to check code, use --function {student}:NAME" in err and "YAML" in err
    assert "line" not in err  # not a YAML parser's complaint
