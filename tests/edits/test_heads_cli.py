"""``qkv heads``: the statistics of every head of a local model folder, offline, as tables,
JSON, CSV, a page and a figure; every mistake one line and exit status 2."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

import qkv
from qkv.cli import main
from tests.support.hf_models import save_tiny, tokenizer

PROMPTS = "the cat sat on the mat\n\nthe dog ran to the big red house\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("heads") / "llama")


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS, encoding="utf-8")
    return path


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def test_the_tables_equal_head_stats(
    folder: Path, texts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["heads", "--hf", str(folder), "--texts", str(texts), "-f", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = [tokenizer()(p, return_tensors="pt")["input_ids"] for p in PROMPTS.split("\n") if p]
    expected = qkv.head_stats(model, ids)
    assert data["prompts"] == 2 and data["tokens"] == 14
    for name, table in expected.values.items():
        for ours, theirs in zip(data["statistics"][name], table, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-6), name


def test_text_csv_page_and_figure(
    folder: Path, texts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["heads", "--hf", str(folder), "--texts", str(texts)]) == 0
    out = capsys.readouterr().out
    assert "previous: attention on the token before" in out
    assert "layer    head 0   head 1   head 2   head 3" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    page, figure, table = tmp_path / "h.html", tmp_path / "h.png", tmp_path / "h.csv"
    argv = ["heads", "--hf", str(folder), "--texts", str(texts), "--html", str(page)]
    assert main([*argv, "--plot", str(figure), "-f", "csv", "-o", str(table)]) == 0
    rows = list(csv.DictReader(io.StringIO(table.read_text())))
    assert len(rows) == 8 and set(rows[0]) >= {"entropy", "sink", "induction"}
    assert page.read_text().count("<table") == 5
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("\n\n", [], "holds no prompt"),
        (b"\xff\xfe", [], "is not UTF-8 text"),
        ("a\n", ["--induction-length", "1"], "--induction-length must be from 2 to 512"),
        ("a\n", ["--plot", "x.pdf"], "--plot 'x.pdf' must end in .png or .svg"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(
    folder: Path,
    tmp_path: Path,
    content: str | bytes,
    extra: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "p.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    capsys.readouterr()
    assert _status(["heads", "--hf", str(folder), "--texts", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_missing_file_and_a_missing_folder(
    tmp_path: Path, texts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _status(["heads", "--hf", str(tmp_path), "--texts", str(tmp_path / "no.txt")]) == 2
    assert "--texts" in capsys.readouterr().err
    assert _status(["heads", "--hf", str(tmp_path / "none"), "--texts", str(texts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: --hf") and err.count("\n") == 1


def test_help_has_examples_and_names_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    assert _status(["heads", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples:" in out and "Needs qkv[hf] (torch and transformers)." in out
    assert max(len(line) for line in out.splitlines()) <= 80
