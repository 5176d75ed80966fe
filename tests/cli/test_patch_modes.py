"""``qkv patch --by position`` and ``--by path`` (issue 39): their numbers are those of
``qkv.edits.position_patching`` and ``qkv.edits.path_patching`` on the same local model
folder (the API is itself compared with hand-written hooks and with TransformerLens's
``get_act_patch_attn_head_out_by_pos`` in tests/edits), the heads and positions asked for
are the ones shown, the text fits 80 columns, every mistake is one line and exit status 2,
and the help's examples of both modes run as printed."""

from __future__ import annotations

import csv
import io
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

import qkv
from qkv.cli import main
from qkv.edits import path_patching, position_patching
from tests.support.flip_model import HOUSE, MAT, save_flip_model
from tests.support.hf_models import VOCAB, save_tiny, tokenizer

CLEAN, CORRUPT = "the cat sat on the", "the dog sat on the"


@pytest.fixture(scope="module")
def flip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_flip_model(tmp_path_factory.mktemp("flip") / "flip")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny GPT-2 (fused ``c_attn``): every head moves the metric a little."""
    return save_tiny("gpt2", tmp_path_factory.mktemp("gpt2") / "gpt2")


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def _patch(folder: Path, *extra: str, clean: str = CLEAN, corrupt: str = CORRUPT) -> list[str]:
    argv = ["patch", "--hf", str(folder), "--clean", clean, "--corrupt", corrupt]
    return [*argv, "--answer", "mat", "--wrong", "house", *extra]


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _api_inputs(folder: Path) -> tuple[Any, Any, Any]:
    """The model of ``folder`` as ``--hf`` loads it, and both prompts' token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    words = tokenizer()
    ids = [words(text, return_tensors="pt")["input_ids"] for text in (CLEAN, CORRUPT)]
    return model, ids[0], ids[1]


def test_by_position_equals_position_patching_for_the_heads_and_tokens_asked(
    gpt2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, clean, corrupt = _api_inputs(gpt2)
    api = position_patching(model, clean, corrupt, qkv.logit_diff(MAT, HOUSE))
    every = _json(_patch(gpt2, "--by", "position", "-f", "json"), capsys)
    assert every["by"] == "position" and every["positions"] == [0, 1, 2, 3, 4]
    assert [(row["layer"], row["head"]) for row in every["rows"]] == [
        (layer, head) for layer in range(2) for head in range(4)
    ]
    for row in every["rows"]:  # API: values[layer][position][head]
        wanted = [api.values[row["layer"]][p][row["head"]] for p in range(5)]
        assert row["values"] == pytest.approx(wanted, abs=1e-6)
    assert every["clean"]["value"] == pytest.approx(api.clean, abs=1e-6)
    assert every["corrupt"]["value"] == pytest.approx(api.corrupt, abs=1e-6)
    argv = _patch(gpt2, "--by", "position", "--layer", "-1", "--head", "-1", "--positions",
                  "1,3-4,-1", "-f", "csv")  # fmt: skip
    assert main(argv) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["layer"], r["module"], r["head"]) for r in rows] == [
        ("1", "transformer.h.1.attn", "3")
    ] * 3
    # -1 is 4: each position once, in order
    assert [(int(r["position"]), r["token"]) for r in rows] == [(1, "cat"), (3, "on"), (4, "the")]
    assert [float(r["value"]) for r in rows] == pytest.approx(
        [api.values[1][p][3] for p in (1, 3, 4)], abs=1e-6
    )
    span = api.clean - api.corrupt
    assert [float(r["normalized"]) for r in rows] == pytest.approx(
        [(api.values[1][p][3] - api.corrupt) / span for p in (1, 3, 4)], abs=1e-5
    )


def test_by_position_text_names_the_head_and_token_that_carry_the_answer(
    flip: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flip model: only head 0 of layer 0 at the last token moves the answer."""
    page = tmp_path / "position.html"
    assert main(_patch(flip, "--by", "position", "--layer", "0", "--html", str(page))) == 0
    html = page.read_text()  # its heatmap in a browser: tests/browser/test_patch_position_page
    assert html.startswith("<!DOCTYPE html>") and '"corner":"layer.head"' in html
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("qkv patch: each head's context at one position, clean into")
    assert lines[4] == "rows: layer.head; columns: the position patched and its clean token"
    assert lines[6] == "L.H       pos 0    pos 1    pos 2    pos 3    pos 4"
    assert lines[7] == "            the      cat      sat       on      the"
    assert lines[8] == "  0.0   -5.5705  -5.5705  -5.5705  -5.5705  +5.5705"
    assert len([line for line in lines if line.startswith("  1.")]) == 0  # --layer 0 only
    assert "largest effect: layer 0, head 0 at position 4 (the): +5.5705" in lines
    assert "100% of the way from corrupt to clean" in lines
    assert max(len(line) for line in lines) <= 80


def test_many_positions_come_in_blocks_of_80_columns(
    flip: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean = "the cat sat on the mat and then it was happy"
    corrupt = "the dog sat on the mat and then it was happy"
    argv = _patch(flip, "--by", "position", "--head", "0", clean=clean, corrupt=corrupt)
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    headers = [line for line in lines if line.startswith("L.H")]
    assert headers[0].split()[1:3] == ["pos", "0"] and headers[0].endswith("pos 7")
    assert headers[1].split() == ["L.H", "pos", "8", "pos", "9", "pos", "10"]


def test_by_path_equals_path_patching(gpt2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, clean, corrupt = _api_inputs(gpt2)
    metric = qkv.logit_diff(MAT, HOUSE)
    api = path_patching(model, clean, corrupt, metric, receiver=(1, 2), through="values")
    found = _json(
        _patch(gpt2, "--by", "path", "--receiver", "1.2", "--through", "v", "-f", "json"), capsys
    )
    assert found["by"] == "path" and found["through"] == "values"
    assert found["receiver"] == {"layer": 1, "module": "transformer.h.1.attn", "head": 2}
    assert [(r["layer"], r["head"]) for r in found["rows"]] == [(0, h) for h in range(4)]
    assert [r["value"] for r in found["rows"]] == pytest.approx(api.values[0], abs=1e-6)
    assert found["clean"]["value"] == pytest.approx(api.clean, abs=1e-6)
    keys = path_patching(model, clean, corrupt, metric, receiver=(1, 3), through="keys")
    argv = _patch(gpt2, "--by", "path", "--receiver=-1.-1", "--head", "2", "-f", "csv")
    assert main(argv) == 0  # keys by default; heads from the end
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["layer"], r["head"]) for r in rows] == [("0", "2")]
    assert float(rows[0]["value"]) == pytest.approx(keys.values[0][2], abs=1e-6)


def test_by_path_text_and_page(
    flip: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flip model's layer 1 writes nothing: no path into it moves the answer."""
    page = tmp_path / "path.html"
    argv = _patch(flip, "--by", "path", "--receiver", "1.0", "--through", "v")
    assert main([*argv, "--html", str(page)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("qkv patch: paths into layer 1 head 0's values, clean into")
    assert lines[5:7] == [
        "layer    head 0   head 1   head 2   head 3",
        "    0   -5.5705  -5.5705  -5.5705  -5.5705",
    ]
    assert "no path moves the metric from the corrupt run's" in lines
    assert "receiver: head 0 of model.layers.1.self_attn" in lines
    assert max(len(line) for line in lines) <= 80
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert "output, along its path into layer 1 head 0" in html  # what a cell patched


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer", "0"], "--layer cannot be used with --by head: --by head patches every"),
        (["--by", "head", "--head", "1"], "--head cannot be used with --by head"),
        (["--positions", "1"], "--positions cannot be used with --by head: it chooses"),
        (["--receiver", "1.0"], "--receiver cannot be used with --by head: it names"),
        (["--by", "path"], "--by path needs --receiver L.H, the head that reads the senders"),
        (["--by", "position", "--what", "weights"], "--what weights cannot be used with --by"),
        (["--by", "position", "--positions", "5"], "--positions: position 5 is outside the 5"),
        (["--by", "position", "--positions", "3-1"], "expected a range from low to high such"),
        (["--by", "position", "--positions", "a"], "argument --positions: expected positions"),
        (["--by", "position", "--layer", "2"], "--layer 2: layer 2 does not exist; the model"),
        (["--by", "position", "--layer", "x.y"], "--layer x.y: no attention layer is named"),
        (["--by", "position", "--head", "4"], "--head 4: layer 'model.layers.0.self_attn' has 4"),
        (["--by", "path", "--receiver", "1"], "argument --receiver: expected LAYER.HEAD, such"),
        (["--by", "path", "--receiver", "0.1"], "--receiver 0.1: layer 0 has no earlier heads"),
        (["--by", "path", "--receiver", "1.9"], "--receiver 1.9: layer 'model.layers.1.self_a"),
        (["--by", "path", "--receiver", "1.0", "--layer", "1"], "--layer 1: the senders of a"),
        (["--by", "path", "--receiver", "1.0", "--through", "x"], "argument --through: invalid"),
        (["--by", "sideways"], "argument --by: invalid choice: 'sideways'"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(
    flip: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _status(_patch(flip, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert "Hint: " in err


def test_a_batch_that_does_not_fit_is_said_in_the_commands_words(
    flip: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("qkv.edits._batching.available_memory", lambda: 20_000)
    for mode in (["--by", "position"], ["--by", "path", "--receiver", "1.0"]):
        assert _status(_patch(flip, *mode, "--batch", "64")) == 2
        err = capsys.readouterr().err
        assert err.startswith("qkv: error: --batch 64: a batch of ")
        assert "Hint: --batch " in err and err.count("\n") == 1


def _examples(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The help's example command lines of --by position and --by path, joined."""
    assert _status(["patch", "--help"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    text = out.split("Examples:", 1)[1].replace(" \\\n", " ")
    return [line.strip() for line in text.splitlines() if "--by " in line]


def test_the_help_examples_of_each_mode_run(flip: Path, capsys: pytest.CaptureFixture[str]) -> None:
    examples = _examples(capsys)
    assert [command.split("--by ")[1].split()[0] for command in examples] == [
        "position",
        "path",
    ]
    assert {"a", "cat", "dog", "sat", "on"} <= set(VOCAB)  # the words the examples use
    for command in examples:
        argv = shlex.split(command.replace("DIR", str(flip)))
        assert argv[0] == "qkv"
        assert main(argv[1:]) == 0, command
        out = capsys.readouterr().out
        assert out.startswith("qkv patch: ") and "metric: prob(on) at the last token" in out
