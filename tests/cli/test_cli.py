"""The ``qkv`` command: help, explain, examples, errors and atomic output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qkv
from qkv.cli import COMMANDS, main

WEIGHTED_SUM = "0.3046·v_I + 0.3387·v_love + 0.3567·v_statistics = [0.5385, 0.8193]"


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich reads the width and colour from the environment: make both the defaults."""
    for name in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


# -- help ------------------------------------------------------------------------------------


def test_no_arguments_prints_a_short_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys)
    assert status == 0
    assert "Examples:" in out and "qkv explain" in out and "qkv examples" in out
    assert len(out.splitlines()) < 40


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_subcommand_help_has_examples(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    status, out, _ = run_main(capsys, command, "--help")
    assert status == 0
    assert "Examples:" in out
    examples = out.split("Examples:")[1]
    assert f"qkv {command}" in examples


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "--version")
    assert status == 0
    assert out.strip() == f"qkv {qkv.__version__}"


def test_python_dash_m_qkv_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("qkv ")


# -- explain ---------------------------------------------------------------------------------


def test_explain_without_arguments_explains_the_first_builtin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run_main(capsys, "explain")
    assert status == 0, err
    assert out.startswith("I love statistics")
    assert "1.1160" in out and "0.3046" in out
    assert f"c_love = {WEIGHTED_SUM}" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_explain_format_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "explain", "--format", "json")
    assert status == 0
    trace = qkv.Trace.from_json(out)
    assert trace.tokens == ["I", "love", "statistics"]
    assert json.loads(out)["meta"]["queries"] == [1]


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("markdown", "| love | 0.3046 | 0.3387 | 0.3567 | 1.0000 |"),
        ("latex", r"\begin{tabular}"),
    ],
)
def test_explain_markdown_and_latex(
    capsys: pytest.CaptureFixture[str], fmt: str, expected: str
) -> None:
    status, out, _ = run_main(capsys, "explain", "--format", fmt)
    assert status == 0
    assert expected in out


def test_explain_options(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(
        capsys, "explain", "-e", "the-cat-sat-on-the-mat", "--query", "cat", "--causal",
        "--precision", "2", "--width", "60",
    )  # fmt: skip
    assert status == 0
    assert "c_cat = " in out and "c_The = " not in out
    assert "−∞" in out
    assert all(len(line) <= 60 for line in out.splitlines())

    status, out, _ = run_main(capsys, "explain", "--no-scale")
    assert status == 0
    assert "not scaled" in out

    status, out, _ = run_main(capsys, "explain", "--heads", "2")
    assert status == 0
    assert "Head 1 of 2 heads" in out


def test_explain_query_by_position(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "explain", "--query", "2")
    assert status == 0
    assert "c_statistics = " in out


def test_explain_example_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(
        "name: Two words\ntokens: [a_b, c]\nembeddings: [[1, 0], [0, 1]]\n"
        "weights: {W_q: [[1, 0], [0, 1]], W_k: [[1, 0], [0, 1]], W_v: [[1, 0], [0, 1]]}\n",
        encoding="utf-8",
    )
    status, out, err = run_main(capsys, "explain", "--example", str(path))
    assert status == 0, err
    assert out.startswith("Two words")
    assert "c_a_b = " in out


# -- errors ----------------------------------------------------------------------------------


def test_unknown_query_is_one_clean_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_main(capsys, "explain", "--query", "hate")
    assert status == 2
    assert out == ""
    assert_one_line_error(err, "'hate'", "Hint:")


def test_bad_heads_is_one_clean_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_main(capsys, "explain", "--heads", "3")
    assert status == 2
    assert_one_line_error(err, "heads", "Hint:")
    status, _, err = run_main(capsys, "explain", "--heads", "0")
    assert status == 2
    assert_one_line_error(err, "--heads")


def test_bad_example_file_is_one_clean_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("tokens: [a, b]\nembeddings: [[1, 2], [3]]\n", encoding="utf-8")
    status, _, err = run_main(capsys, "explain", "--example", str(path))
    assert status == 2
    assert_one_line_error(err, "broken.yaml")
    status, _, err = run_main(capsys, "explain", "--example", "no-such-example")
    assert status == 2
    assert_one_line_error(err, "no-such-example", "Hint:")


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["explain", "--format", "html"], ["explain", "--precision", "x"], ["nope"]):
        status, _, err = run_main(capsys, *argv)
        assert status == 2
        assert_one_line_error(err, "Hint: see 'qkv")


def test_error_in_a_subprocess_has_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "explain", "--query", "hate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("qkv: error: ") and result.stderr.count("\n") == 1


# -- --output ----------------------------------------------------------------------------------


def test_output_writes_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "attention.md"
    status, out, err = run_main(capsys, "explain", "-f", "markdown", "-o", str(target))
    assert status == 0
    assert out == "" and "wrote" in err
    assert target.read_text(encoding="utf-8").startswith("# I love statistics")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.md"]


def test_output_text_fits_80_columns(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "attention.txt"
    assert run_main(capsys, "explain", "-e", "two-heads", "-o", str(target))[0] == 0
    text = target.read_text(encoding="utf-8")
    assert "\x1b" not in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_output_is_untouched_when_the_command_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "attention.md"
    target.write_text("old content", encoding="utf-8")
    status, _, _ = run_main(capsys, "explain", "--query", "hate", "-o", str(target))
    assert status == 2
    assert target.read_text(encoding="utf-8") == "old content"
    assert [p.name for p in tmp_path.iterdir()] == ["attention.md"]


def test_output_is_atomic_when_the_write_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "attention.md"
    target.write_text("old content", encoding="utf-8")

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(os, "replace", fail)
    status, _, err = run_main(capsys, "explain", "-f", "markdown", "-o", str(target))
    assert status == 2
    assert_one_line_error(err, "No space left on device")
    assert target.read_text(encoding="utf-8") == "old content"
    assert [p.name for p in tmp_path.iterdir()] == ["attention.md"]  # no temporary file left


def test_output_into_a_missing_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, err = run_main(capsys, "explain", "-o", str(tmp_path / "no" / "such.md"))
    assert status == 2
    assert_one_line_error(err, "does not exist")


# -- examples ----------------------------------------------------------------------------------


def test_examples_lists_the_builtins_in_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    from qkv import examples

    status, out, _ = run_main(capsys, "examples")
    assert status == 0
    for name in examples.builtin_names():
        assert name in out
    assert all(len(line) <= 80 for line in out.splitlines())
    row = next(line for line in out.splitlines() if line.startswith("two-heads"))
    assert row.split()[1:3] == ["4", "2"]  # tokens, heads


def test_examples_show_prints_a_file_that_loads(capsys: pytest.CaptureFixture[str]) -> None:
    from qkv import examples

    status, out, _ = run_main(capsys, "examples", "--show", "i-love-statistics")
    assert status == 0
    assert examples.loads(out).tokens == ("I", "love", "statistics")
    status, _, err = run_main(capsys, "examples", "--show", "nope")
    assert status == 2
    assert_one_line_error(err, "nope")


# -- the core without PyTorch or matplotlib ----------------------------------------------------


def test_explain_runs_without_torch_or_matplotlib() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['matplotlib'] = None\n"
        "import qkv.cli\n"
        "status = qkv.cli.main(['explain'])\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "sys.exit(status)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "1.1160" in result.stdout and "0.3046" in result.stdout
    assert f"c_love = {WEIGHTED_SUM}" in result.stdout


# -- the README stays true ---------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(language: str) -> list[str]:
    if not README.exists():
        pytest.skip("no README.md next to the tests")
    text = README.read_text(encoding="utf-8")
    return [block.split("```")[0] for block in text.split(f"```{language}\n")[1:]]


def test_readme_output_excerpt_is_real_output(capsys: pytest.CaptureFixture[str]) -> None:
    (excerpt,) = _blocks("text")
    status, out, _ = run_main(capsys, "explain")
    assert status == 0
    for line in excerpt.splitlines():
        assert line in out.splitlines(), line


def test_readme_python_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = _blocks("python")[0]  # the NumPy example; the PyTorch one: test_nn_docs.py
    exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("[0.3046 0.3387 0.3567]\n")
    assert "0.5385" in out
