"""Training settings are declared once (issue 13, item 6): the frozen dataclasses of
``qkv._train_settings`` give the defaults that ``qkv train --help``, the runs and
docs/training.md state."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from qkv._train_settings import (
    CLASSIFY_TRAINING,
    RECALL_TRAINING,
    ClassifySettings,
    RecallSettings,
    TrainSettings,
)
from qkv.cli import _train, main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"
FIELDS = {"--heads": "num_heads"}  # the options whose field is not their name


def _field(option: str) -> str:
    return FIELDS.get(option, option.removeprefix("--").replace("-", "_"))


def _help(task: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["train", task, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps the lines


def test_the_settings_are_frozen_dataclasses_with_the_runs_defaults() -> None:
    for settings in (RecallSettings(), ClassifySettings(), RECALL_TRAINING, CLASSIFY_TRAINING):
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.steps = 1  # type: ignore[misc,union-attr]
    assert (RECALL_TRAINING.steps, RECALL_TRAINING.eval_every) == (2000, 50)
    assert (CLASSIFY_TRAINING.steps, CLASSIFY_TRAINING.eval_every) == (1500, 50)
    assert RecallSettings().d_model == 64 and ClassifySettings().dropout == 0.1


def test_every_default_in_the_docs_table_is_the_dataclass_default() -> None:
    rows = re.findall(r"^\| `(--[a-z-]+)` \| (.+?) \| (.+?) \|$", DOCS.read_text("utf-8"), re.M)
    assert len(rows) >= 20
    columns = ((RecallSettings(), RECALL_TRAINING), (ClassifySettings(), CLASSIFY_TRAINING))
    for option, *cells in rows:
        for cell, (task, training) in zip(cells, columns, strict=True):
            name = _field(option)
            owner = training if hasattr(TrainSettings(), name) else task
            if cell == "–":
                assert not hasattr(owner, name), f"{option}: the docs say none"
                continue
            assert cell == _train.shown(getattr(owner, name)), f"{option}: {cell}"


@pytest.mark.parametrize(
    ("task", "settings", "training"),
    [
        ("recall", RecallSettings(), RECALL_TRAINING),
        ("classify", ClassifySettings(), CLASSIFY_TRAINING),
    ],
)
def test_the_help_states_each_default_of_the_dataclasses(
    task: str,
    settings: RecallSettings | ClassifySettings,
    training: TrainSettings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help(task, capsys)
    assert f"training (default: {training.steps} steps, eval every {training.eval_every})" in text
    for option in ("--lr", "--weight-decay", "--warmup", "--patience"):
        assert f"({_train.shown(getattr(training, _field(option)))}" in text.split(option)[-1]
    for option in ("--batch-size", "--heads", "--dropout", "--seed"):
        shown = _train.shown(getattr(settings, _field(option)))
        assert re.search(rf"{option} \S+ [^(]*\((default )?{re.escape(shown)}\b", text), option


def test_the_help_reads_the_defaults_from_the_dataclasses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    changed = dataclasses.replace(RecallSettings(), pairs=13, d_model=96, batch_size=7)
    monkeypatch.setattr(_train, "RecallSettings", lambda: changed)
    monkeypatch.setattr(_train, "RECALL_TRAINING", TrainSettings(steps=1234, lr=5e-4))
    text = _help("recall", capsys)
    assert "key-value pairs (13)" in text and "model width (96)" in text
    assert "batch size (7)" in text and "1234 steps" in text and "learning rate (5e-4)" in text
