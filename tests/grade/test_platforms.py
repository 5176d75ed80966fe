"""One submission graded as Gradescope and PrairieLearn grade it (alone, one at a time), and
the teacher's own words per slip (``--feedback``).

A submission graded alone has the assignment's parts and total, the ones it has in a class:
a function without the mask argument loses the mask part, a syntax error scores 0 of every
part, each with its reason. The files are checked against each platform's documented schema
(``tests/grade/schemas.py`` cites them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qkv.cli import main
from tests.grade.class_maker import RIGHT, _attention
from tests.grade.schemas import check_gradescope_results, check_prairielearn_results
from tests.grade.test_grading_docs import block

NO_MASK = (
    "import numpy as np\n"
    "def attention(Q, K, V):\n"
    "    s = Q @ K.T / np.sqrt(Q.shape[-1])\n"
    "    w = np.exp(s - s.max(-1, keepdims=True))\n"
    "    return w / w.sum(-1, keepdims=True) @ V\n"
)
CLASS = {
    "right.py": RIGHT,
    "unscaled.py": _attention(scale=""),
    "no_mask.py": NO_MASK,
    "broken.py": "def attention(Q, K, V, mask=None)\n    return Q\n",
    "html.py": "def attention(Q, K, V, mask=None):\n"
    "    raise ValueError('<img src=x onerror=alert(1)> <b>bold</b>')\n",
}
PARTS = [
    "scores: Q·Kᵀ",
    "scaling: scores / √d_k",
    "mask: a masked key gets weight 0",
    "softmax: each row of weights sums to 1",
    "weighted sum: context = weights·V",
]


def _write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def _tests(data: dict[str, Any]) -> list[tuple[str, float, float]]:
    return [(t["name"], t["score"], t["max_score"]) for t in data["tests"]]


@pytest.fixture(scope="module")
def class_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("class")
    _write(root / "class", CLASS)
    assert main(["grade", str(root / "class"), "-o", str(root / "out"), "-j", "2"]) == 0
    return {
        name.removesuffix(".py"): json.loads((root / "out" / f"{name[:-3]}.json").read_text())
        for name in CLASS
    }


def _run_autograder(root: Path, code: str) -> dict[str, Any]:
    """Gradescope's run: the student's file in /autograder/submission, the documented
    run_autograder script (docs/grading.md), /autograder/results/results.json out."""
    shutil.rmtree(root, ignore_errors=True)
    _write(root / "submission", {"attention.py": code})
    (root / "results").mkdir()
    script = root / "run_autograder"
    script.write_text(block("run_autograder").replace("/autograder", str(root)))
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": path}, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = (root / "results" / "results.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    check_gradescope_results(data)
    return data


@pytest.mark.slow
def test_run_autograder_one_at_a_time_gives_the_parts_and_total_of_the_class(
    tmp_path: Path, class_json: dict[str, dict[str, Any]]
) -> None:
    graded_alone = {}  # one run_autograder per student: a run is a process, seconds apiece
    for name, code in CLASS.items():
        student = name.removesuffix(".py")
        alone = graded_alone[name] = _run_autograder(tmp_path / "autograder", code)
        in_class = class_json[student]
        check_gradescope_results(in_class)
        assert [t[0] for t in _tests(alone)] == PARTS, student
        assert _tests(alone) == _tests(in_class), student
        assert alone["score"] == in_class["score"], student
        assert sum(t["max_score"] for t in alone["tests"]) == 5, student
    # the function without a mask argument: the mask part is the assignment's, at 0
    alone = graded_alone["no_mask.py"]
    mask = next(t for t in alone["tests"] if t["name"].startswith("mask"))
    assert (alone["score"], mask["score"]) == (4.0, 0.0)
    assert "does not take what this part needs (the mask argument)" in mask["output"]
    # a syntax error: every part of the assignment, each 0 with the reason
    broken = graded_alone["broken.py"]
    assert [t["score"] for t in broken["tests"]] == [0.0] * 5
    assert all("SyntaxError" in t["output"] or "syntax" in t["output"] for t in broken["tests"])


def test_a_rubric_that_gives_the_mask_points_keeps_the_part_for_a_submission_alone(
    tmp_path: Path,
) -> None:
    rubric = tmp_path / "rubric.yaml"
    rubric.write_text("points: {mask: 3}\n")
    _write(tmp_path / "submission", {"attention.py": NO_MASK})
    out = tmp_path / "results"
    argv = ["grade", str(tmp_path / "submission"), "--format", "gradescope", "-o", str(out)]
    assert main([*argv, "--rubric", str(rubric)]) == 0
    data = json.loads((out / "results.json").read_text())
    check_gradescope_results(data)
    assert (data["score"], sum(t["max_score"] for t in data["tests"])) == (4.0, 7.0)
    assert ("mask: a masked key gets weight 0", 0.0, 3.0) in _tests(data)


def test_results_json_says_its_outputs_are_text_so_a_students_html_stays_text(
    class_json: dict[str, dict[str, Any]],
) -> None:
    data = class_json["html"]
    check_gradescope_results(data)  # output_format and every test's are "text"
    assert data["output_format"] == "text"
    assert "<img src=x onerror=alert(1)>" in data["output"]  # shown as text, not run
    assert data["tests"][0]["output_format"] == "text"


@pytest.mark.slow
def test_prairielearn_results_for_one_submission(tmp_path: Path) -> None:
    def grade(code: str) -> dict[str, Any]:
        student = _write(tmp_path / "grade" / "student", {"attention.py": code})
        out = tmp_path / "grade" / "results"
        argv = ["grade", str(student), "--format", "prairielearn", "-o", str(out)]
        assert main(argv) == 0
        data = check_prairielearn_results((out / "results.json").read_text(encoding="utf-8"))
        assert [t["name"] for t in data["tests"]] == PARTS
        shutil.rmtree(tmp_path / "grade")
        return data

    right = grade(RIGHT)
    assert (right["gradable"], right["score"]) == (True, 1.0)
    assert all(p["score"] == 1.0 for p in right["partial_scores"].values())
    unscaled = grade(_attention(scale=""))
    assert unscaled["score"] == pytest.approx(0.8)
    assert unscaled["partial_scores"]["scaling"]["score"] == 0.0
    assert unscaled["partial_scores"]["scaling"]["feedback"].startswith("slip unscaled:")
    assert unscaled["qkv"]["first_slip"] == "unscaled"
    no_mask = grade(NO_MASK)
    assert no_mask["score"] == pytest.approx(0.8)
    assert "mask argument" in no_mask["partial_scores"]["mask"]["feedback"]
    # a syntax error is PrairieLearn's "invalid, not gradable": no attempt is used
    broken = grade(CLASS["broken.py"])
    assert broken["gradable"] is False
    assert "attention.py" in broken["format_errors"][0]
    assert [t["points"] for t in broken["tests"]] == [0.0] * 5


def test_the_teachers_words_reach_every_student_with_that_slip(tmp_path: Path) -> None:
    folder = _write(
        tmp_path / "class",
        {"ada.py": _attention(scale=""), "bo.py": _attention(scale=""), "cy.py": RIGHT},
    )
    words = tmp_path / "words.yaml"
    words.write_text(
        "unscaled: |\n  We divide by √d_k so that the softmax does not saturate:\n"
        "  lecture 4, slide 12.\nsoftmax-wrong-axis: Each query's row sums to 1.\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "-j", "2", "--feedback", str(words)]
    assert main(argv) == 0
    said = "We divide by √d_k so that the softmax does not saturate: lecture 4, slide 12."
    for student in ("ada", "bo"):
        assert f"> From your teacher: {said}" in (out / f"{student}.md").read_text()
        data = json.loads((out / f"{student}.json").read_text())
        scaling = next(t for t in data["tests"] if t["name"].startswith("scaling"))
        assert f"from your teacher: {said}" in scaling["output"]
    assert "From your teacher" not in (out / "cy.md").read_text()
    assert "Each query's row" not in (out / "ada.md").read_text()  # a slip they did not make


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("unscalled: See lecture 4.\n", "line 1: unscalled: unknown slip code 'unscalled'. "
         "Hint: did you mean 'unscaled'?"),
        ("unscaled: &a See lecture 4.\nmask-ignored: *a\n", "an alias (*name)"),
        ("unscaled: [1, 2]\n", "line 1: unscaled: expected the text the students"),
        ("unscaled: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
        ("unscaled: x\nunscaled: y\n", "duplicate key 'unscaled'"),
    ],
)  # fmt: skip
def test_a_feedback_file_is_hostile_yaml_and_a_mistake_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    words = tmp_path / "words.yaml"
    words.write_text(text)
    _write(tmp_path / "class", {"ada.py": RIGHT})
    argv = ["grade", str(tmp_path / "class"), "-o", str(tmp_path / "out")]
    assert main([*argv, "--feedback", str(words)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: --feedback ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_prairielearn_entrypoint_of_the_docs_writes_the_results_it_reads(
    tmp_path: Path,
) -> None:
    root = tmp_path / "grade"
    _write(root / "student", {"attention.py": _attention(scale="")})
    script = root / "run.sh"
    script.write_text(block("prairielearn").replace("/grade", str(root)))
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": path}, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = check_prairielearn_results((root / "results" / "results.json").read_text())
    assert data["score"] == pytest.approx(0.8) and data["qkv"]["first_slip"] == "unscaled"


# A single head without an output projection, in the style of Karpathy's "Let's build GPT"
# (karpathy/ng-video-lecture, gpt.py: class Head(head_size), the global n_embd, a causal
# tril buffer, scaled by head_size ** -0.5); written here, not copied.
_HEAD = """\
import torch
import torch.nn as nn
from torch.nn import functional as F

n_embd = 16
block_size = 32


class Head(nn.Module):
    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * SCALE
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        return wei @ self.value(x)
"""


@pytest.mark.slow
def test_a_single_head_class_is_graded_with_kind_attention_and_class(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    folder = _write(
        tmp_path / "class",
        {
            "ada.py": _HEAD.replace("SCALE", "k.shape[-1] ** -0.5"),
            "bo.py": _HEAD.replace("SCALE", "C ** -0.5"),  # the model's width, not the head's
        },
    )
    out = tmp_path / "out"
    argv = ["grade", str(folder), "-o", str(out), "-j", "2", "--kind", "attention"]
    assert main([*argv, "--class", "Head"]) == 0
    rows = [line.split(",") for line in (out / "grades.csv").read_text().splitlines()[1:]]
    assert rows[0][:4] == ["ada", "5", "5", "ok"]
    assert rows[1][:4] == ["bo", "4", "5", "slip"]
    data = json.loads((out / "bo.json").read_text())
    assert [t["name"] for t in data["tests"]] == PARTS
    assert next(t for t in data["tests"] if t["name"].startswith("scaling"))["score"] == 0.0
