"""``qkv grade`` on the command line: its help, the teacher's mistakes in one line (exit 2),
Gradescope's run_autograder path (``--format gradescope``), hidden probes, and a rubric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkv.cli import _grade, main
from qkv.grade import KINDS
from tests.grade.class_maker import RIGHT, _attention
from tests.grade.schemas import check_gradescope_results


def test_the_kinds_of_help_are_the_registry() -> None:
    assert tuple(KINDS) == _grade._KINDS


def test_help_has_an_example_and_fits_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["grade", "--help"]) == 0
    out = capsys.readouterr().out
    assert "qkv grade submissions/ -o grades/" in out
    assert "RUNS the students' code" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_a_teachers_mistake_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "class").mkdir()
    (tmp_path / "file.txt").write_text("x")
    assert "give SUBMISSIONS and -o OUT" in _error(["grade"], capsys)
    assert "no such file or folder" in _error(
        ["grade", str(tmp_path / "nope"), "-o", str(tmp_path / "out")], capsys
    )
    assert "is a file; it must be a folder" in _error(
        ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "file.txt")], capsys
    )
    assert "does not exist. Hint: create it first" in _error(
        ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "a" / "b")], capsys
    )
    assert "--function must be a Python name" in _error(
        ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "out"), "--function", "a b"],
        capsys,
    )
    assert "--hidden hides probes of code" in _error(
        ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "o"), "--kind", "example",
         "--hidden"],
        capsys,
    )  # fmt: skip
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        "tokens: [a]\nembeddings: [[1.0]]\nweights: {W_q: [[1.0]], W_k: [[1.0]], W_v: [[1.0]]}\n"
        "claimed: {V: {a: [1.0]}}\n"
    )
    assert "claims numbers; it must hold only the inputs" in _error(
        ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "o"), "--inputs", str(claims)],
        capsys,
    )
    assert "must be a .yaml worked example" in _error(
        ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "o"), "--inputs", "x.json"],
        capsys,
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_gradescope_run_autograder_writes_results_json(tmp_path: Path) -> None:
    """What run_autograder runs: /autograder/submission in, /autograder/results/results.json
    out, in the schema Gradescope documents."""
    submission = tmp_path / "autograder" / "submission"
    submission.mkdir(parents=True)
    (submission / "attention.py").write_text(_attention(scale=""))
    results = tmp_path / "autograder" / "results"
    status = main(
        ["grade", str(submission), "--format", "gradescope", "-o", str(results), "--jobs", "1"]
    )
    assert status == 0
    assert sorted(p.name for p in results.iterdir()) == ["results.json"]
    data = json.loads((results / "results.json").read_text())
    check_gradescope_results(data)
    assert data["score"] == 4.0
    assert [(t["name"], t["score"], t["max_score"]) for t in data["tests"]] == [
        ("scores: Q·Kᵀ", 1.0, 1.0),
        ("scaling: scores / √d_k", 0.0, 1.0),
        ("mask: a masked key gets weight 0", 1.0, 1.0),
        ("softmax: each row of weights sums to 1", 1.0, 1.0),
        ("weighted sum: context = weights·V", 1.0, 1.0),
    ]
    assert data["tests"][1]["output"].startswith("slip unscaled: The scores are not divided")


@pytest.mark.slow
def test_hidden_probes_name_no_slip_to_the_student_but_to_the_teacher(tmp_path: Path) -> None:
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "ignores_mask.py").write_text(_attention(mask="s"))
    (folder / "unscaled.py").write_text(_attention(scale=""))
    (folder / "right.py").write_text(RIGHT)
    rubric = tmp_path / "rubric.yaml"
    rubric.write_text("points: {mask: 3, scaling: 2}\n")
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "--hidden", "--rubric", str(rubric), "-j", "2"]
    assert main(argv) == 0
    assert (out / "grades.csv").read_text().splitlines()[1:] == [
        "ignores_mask,5,8,slip,mask-ignored,mask-ignored",
        "right,8,8,ok,,",
        "unscaled,6,8,slip,unscaled,unscaled",
    ]
    # the mask slip shows on a hidden probe only: the student reads that a hidden probe failed
    hidden = (out / "ignores_mask.md").read_text()
    assert "A hidden probe failed at this step" in hidden
    assert "mask-ignored" not in hidden and "Lq=3" not in hidden
    data = json.loads((out / "ignores_mask.json").read_text())
    assert "mask-ignored" not in json.dumps(data)
    # the slip on the public probe is named, with its numbers
    assert "`unscaled`" in (out / "unscaled.md").read_text()
    # the teacher's page names both
    page = (out / "class.html").read_text()
    assert "<code>mask-ignored</code>" in page and "<code>unscaled</code>" in page


def test_a_failed_write_leaves_the_grades_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qkv import _io
    from qkv.grade import Grade, PartResult, write_class

    out = tmp_path / "grades"
    out.mkdir()
    grades = [Grade(n, "ok", (PartResult("scores", 1.0, 1.0),)) for n in ("ada", "bo", "cy")]
    write_class(out, grades[:1], title="the old grades")
    before = {p.name: p.read_text() for p in out.iterdir()}
    real = _io.write_atomic
    written: list[str] = []

    def full_disk(path: Path, text: str) -> None:
        if len(written) == 3:
            raise _io.WriteError(Path(path), OSError(28, "No space left on device"))
        written.append(str(path))
        real(path, text)

    monkeypatch.setattr(_io, "write_atomic", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_class(out, grades, title="t", overwrite=True)
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    monkeypatch.setattr(_io, "write_atomic", real)
    assert write_class(out, grades, title="t", overwrite=True)[-2:] == ["class.html", "grades.csv"]
    assert (out / "grades.csv").read_text().splitlines()[1:] == [
        "ada,1,1,ok,,",
        "bo,1,1,ok,,",
        "cy,1,1,ok,,",
    ]


def test_a_function_without_the_mask_argument_loses_the_mask_part(tmp_path: Path) -> None:
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "ada.py").write_text(RIGHT)
    (folder / "bo.py").write_text(RIGHT)
    (folder / "cy.py").write_text(
        "import numpy as np\ndef attention(Q, K, V):\n    s = Q @ K.T / np.sqrt(Q.shape[-1])\n"
        "    w = np.exp(s - s.max(-1, keepdims=True))\n"
        "    return w / w.sum(-1, keepdims=True) @ V\n"
    )
    out = tmp_path / "out"
    assert main(["grade", str(folder), "-o", str(out), "-j", "2"]) == 0
    assert (out / "grades.csv").read_text().splitlines()[1:] == [
        "ada,5,5,ok,,",
        "bo,5,5,ok,,",
        "cy,4,5,ok,,",
    ]
    tests = json.loads((out / "cy.json").read_text())["tests"]
    mask = next(t for t in tests if t["name"].startswith("mask"))
    assert mask["score"] == 0 and mask["output"].startswith("Not graded: the function does not")


def test_grading_twice_into_a_folder_inside_the_submissions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ada.py").write_text(RIGHT)
    monkeypatch.chdir(tmp_path)
    for again in ([], ["--overwrite"]):
        assert main(["grade", ".", "-o", "grades", "-j", "1", *again]) == 0
        assert (tmp_path / "grades" / "grades.csv").read_text().splitlines()[1:] == ["ada,5,5,ok,,"]
