"""The layouts teachers upload: a student's folder with helper modules, a zip whose only
top folder holds the class, Gradescope's, Canvas's and Moodle's exports (the students named,
their ids kept), every entry a row or a line saying why not, an output folder that holds
only this run's files, and a zip whose entries cannot be unpacked here named in one line.

The export formats, as the platforms write them:

- Gradescope: a folder ``submission_NNN`` per submission and ``submission_metadata.yml``
  mapping each folder to ``:submitters``, each with ``:name``, ``:sid`` and ``:email``
  (read so by otter-grader: ucbds-infra/otter-grader, ``otter/grade/metadata.py``,
  ``GradescopeParser``);
- Canvas: "a student name, two id fields", "an extra field if the assignment was submitted
  late", and "a number ... added at the end of the filename, but before the file extension"
  when handed in again (TimHanneman/Canvas_submission_sort, ``README.md``):
  ``lastfirst[_late]_USERID_SUBMISSIONID_name[-N].py``;
- Moodle: a folder ``First Last_participantId_assignsubmission_file_`` per student (a
  feedback-upload guide in the code corpus), or the files themselves with that prefix, and
  ``..._assignsubmission_onlinetext_`` for the online text.
"""

from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.grade._archive import ArchiveError, extract
from qkv.grade._submissions import collect
from tests.grade.class_maker import RIGHT, _attention

_SOFTMAX = """import numpy as np


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
"""
_USES_HELPER = """import numpy as np
from {module} import softmax


def attention(Q, K, V, mask=None):
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -1e9)
    return softmax(s) @ V
"""


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def _grade(source: Path, out: Path, *options: str) -> list[list[str]]:
    assert main(["grade", str(source), "-o", str(out), "-j", "2", *options]) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


@pytest.mark.slow
def test_a_folder_with_helper_modules_is_graded_on_the_file_that_defines_the_function(
    tmp_path: Path,
) -> None:
    root = _write(
        tmp_path / "class",
        {
            "ada/attention.py": _USES_HELPER.format(module="helpers"),
            "ada/helpers.py": _SOFTMAX,
            # the answer in a file of another name, a helper package, an unrelated module
            "bo/solution.py": _USES_HELPER.format(module="mylib.ops"),
            "bo/mylib/__init__.py": "",
            "bo/mylib/ops.py": _SOFTMAX,
            "bo/notes.py": "TODO = 'tidy up'\n",
            # two files that both define it: the student is asked which is the answer
            "cy/attention.py": RIGHT,
            "cy/attention_old.py": RIGHT,
        },
    )
    rows = _grade(root, tmp_path / "out")
    assert rows[1:] == [
        ["ada", "5", "5", "ok", "", ""],
        ["bo", "5", "5", "ok", "", ""],
        ["cy", "0", "5", "error", "", ""],
    ]
    said = (tmp_path / "out" / "cy.md").read_text()
    assert "2 files define 'attention' (attention.py, attention_old.py)" in said
    assert "--" not in said.split("Score:")[1]  # the student reads no option of qkv's


@pytest.mark.slow
def test_a_zip_whose_only_top_folder_holds_the_class_is_unwrapped(tmp_path: Path) -> None:
    source = tmp_path / "class.zip"
    with zipfile.ZipFile(source, "w") as archive:  # as 'zip -r class.zip export/' makes it
        archive.writestr("export/", b"")
        archive.writestr("export/ada.py", RIGHT)
        archive.writestr("export/bo.py", _attention(scale=""))
        archive.writestr("export/cy/attention.py", RIGHT)
    rows = _grade(source, tmp_path / "out")
    assert [r[:4] for r in rows[1:]] == [
        ["ada", "5", "5", "ok"],
        ["bo", "4", "5", "slip"],
        ["cy", "5", "5", "ok"],
    ]


def test_one_students_zipped_folder_with_a_helper_is_not_unwrapped(tmp_path: Path) -> None:
    source = tmp_path / "ada.zip"
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr("ada/attention.py", _USES_HELPER.format(module="helpers"))
        archive.writestr("ada/helpers.py", _SOFTMAX)
    (found,) = collect(source, tmp_path / "work", defines="attention")
    assert (found.student, found.form) == ("ada", "code")
    assert found.path is not None and found.path.name == "attention.py"


_METADATA = """\
submission_111:
  :submitters:
  - :name: Ada Lovelace
    :sid: '12345'
    :email: ada@example.edu
  :created_at: 2026-03-01 10:00:00.000000000 -08:00
  :score:
submission_112:
  :submitters:
  - :name: Bo Chen
    :sid: '67890'
    :email: bo@example.edu
  - :name: Cy Diaz
    :sid: '24680'
    :email: cy@example.edu
  :created_at: 2026-03-01 11:00:00.000000000 -08:00
"""


@pytest.mark.slow
def test_students_are_named_by_their_platforms_export_and_their_ids_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gradescope = tmp_path / "gradescope.zip"
    with zipfile.ZipFile(gradescope, "w") as archive:
        archive.writestr("assignment_1_export/submission_metadata.yml", _METADATA)
        archive.writestr("assignment_1_export/submission_111/attention.py", RIGHT)
        archive.writestr("assignment_1_export/submission_112/attention.py", _attention(scale=""))
        archive.writestr("assignment_1_export/submission_113/attention.py", RIGHT)  # no entry
    rows = _grade(gradescope, tmp_path / "gs")
    assert rows[0] == ["student", "score", "max_score", "status", "first_slip", "slips", "id"]
    assert [(r[0], r[1], r[6]) for r in rows[1:]] == [
        ("Ada_Lovelace", "5", "12345"),
        ("Bo_Chen_Cy_Diaz", "4", "67890;24680"),
        ("submission_113", "5", ""),
    ]
    assert "skipped submission_metadata.yml" in capsys.readouterr().err

    canvas = _write(
        tmp_path / "canvas",
        {
            "lovelaceada_12345_67890_attention.py": RIGHT,
            # late, and two files: one submission, the helper importable under its own name
            "chenbo_late_23456_78901_attention.py": _USES_HELPER.format(module="helpers"),
            "chenbo_late_23456_78902_helpers.py": _SOFTMAX,
            # handed in again: Canvas numbers the file
            "diazcy_34567_89012_attention-1.py": _attention(scale=""),
        },
    )
    rows = _grade(canvas, tmp_path / "cv")
    assert [(r[0], r[1], r[3], r[6]) for r in rows[1:]] == [
        ("chenbo", "5", "ok", "23456"),
        ("diazcy", "4", "slip", "34567"),
        ("lovelaceada", "5", "ok", "12345"),
    ]

    moodle = _write(
        tmp_path / "moodle",
        {
            "Ada Lovelace_123456_assignsubmission_file_/attention.py": RIGHT,
            "Ada Lovelace_123456_assignsubmission_onlinetext_/onlinetext.html": "<p>hi</p>",
            "Bo Chen_234567_assignsubmission_file_attention.py": _attention(scale=""),
        },
    )
    rows = _grade(moodle, tmp_path / "md")
    assert [(r[0], r[1], r[6]) for r in rows[1:]] == [
        ("Ada_Lovelace", "5", "123456"),
        ("Bo_Chen", "4", "234567"),
    ]
    assert "Moodle's online text" in capsys.readouterr().err
    # a plain folder of files has no ids: grades.csv keeps its columns
    plain = _grade(_write(tmp_path / "plain", {"ada.py": RIGHT}), tmp_path / "pl")
    assert plain[0] == ["student", "score", "max_score", "status", "first_slip", "slips"]


def test_every_entry_is_a_row_or_a_line_saying_why_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0\n")
    root = _write(
        tmp_path / "class",
        {".ada.py": RIGHT, "bo.py": RIGHT, ".DS_Store": "", "__MACOSX/._bo.py": ""},
    )
    (root / "cy.py").symlink_to(secret)
    (root / "dee.yaml").symlink_to(secret)
    rows = _grade(root, tmp_path / "out")
    assert [r[:4] for r in rows[1:]] == [
        ["ada", "5", "5", "ok"],
        ["bo", "5", "5", "ok"],
        ["cy", "0", "5", "error"],
        ["dee", "0", "5", "error"],
    ]
    err = capsys.readouterr().err
    assert "qkv: skipped .DS_Store: macOS's folder settings, not a submission" in err
    assert "qkv: skipped __MACOSX: macOS's zip metadata, not a submission" in err
    for student, name in (("cy", "cy.py"), ("dee", "dee.yaml")):
        said = (tmp_path / "out" / f"{student}.md").read_text()
        assert f"{name}: is a link" in said and str(secret) not in said
    # one student's link, graded alone, is named by its own name too
    out = tmp_path / "alone"
    assert main(["grade", str(root / "cy.py"), "--format", "gradescope", "-o", str(out)]) == 0
    text = (out / "results.json").read_text()
    assert "cy.py: is a link" in text and str(secret) not in text


def test_the_output_folder_holds_only_this_runs_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path / "class", {"ada.py": RIGHT, "bo.py": RIGHT})
    out = tmp_path / "out"
    _grade(root, out)
    # bo leaves the class; grading again into the same folder needs --overwrite ...
    (root / "bo.py").unlink()
    capsys.readouterr()
    assert main(["grade", str(root), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err and err.count("\n") == 1
    # ... which removes bo's feedback: it would have been handed out with the grades
    _grade(root, out, "--overwrite")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "ada.json",
        "ada.md",
        "class.html",
        "grades.csv",
    ]
    # a file no run of qkv wrote is never removed: the run refuses, before any grading
    (out / "my-notes.txt").write_text("keep me")
    assert main(["grade", str(root), "-o", str(out), "--overwrite"]) == 2
    assert "holds 'my-notes.txt', which no earlier qkv grade wrote" in capsys.readouterr().err
    assert (out / "my-notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"ab/" + "x" * 300 + "/attention.py": "x"}, "cannot be unpacked"),
        ({"ada.py": "x", "ada.py/attention.py": "y"}, "needs a folder where the zip has a file"),
        ({"ada/": "", "ada": "y"}, "is a file where the zip also has a folder of that name"),
    ],
)
def test_an_entry_that_cannot_be_unpacked_here_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entries: dict[str, str], message: str
) -> None:
    source = tmp_path / "class.zip"
    with zipfile.ZipFile(source, "w") as archive:
        for name, text in entries.items():
            archive.writestr(name, text)
    with pytest.raises(ArchiveError, match=message):
        extract(source, tmp_path / "unpacked")
    assert not (tmp_path / "unpacked").exists()
    assert main(["grade", str(source), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: class.zip: the entry '") and err.count("\n") == 1
    assert message in err and "Traceback" not in err and "qkv-grade-" not in err
    assert len(err) < 400
