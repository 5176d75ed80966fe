"""The training loop: it learns, resumes exactly, saves on Ctrl-C, survives a crash mid-save,
freezes what is frozen, and writes its metrics and plot."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qkv import data, embeddings
from qkv.train import (
    CheckpointError,
    StepInfo,
    latest_checkpoint,
    load_checkpoint,
    load_trained,
    train_classifier,
    train_recall,
)
from qkv.train import _checkpoint as checkpoint_module

TINY: dict[str, Any] = {"sentences": 80, "embedding_dim": 8, "num_heads": 2}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _classify(out: Path, *, steps: int = 8, stop: int | None = None, **options: Any):
    """Train a tiny classifier; record each step's loss; raise KeyboardInterrupt after
    step ``stop``."""
    losses: dict[int, float] = {}

    def record(info: StepInfo) -> None:
        losses[info.step] = info.loss
        if info.step == stop:
            raise KeyboardInterrupt

    settings = {"steps": steps, "eval_every": 3, **options.pop("training", {})}
    if "embeddings" in options:
        options.setdefault("embedding_dim", None)  # the file's
    result = train_classifier(
        out, "generated", training=settings, progress=False, callbacks=[record],
        **{**TINY, **options},
    )  # fmt: skip
    return result, losses


def _metrics(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _without_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    timed = ("seconds", "steps_per_second", "examples_per_second")
    return [{k: v for k, v in row.items() if k not in timed} for row in rows]


def test_training_a_few_steps_lowers_the_loss(tmp_path: Path) -> None:
    result = train_recall(
        tmp_path, pairs=2, keys=4, values=4, d_model=16, num_heads=2, validation_size=200,
        training={"steps": 40, "eval_every": 10, "lr": 1e-2}, progress=False,
    )  # fmt: skip
    losses = [row["val_loss"] for row in result.rows]
    assert losses[-1] < 0.7 * losses[0]
    assert result.best_accuracy is not None and result.best_accuracy > 0.5  # chance: 0.25


def test_resume_after_ctrl_c_continues_exactly(tmp_path: Path) -> None:
    whole, whole_losses = _classify(tmp_path / "whole")  # dropout 0.1: RNG state matters
    with pytest.raises(KeyboardInterrupt):
        _classify(tmp_path / "cut", stop=5)
    saved = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert saved is not None and load_checkpoint(saved).step == 5  # saved before leaving
    _, resumed_losses = _classify(tmp_path / "cut", resume=True)
    assert sorted(resumed_losses) == [6, 7, 8]
    for step, loss in resumed_losses.items():
        assert loss == whole_losses[step]  # the same bits, not just close
    assert _without_time(_metrics(tmp_path / "cut")) == _without_time(_metrics(tmp_path / "whole"))
    a, b = load_trained(tmp_path / "whole"), load_trained(tmp_path / "cut")
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, b.model.state_dict()[name])
    assert whole.fit.step == 8


def test_resume_with_more_steps_matches_a_longer_run(tmp_path: Path) -> None:
    _, whole = _classify(tmp_path / "whole", steps=9)
    _classify(tmp_path / "part", steps=6)
    _, rest = _classify(tmp_path / "part", steps=9, resume=True)
    assert rest == {step: whole[step] for step in (7, 8, 9)}


def test_sigint_is_acted_on_between_steps(tmp_path: Path) -> None:
    def interrupt(info: StepInfo) -> None:
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: noted, acted on after the step

    with pytest.raises(KeyboardInterrupt):
        train_classifier(tmp_path, "generated", training={"steps": 8, "eval_every": 3},
                         progress=False, callbacks=[interrupt], **TINY)  # fmt: skip
    saved = latest_checkpoint(tmp_path / "checkpoints")
    assert saved is not None and load_checkpoint(saved).step == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_crash_while_saving_leaves_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, whole = _classify(tmp_path / "whole")
    write = checkpoint_module._write_file
    calls = {"n": 0}

    def failing(path: Path, content: bytes) -> None:
        calls["n"] += 1
        if path.name == "tensors.safetensors" and calls["n"] > 6:  # the 3rd save: step 6
            path.write_bytes(content[: len(content) // 2])  # half a file, then the crash
            raise OSError(28, "No space left on device")
        write(path, content)

    monkeypatch.setattr(checkpoint_module, "_write_file", failing)
    with pytest.raises(OSError, match="No space left"):
        _classify(tmp_path / "crash")
    monkeypatch.undo()
    good = latest_checkpoint(tmp_path / "crash" / "checkpoints")
    assert good is not None and load_checkpoint(good).step == 3
    assert not [p for p in (tmp_path / "crash" / "checkpoints").iterdir() if ".tmp" in p.name]
    _, resumed = _classify(tmp_path / "crash", resume=True)
    assert resumed == {step: whole[step] for step in range(4, 9)}


def test_freeze_keeps_the_embeddings_bit_identical(tmp_path: Path) -> None:
    path = data.embedding_file("word2vec")
    frozen, _ = _classify(tmp_path / "frozen", embeddings=path, freeze=True)
    tuned, _ = _classify(tmp_path / "tuned", embeddings=path, freeze=False)
    vectors = embeddings.load(path)
    for result, out in ((frozen, "frozen"), (tuned, "tuned")):
        trained = load_trained(tmp_path / out)
        table = trained.model.embedding
        assert isinstance(table, torch.nn.Embedding)
        matrix = table.weight.detach().numpy()
        known = [i for i, w in enumerate(trained.vocabulary.tokens) if w in vectors]
        start = vectors.lookup([trained.vocabulary.tokens[i] for i in known])
        assert np.array_equal(matrix[known], start) == (out == "frozen")
        report = json.loads((tmp_path / out / "embedding_drift.json").read_text("utf-8"))
        assert result.drift is not None
        assert report["identical"] == (out == "frozen") == result.drift["identical"]
    assert tuned.drift is not None and tuned.drift["mean_l2"] > 0
    assert tuned.drift["moved_most"][0]["l2"] == tuned.drift["max_l2"]
    words = frozen.vocabulary[2:]  # after <pad> and <unk>
    assert frozen.embeddings_found == len(words) - len(vectors.missing(words))


def test_metrics_file_schema_and_plot(tmp_path: Path) -> None:
    _classify(tmp_path, steps=7)
    rows = _metrics(tmp_path)
    assert [row["step"] for row in rows] == [3, 6, 7]  # every eval_every steps and the last
    for row in rows:
        assert isinstance(row["step"], int)
        assert isinstance(row["loss"], float) and row["loss"] > 0
        assert 0.0 <= row["val_accuracy"] <= 1.0 and 0.0 <= row["accuracy"] <= 1.0
        assert isinstance(row["val_loss"], float) and row["lr"] == 3e-3
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best", "checkpoints", "metrics.jsonl", "metrics.png",
    ]  # fmt: skip


def test_early_stopping_and_target_accuracy(tmp_path: Path) -> None:
    still, _ = _classify(tmp_path / "still", steps=30,
                         training={"lr": 1e-12, "patience": 2, "eval_every": 3})  # fmt: skip
    assert still.fit.stopped == "patience" and still.fit.step == 9  # evals 3 (best), 6, 9
    target, _ = _classify(tmp_path / "target", steps=30, training={"target_accuracy": 0.01})
    assert target.fit.stopped == "target" and target.fit.step == 3


def test_resume_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nothing to resume.*Hint"):
        _classify(tmp_path / "none", resume=True)
    _classify(tmp_path / "run", steps=3)
    with pytest.raises(CheckpointError, match=r"holds a run already.*Hint: pass --resume"):
        _classify(tmp_path / "run", steps=3)
    with pytest.raises(ValueError, match=r"--embedding-dim 16 differs from the run being resumed"):
        _classify(tmp_path / "run", steps=6, resume=True, embedding_dim=16)


def test_embeddings_whose_dimension_disagrees_with_the_checkpoint(tmp_path: Path) -> None:
    path = data.embedding_file("glove")
    _classify(tmp_path / "run", steps=3, embeddings=path)
    vectors = embeddings.load(path)
    other = embeddings.save(
        tmp_path / "other.vec", embeddings.Embeddings(vectors.words, vectors.vectors[:, :8]),
        "fasttext",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"has vectors of 8 numbers, but the checkpoint's "
                       r"embeddings have 16\. Hint"):  # fmt: skip
        _classify(tmp_path / "run", steps=6, resume=True, embeddings=other)


def test_the_same_seed_gives_the_same_run(tmp_path: Path) -> None:
    _, first = _classify(tmp_path / "a", steps=4, seed=7)
    _, again = _classify(tmp_path / "b", steps=4, seed=7)
    _, other = _classify(tmp_path / "c", steps=4, seed=8)
    assert first == again
    assert first != other
    assert _without_time(_metrics(tmp_path / "a")) == _without_time(_metrics(tmp_path / "b"))
