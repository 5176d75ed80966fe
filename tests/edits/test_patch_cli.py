"""``qkv patch``: the table in text, JSON and CSV from a local model folder, offline; every
mistake one line and exit status 2."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest

from qkv.cli import main
from tests.support.flip_model import save_flip_model
from tests.support.hf_models import save_tiny

CLEAN, CORRUPT = "the cat sat on the", "the dog sat on the"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_flip_model(tmp_path_factory.mktemp("flip") / "flip")


def _status(argv: list[str]) -> int:
    """The exit status of ``qkv ARGV`` (argparse exits by itself)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def _patch(folder: Path, *extra: str) -> list[str]:
    return ["patch", "--hf", str(folder), "--clean", CLEAN, "--corrupt", CORRUPT, *extra]


def test_the_text_table_names_the_head_that_flips_the_answer(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_patch(folder, "--answer", "mat", "--wrong", "house")) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == "metric: logit_diff(mat − house) at the last token"
    assert lines[2].startswith("clean   +5.5705  the cat sat")
    assert lines[3].startswith("corrupt -5.5705  the dog sat")
    assert lines[5] == "layer    head 0   head 1   head 2   head 3"
    assert lines[6] == "    0   +5.5705  -5.5705  -5.5705  -5.5705"
    assert "largest effect: layer 0, head 0: +5.5705, 100% of the way from corrupt" in out
    assert max(len(line) for line in lines) <= 80


def test_json_and_csv_hold_the_same_table(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_patch(folder, "--answer", "mat", "--format", "json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metric"] == "prob(mat)" and data["what"] == "context"
    assert data["clean"]["tokens"] == CLEAN.split()
    assert len(data["values"]) == 2 and data["normalized"][0][0] == pytest.approx(1.0)
    assert main(_patch(folder, "--answer", "mat", "--format", "csv")) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 8
    assert float(rows[0]["value"]) == pytest.approx(data["values"][0][0])
    assert rows[5]["module"] == "model.layers.1.self_attn" and rows[5]["head"] == "1"


def test_output_and_html_are_written(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table, page = tmp_path / "t.json", tmp_path / "p.html"
    argv = _patch(folder, "--answer", "mat", "--what", "weights", "-f", "json", "-o", str(table))
    assert main([*argv, "--html", str(page)]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(table.read_text())["what"] == "weights"
    assert page.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--answer", "zebra"], "--answer 'zebra' is not one token of the model's vocabulary"),
        (["--answer", "mat", "--wrong", "a b"], "--wrong 'a b' is not one token"),
        (["--answer", "mat", "--corrupt", "the dog sat"], "--corrupt has 3 tokens and --clean 5"),
        (["--answer", "mat", "--what", "both"], "argument --what: invalid choice: 'both'"),
        (["--answer", "mat", "--html", "page.png"], "--html 'page.png' must end in .html"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(
    folder: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _status(_patch(folder, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_model_without_a_language_model_head_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bert = save_tiny("bert", tmp_path / "bert")
    capsys.readouterr()
    argv = ["patch", "--hf", str(bert), "--clean", "a", "--corrupt", "a", "--answer", "a"]
    assert _status(argv) == 2
    err = capsys.readouterr().err
    assert "the bert model (BertModel) has no language-model head" in err
    assert err.count("\n") == 1


def test_help_has_an_example_fits_80_columns_and_names_the_extra(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _status(["patch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples:" in out and "Needs qkv[hf] (torch and transformers)." in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_clean_and_corrupt_that_barely_differ_get_no_percentage() -> None:
    """Issue 39: 0.002 apart, a head that moves the metric by 0.0188 was "940 % of the way"."""
    from qkv.cli._patch import table_text
    from qkv.edits import PatchingResult

    facts = {
        "model": "m",
        "family": "llama",
        "metric": "prob(mat)",
        "clean": {"text": "a"},
        "corrupt": {"text": "b"},
    }
    close = PatchingResult([[1.0188, 1.0]], ("layers.0",), 1.002, 1.0, "context")
    text = table_text(close, facts)
    assert "%" not in text.replace("within 1%", "")
    assert "clean and corrupt barely differ (0.002 apart, within 1% of the metric's" in text
    assert "largest effect: layer 0, head 0: +1.0188\n" in text
    assert all(math.isnan(v) for v in close.normalized()[0])
    apart = PatchingResult([[1.0188, 1.0]], ("layers.0",), 1.02, 1.0, "context")
    assert "94% of the way from corrupt to clean" in table_text(apart, facts)
    assert not apart.barely_differ()


def test_batch_runs_heads_together_and_a_batch_too_large_is_refused(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(_patch(folder, "--answer", "mat", "-f", "json")) == 0
    whole = json.loads(capsys.readouterr().out)["values"]
    assert main(_patch(folder, "--answer", "mat", "-f", "json", "--batch", "3")) == 0
    batched = json.loads(capsys.readouterr().out)["values"]
    assert [v for row in batched for v in row] == pytest.approx(
        [v for row in whole for v in row], abs=1e-6
    )
    assert _status(_patch(folder, "--answer", "mat", "--batch", "0")) == 2
    assert "argument --batch: expected a positive integer, got '0'" in capsys.readouterr().err
    monkeypatch.setattr("qkv.edits._batching.available_memory", lambda: 20_000)
    assert _status(_patch(folder, "--answer", "mat", "--batch", "64")) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: --batch 64: a batch of 4 rows needs about ")
    assert "Hint: --batch " in err and err.count("\n") == 1
