"""A trained model back from its checkpoint: evaluate it, and explain it on a new text.

Shape legend: L tokens of the text, C classes, H heads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qkv.data import Vocabulary
from qkv.trace import Trace, tracing
from qkv.train._checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    check_run_config,
    load_checkpoint,
)
from qkv.train._loop import BEST, CHECKPOINTS, Evaluation, evaluate
from qkv.train._models import build_model
from qkv.train._tasks import UNK, RecallTask, batches_of, encode_texts
from qkv.train._text import LabelledTexts, tokenize

__all__ = ["Prediction", "Trained", "evaluate_trained", "explain_text", "load_trained"]


@dataclass(frozen=True)
class Trained:
    """A model rebuilt from a checkpoint, with what it needs to read new input.

    Attributes:
        model: the model, in eval mode.
        config: the checkpoint's config (task, model, data, training).
        path: the checkpoint folder it was read from.
        step: the training step it was saved at.
        task: ``"recall"`` or ``"classify"``.
        vocabulary: its tokens. labels: its classes.
    """

    model: nn.Module
    config: dict[str, Any]
    path: Path
    step: int
    task: str
    vocabulary: Vocabulary
    labels: tuple[str, ...]


def load_trained(path: str | os.PathLike[str]) -> Trained:
    """Load a trained model: a run's folder (its ``best/`` checkpoint), a checkpoint folder,
    or one ``step-*`` folder.

    Raises:
        CheckpointError: no checkpoint there, or a damaged or truncated one.
        CheckpointMismatchError: the tensors do not fit the model the config describes.
    """
    folder = Path(path)
    for sub in (BEST, CHECKPOINTS):
        if (folder / sub).is_dir():
            folder = folder / sub
            break
    checkpoint = load_checkpoint(folder)
    check_run_config(checkpoint)  # before building: a damaged config allocates nothing
    config = checkpoint.config
    try:
        task, model_config, data = config["task"], config["model"], config["data"]
        vocabulary = Vocabulary(data["vocabulary"])
        labels = tuple(data["labels"])
        model = build_model(model_config)
    except (KeyError, TypeError, ValueError) as error:  # the model's own checks of its settings
        problem, _, hint = str(error).partition(" Hint: ")
        raise CheckpointError(
            f"config.model: {problem.rstrip('.')}",
            path=checkpoint.path,
            hint=hint.rstrip(".") or "give the --out folder of 'qkv train'",
        ) from None
    expected = model.state_dict()
    wrong = sorted(
        name
        for name, tensor in expected.items()
        if name not in checkpoint.tensors or checkpoint.tensors[name].shape != tensor.shape
    ) + sorted(set(checkpoint.tensors) - set(expected))
    if wrong:
        raise CheckpointMismatchError(
            f"the checkpoint's tensors do not fit its model config ({', '.join(wrong[:3])})",
            path=checkpoint.path,
            hint="the files were mixed up or edited; use another checkpoint of the run",
        )
    model.load_state_dict(checkpoint.tensors)
    model.eval()
    return Trained(model, config, checkpoint.path, checkpoint.step, task, vocabulary, labels)


def evaluate_trained(
    trained: Trained,
    data: LabelledTexts | None = None,
    *,
    samples: int = 2000,
    seed: int = 0,
) -> Evaluation:
    """Accuracy, loss and per-class counts of a trained model.

    Args:
        trained: from :func:`load_trained`.
        data: labelled texts (a classifier; or a recall model, one sequence per text and
            the answer as its label); None for a recall model draws ``samples`` new
            held-out sequences with ``seed``.

    Raises:
        DataError: a label the model does not know (naming the line).
        ValueError: no data for a classifier, or a recall token the model does not know.
    """
    if data is None:
        if trained.task != "recall":
            raise ValueError(
                "evaluating a classifier needs data. Hint: --data FILE.csv (or --data "
                "generated for the set qkv makes)."
            )
        batches = _recall_task(trained).test_batches(samples, seed)
        return evaluate(trained.model, batches, trained.labels)
    if trained.task == "recall":
        _check_known([text.split() for text in data.texts], trained.vocabulary)
        encoded = encode_texts(
            data,
            range(len(data)),
            trained.vocabulary,
            trained.labels,
            lowercase=False,
            max_length=10**9,
        )
    else:
        encoded = _encode_classify(trained, data)
    return evaluate(trained.model, batches_of(encoded, 256), trained.labels)


@dataclass(frozen=True)
class Prediction:
    """What the model says about a text: the tokens it read, the class, the probabilities."""

    tokens: tuple[str, ...]
    label: str
    probabilities: dict[str, float]
    unknown: tuple[str, ...]


def explain_text(
    trained: Trained,
    text: str,
    *,
    layer: str | int | None = None,
    queries: int | Sequence[int] | None = None,
    steps: Sequence[str] | None = None,
) -> tuple[Trace, Prediction]:
    """Run the trained model on ``text`` under :func:`qkv.tracing` and label the trace with
    the text's tokens, so the explain renderers show words.

    Args:
        trained: from :func:`load_trained`.
        text: a sentence (a classifier), or a recall sequence such as ``"a 3 c 5 b 1 c"``.
        layer: which attention module to record (a path such as ``"block.attn"`` or
            ``"pool.attn"``, or a position); default: the self-attention of a classifier,
            the last block of a recall model.
        queries: which query rows to record; default: every row of a classifier, the last
            (the query key) of a recall model.
        steps: which steps to record (as :func:`qkv.tracing`'s ``steps``), e.g.
            ``("weights", "context")``; default: every step.

    Returns:
        The trace (with ``tokens``, a title and the prediction in its description) and the
        :class:`Prediction`.

    Raises:
        ValueError: an empty text, a recall token the model does not know, a model without
            attention (the bag of words), or a layer that is not an attention module of the
            model (naming the ones there are).
    """
    words, ids, unknown = _read_text(trained, text)
    modules = [
        name
        for name, module in trained.model.named_modules()
        if getattr(module, "_qkv_traceable", False)
    ]
    if not modules:
        kind = trained.config["model"]["kind"]
        raise ValueError(
            f"the {kind} model of {trained.path} has no attention to explain (it averages the "
            "word vectors). Hint: explain a model trained with --model attention"
        )
    chosen = _layer(layer, modules, trained.task)
    if queries is None and trained.task == "recall":
        queries = -1
    tokens = torch.tensor([ids], dtype=torch.int64)  # (1, L)
    lengths = torch.tensor([len(ids)], dtype=torch.int64)
    with (
        torch.no_grad(),
        tracing(model=trained.model, layers=chosen, queries=queries, steps=steps) as trace,
    ):
        trace.tokens = list(words)
        logits = trained.model(tokens, lengths)[0]  # (C,)
    if chosen == "pool.attn":
        trace.query_tokens = ["<pool>"]  # the learned query of the attention pooling
    probabilities = torch.softmax(logits, dim=-1).numpy()
    best = int(np.argmax(probabilities))
    prediction = Prediction(
        tokens=tuple(words),
        label=trained.labels[best],
        probabilities={
            label: float(p) for label, p in zip(trained.labels, probabilities, strict=True)
        },
        unknown=tuple(unknown),
    )
    kind = "recall model" if trained.task == "recall" else "classifier"
    trace.meta["name"] = f"Trained {kind}: “{' '.join(words)}”"
    said = f"The model predicts {prediction.label} ({probabilities[best]:.1%})."
    if unknown:
        said += f" Words it does not know (read as {UNK}): {', '.join(unknown)}."
    trace.meta["description"] = (
        f"{said} Attention of layer {chosen} of the checkpoint {trained.path} (step "
        f"{trained.step}). {_inputs(chosen, trained.task)}"
    )
    trace.meta["prediction"] = {
        "label": prediction.label,
        "probabilities": prediction.probabilities,
    }
    return trace, prediction


def _inputs(layer: str, task: str) -> str:
    """What the recorded layer's X is, in words."""
    if layer == "pool.attn":
        return (
            "The query is the learned pooling vector <pool>; the keys and values are the "
            "words as the self-attention block left them."
        )
    if task == "recall":
        return (
            "X: each token's embedding plus a learned map of the next token's, through the "
            "block's layer norm (and the blocks before it)."
        )
    return "X: the words' embeddings, through the block's layer norm."


def _read_text(trained: Trained, text: str) -> tuple[list[str], list[int], list[str]]:
    if trained.task == "recall":
        words = text.split()
        _check_known((tuple(words),), trained.vocabulary)
    else:
        data = trained.config["data"]
        words = tokenize(text, lowercase=data["lowercase"])[: data["max_length"]]
    if not words:
        raise ValueError(
            f'--text {text!r} has no words. Hint: give a sentence, e.g. --text "the food was '
            'great , not awful".'
        )
    index = trained.vocabulary.index
    unknown = [w for w in dict.fromkeys(words) if w not in index]
    ids = trained.vocabulary.encode(words, unknown=UNK if UNK in index else None)
    return words, [int(i) for i in ids], unknown


def _check_known(sequences: Sequence[Sequence[str]], vocabulary: Vocabulary) -> None:
    for row, words in enumerate(sequences):
        unknown = [w for w in words if w not in vocabulary.index]
        if unknown:
            shown = " ".join(vocabulary.tokens)
            raise ValueError(
                f"recall sequence {row + 1}: the token {unknown[0]!r} is not in the model's "
                f"vocabulary ({shown}). Hint: keys and values separated by spaces, then the "
                "query key, e.g. 'a 3 c 5 b 1 c'."
            )


def _layer(layer: str | int | None, modules: list[str], task: str) -> str:
    if layer is None:
        return "block.attn" if "block.attn" in modules else modules[-1]
    if isinstance(layer, int) or layer.lstrip("-").isdecimal():
        position = int(layer)
        if -len(modules) <= position < len(modules):
            return modules[position]
    elif layer in modules:
        return layer
    elif f"{layer}.attn" in modules:
        return f"{layer}.attn"
    raise ValueError(
        f"--layer {layer!r} is not an attention layer of this {task} model. Hint: its attention "
        f"layers are {', '.join(modules)} (or 0 to {len(modules) - 1} by position)."
    )


def _recall_task(trained: Trained) -> RecallTask:
    data = trained.config["data"]
    return RecallTask(
        pairs=data["pairs"],
        keys=data["keys"],
        values=data["values"],
        validation_size=data["validation_size"],
        seed=trained.config["seed"],
    )


def _encode_classify(trained: Trained, data: LabelledTexts) -> Any:
    settings = trained.config["data"]
    return encode_texts(
        data,
        range(len(data)),
        trained.vocabulary,
        trained.labels,
        lowercase=settings["lowercase"],
        max_length=settings["max_length"],
    )
