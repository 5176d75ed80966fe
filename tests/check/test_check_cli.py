"""``qkv check`` on the command line: exit codes, formats, the JSON schema, 80 columns, golden.

The text report of seed 000 is pinned in ``tests/golden/check-i-love-statistics.txt``. After a
deliberate change of the report, regenerate it with::

    QKV_UPDATE_GOLDEN=1 .venv/bin/pytest tests/check/test_check_cli.py -k golden

and review the difference (``git diff tests/golden``) before committing it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from qkv.check import DIAGNOSES, STATUSES, check
from qkv.cli import main
from qkv.examples import CLAIMABLE, loads
from tests.check.test_check import A, C, K, Q, S, V, example_yaml

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "check-i-love-statistics.txt"
DOC = ROOT / "docs" / "check.md"


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich reads the width and colour from the environment: make both the defaults."""
    for name in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ")
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def correct_file(tmp_path: Path) -> Path:
    """A correct example printed with 2, 3 and 4 decimals."""
    path = tmp_path / "correct.yaml"
    claims = {
        "Q": {"cat": [f"{v:.2f}" for v in Q[0]]},
        "scores": {"cat": [f"{v:.3f}" for v in S[0]]},
        "weights": {"dog": [f"{v:.4f}" for v in A[1]]},
        "context": {"fish": [f"{v:.3f}" for v in C[2]]},
    }
    path.write_text(example_yaml(claims), encoding="utf-8")
    return path


# -- exit codes ------------------------------------------------------------------------------


def test_all_match_exits_0(capsys: pytest.CaptureFixture[str], correct_file: Path) -> None:
    status, out, err = run(capsys, "check", str(correct_file))
    assert status == 0, out
    assert "✓ All 4 claimed rows match." in out
    assert err == ""


def test_a_mistake_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", "--example", "i-love-statistics")
    assert status == 1
    assert "✗ first wrong step" in out


def test_example_option_takes_a_path(
    capsys: pytest.CaptureFixture[str], correct_file: Path
) -> None:
    status, _, _ = run(capsys, "check", "--example", str(correct_file))
    assert status == 0


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "tokens: [a, b]\nembeddings: [[1, 0], [0, 1]]\n"
            "weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}\n"
            "claimed:\n  scores: {a: [0.5]}\n",
            ["bad.yaml, line 5: claimed.scores.a: expected 2 numbers"],
        ),
        (
            "tokens: [a, b]\nembeddings: [[1, 0], [0, 1]]\n"
            "weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}\n"
            "claimed: {softmax: {a: [0.5, 0.5]}}\n",
            ["bad.yaml, line 4: claimed.softmax: unknown key 'softmax'", "did you mean 'weights'"],
        ),
        (
            "tokens: [a, b]\nembeddings: [[1, 0], [0, 1]]\n"
            "weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}\n"
            "claimed: {V: {c: [0.5]}}\n",
            ["line 4: claimed.V.c: unknown token 'c'"],
        ),
        ("tokens: [a, b\n", ["bad.yaml, line 2: not valid YAML"]),
    ],
)
def test_unusable_file_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    status, out, err = run(capsys, "check", str(path))
    assert status == 2
    assert out == ""  # nothing printed as a result
    line = one_line_error(err)
    for fragment in fragments:
        assert fragment in line


def test_missing_file_and_unknown_name_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "check", "no-such-file.yaml")
    assert (status, out) == (2, "")
    assert "no-such-file.yaml: no such file" in one_line_error(err)
    status, out, err = run(capsys, "check", "--example", "i-love-stats")
    assert (status, out) == (2, "")
    assert "did you mean 'i-love-statistics'" in one_line_error(err)


def test_file_and_example_or_neither_exit_2(
    capsys: pytest.CaptureFixture[str], correct_file: Path
) -> None:
    status, out, err = run(capsys, "check", str(correct_file), "--example", "two-heads")
    assert (status, out) == (2, "")
    assert "not both" in one_line_error(err)
    status, out, err = run(capsys, "check")
    assert (status, out) == (2, "")
    assert "qkv check --example i-love-statistics" in one_line_error(err)


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", "--help")
    assert status == 0
    assert "qkv check --example i-love-statistics" in out.split("Examples:")[1]
    assert all(len(line) <= 80 for line in out.splitlines())


# -- formats ---------------------------------------------------------------------------------


def test_json_schema_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", "--example", "i-love-statistics", "--format", "json")
    assert status == 1
    data = json.loads(out)
    assert set(data) == {"ok", "findings"}
    assert data["ok"] is False
    keys = {"step", "token", "claimed", "expected", "status", "diagnosis", "message"}
    for finding in data["findings"]:
        assert set(finding) == keys
        assert finding["step"] in CLAIMABLE
        assert isinstance(finding["token"], str)
        assert all(isinstance(x, float) for x in finding["claimed"] + finding["expected"])
        assert len(finding["claimed"]) == len(finding["expected"])
        assert finding["status"] in STATUSES
        assert finding["diagnosis"] is None or finding["diagnosis"] in DIAGNOSES
        assert isinstance(finding["message"], str) and finding["message"]
        assert "\n" not in finding["message"]
    assert data["findings"][0] == {
        "step": "Q",
        "token": "love",
        "claimed": [0.59, 0.78],
        "expected": [0.5, 0.8],
        "status": "mismatch",
        "diagnosis": "arithmetic",
        "message": "No common slip gives these numbers: an arithmetic mistake (0.59 should be "
        '0.50; 0.78 should be 0.80). The query vector of "love" is its embedding times W_q: '
        "q_love = x_love·W_q = [0.50, 0.80].",
    }
    last = data["findings"][-1]
    assert (last["step"], last["token"], last["diagnosis"]) == (
        "context",
        "statistics",
        "context-not-summed",
    )
    assert last["expected"] == [0.538635, 0.819563]  # softmax(q_statistics·Kᵀ/√2)·V


def test_json_status_and_diagnosis_agree() -> None:
    """ok and consequential have no diagnosis, a note is 'rounding', a mismatch has a code."""
    wrong_q = Q[0] + [0.1, 0.0]
    truncated = [int(v * 1e4) / 1e4 for v in A[1]]
    text = example_yaml(
        {
            "Q": {0: wrong_q},
            "V": {2: V[2]},
            "scores": {0: wrong_q @ K.T},
            "weights": {1: truncated},
        }
    )
    data = json.loads(check(loads(text)).to_json())
    got = [(f["step"], f["status"], f["diagnosis"]) for f in data["findings"]]
    assert got == [
        ("Q", "mismatch", "digit-slip"),  # 0.9600 for 0.8600: one digit wrong
        ("V", "ok", None),
        ("scores", "consequential", None),
        ("weights", "note", "rounding"),
    ]
    assert data["ok"] is False


def test_markdown(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    path.write_text(
        example_yaml({"Q": {0: Q[2]}}, tokens=("a|b", "c", "d")).replace("[a|b,", '["a|b",'),
        encoding="utf-8",
    )
    status, out, _ = run(capsys, "check", str(path), "-f", "markdown")
    assert status == 1
    assert out.startswith("# qkv check: pipe\n")
    assert "## Q · Query vectors (first wrong step)" in out
    assert "**✗ a\\|b · mismatch: wrong-query · line 11**" in out
    assert "| printed | **" in out and "| correct | " in out


def test_output_file_is_written_atomically(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "report.md"
    status, out, err = run(
        capsys, "check", "-e", "i-love-statistics", "-f", "markdown", "-o", str(target)
    )
    assert status == 1  # the exit code still says that something is wrong
    assert out == ""
    assert f"qkv: wrote {target}" in err
    assert target.read_text(encoding="utf-8") == check("i-love-statistics").markdown()
    missing = tmp_path / "no-such-folder" / "r.txt"
    status, out, err = run(capsys, "check", "-e", "i-love-statistics", "-o", str(missing))
    assert status == 2
    assert "does not exist" in one_line_error(err)
    assert not missing.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


# -- 80 columns ------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [40, 60, 80, 100])
def test_text_fits_the_width(capsys: pytest.CaptureFixture[str], width: int) -> None:
    status, out, _ = run(capsys, "check", "-e", "i-love-statistics", "--width", str(width))
    assert status == 1
    assert max(len(line) for line in out.splitlines()) <= width
    assert "first wrong step" in out


def test_columns_environment_sets_the_width(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    _, out, _ = run(capsys, "check", "-e", "i-love-statistics")
    lines = out.splitlines()
    assert max(len(line) for line in lines) == 80  # the rules span the whole width
    monkeypatch.setenv("COLUMNS", "64")
    _, out, _ = run(capsys, "check", "-e", "i-love-statistics")
    assert max(len(line) for line in out.splitlines()) == 64


def test_wide_score_rows_are_split_into_column_groups() -> None:
    from qkv.check import Report
    from qkv.check._report import Finding

    tokens = tuple(f"token{i}" for i in range(12))
    finding = Finding(
        step="weights",
        token="token0",
        position=0,
        claimed=(0.0833,) * 12,
        printed=("0.0833",) * 12,
        expected=(1 / 12,) * 12,
        status="note",
        diagnosis="rounding",
        message="m",
        marks=("rounding",) * 12,
    )
    text = Report("wide", None, tokens, (finding,)).text(width=80)
    assert "columns 1–" in text and "of 12" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.count("0.0833 ~") == 12


def test_terminal_output_has_colour() -> None:
    console = Console(
        width=80, force_terminal=True, color_system="standard", highlight=False, markup=False
    )
    with console.capture() as captured:
        check("i-love-statistics").print(console)
    coloured = captured.get()
    assert "\x1b[" in coloured
    plain = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    assert plain.splitlines()[0] == "qkv check: I love statistics (built-in i-love-statistics)"


# -- the golden report of seed 000 -----------------------------------------------------------


def test_golden_text_report_of_seed000(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "check", "--example", "i-love-statistics")
    assert status == 1
    if os.environ.get("QKV_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(out, encoding="utf-8")
    assert out == GOLDEN.read_text(encoding="utf-8")
    assert out == check("i-love-statistics").text(width=80)


def test_docs_show_the_golden_report() -> None:
    """docs/check.md shows seed 000's report exactly as qkv prints it."""
    doc = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```text\n(.*?)```", doc, flags=re.DOTALL)
    assert GOLDEN.read_text(encoding="utf-8") in blocks
