"""Whole training runs: ``train_recall`` and ``train_classifier`` (what ``qkv train`` calls).

Each run is a short pipeline of named stages (the classifier's are in
:mod:`qkv.train._classify`): resolve the settings → prepare the data → seed → build the
model → ``fit`` → report. Every setting defaults to None, which means: the run's own value
when resuming, else the default declared once in :mod:`qkv._train_settings`
(:class:`RecallSettings`, :class:`ClassifySettings`, and the training defaults
:data:`RECALL_TRAINING`, :data:`CLASSIFY_TRAINING`). A resumed run must keep its model, data
and seed (a different value is an error that names it); the training settings (steps,
learning rate, evaluation, early stopping) may change.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv._train_settings import (
    CLASSIFY_TRAINING,
    RECALL_TRAINING,
    RecallSettings,
)
from qkv.train._classify import (
    DRIFT,
    build_classifier,
    classify_config,
    classify_options,
    drift_report,
    embeddings_config,
    freeze_choice,
    prepare_texts,
    pretrained,
    with_columns,
)
from qkv.train._loop import FitResult, StepInfo, fit
from qkv.train._models import RecallModel
from qkv.train._resolve import (
    option_name,
    qkv_version,
    resolve,
    saved_config,
    training_settings,
)
from qkv.train._size import check_classify, check_recall
from qkv.train._tasks import RecallTask
from qkv.train._text import GENERATED, LabelledTexts

__all__ = [
    "DRIFT",
    "ClassifyResult",
    "seed_everything",
    "train_classifier",
    "train_recall",
]

Callbacks = Sequence[Callable[[StepInfo], None]]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's random generators (what ``--seed`` does).

    Raises:
        ValueError: ``seed`` is not a whole number from 0 to 2**64 - 1 (what PyTorch takes).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(
            f"--seed {seed}: expected a whole number from 0 to 2**64 - 1, got {seed!r}. "
            "Hint: e.g. --seed 0"
        )
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_recall(
    out: str | os.PathLike[str],
    *,
    pairs: int | None = None,
    keys: int | None = None,
    values: int | None = None,
    validation_size: int | None = None,
    d_model: int | None = None,
    num_heads: int | None = None,
    layers: int | None = None,
    next_token: bool | None = None,
    dropout: float | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
    training: Mapping[str, Any] | None = None,
    resume: bool = False,
    progress: bool = True,
    callbacks: Callbacks = (),
) -> FitResult:
    """Train a :class:`RecallModel` on associative recall; write the run into ``out``.

    Args:
        out: the run's folder (see :func:`qkv.train.fit`).
        pairs, keys, values: the sequences (:func:`qkv.data.recall`).
        validation_size: held-out sequences to measure accuracy on.
        d_model, num_heads, layers, next_token, dropout: the model.
        batch_size: fresh sequences per step.
        seed: seeds the weights, the sequences and their order.
        training: fields of :class:`TrainSettings` (``steps``, ``lr``, ``patience``, ...).
        resume: continue the run in ``out``.
        progress: show a progress bar.
        callbacks: called after each step (see :func:`qkv.train.fit`).

    Raises:
        ValueError: a setting that differs from the resumed run's, or a bad value.
        CheckpointError: nothing to resume, or a damaged checkpoint.

    Example:
        >>> import tempfile
        >>> result = train_recall(tempfile.mkdtemp(), pairs=2, d_model=16, num_heads=2,
        ...                       validation_size=64, training={"steps": 4, "eval_every": 2},
        ...                       progress=False)
        >>> result.step, [row["step"] for row in result.rows]
        (4, [2, 4])
    """
    saved = saved_config(out) if resume else None
    given = {
        "pairs": pairs,
        "keys": keys,
        "values": values,
        "validation_size": validation_size,
        "d_model": d_model,
        "num_heads": num_heads,
        "layers": layers,
        "next_token": next_token,
        "dropout": dropout,
        "batch_size": batch_size,
        "seed": seed,
    }
    options = _recall_options(given, saved)
    check_recall(options)  # before anything is allocated
    settings = training_settings(training, saved, RECALL_TRAINING)
    task = _recall_task(options)
    seed_everything(options.seed)
    model = _recall_model(options, task)
    config = {
        "qkv": qkv_version(),
        "task": "recall",
        "seed": options.seed,
        "batch_size": options.batch_size,
        "model": model.config(),
        "data": task.data_config(),
    }
    title = f"recall: {options.pairs} pairs, {options.layers} layer(s)"
    return fit(
        model,
        task,
        settings,
        out,
        config=config,
        resume=resume,
        callbacks=callbacks,
        progress=progress,
        title=title,
    )


def _recall_options(given: Mapping[str, Any], saved: Mapping[str, Any] | None) -> RecallSettings:
    """Each given value, else the resumed run's, else :class:`RecallSettings`' default."""
    was = None if saved is None else {**saved["data"], **saved["model"], **saved}
    options = RecallSettings(**resolve(given, was, asdict(RecallSettings())))
    _check_heads(options.num_heads, options.d_model, option_name("d_model"))
    if options.pairs > options.keys:
        raise ValueError(
            f"{option_name('pairs')} {options.pairs}: expected at most {option_name('keys')} "
            f"({options.keys}) pairs, got {options.pairs}. Hint: the keys of a sequence are "
            f"all different; use --pairs {options.keys} or fewer, or more --keys"
        )
    return options


def _check_heads(heads: int, width: int, what: str) -> None:
    """``--heads`` must divide the model's width (``what``: where the width comes from)."""
    if width % heads:
        fits = ", ".join(str(h) for h in range(1, min(width, 64) + 1) if width % h == 0)
        raise ValueError(
            f"{option_name('num_heads')} {heads}: expected a number of heads that divides "
            f"{what} ({width}), got {heads}. Hint: each head takes an equal share of the "
            f"width; choose one of {fits}"
        )


def _recall_task(options: RecallSettings) -> RecallTask:
    """Fresh sequences at every step, and the held-out ones."""
    return RecallTask(
        pairs=options.pairs,
        keys=options.keys,
        values=options.values,
        batch_size=options.batch_size,
        validation_size=options.validation_size,
        seed=options.seed,
    )


def _recall_model(options: RecallSettings, task: RecallTask) -> RecallModel:
    """The transformer that reads a sequence and names the value of its query key."""
    return RecallModel(
        len(task.vocabulary),
        len(task.labels),
        d_model=options.d_model,
        num_heads=options.num_heads,
        layers=options.layers,
        next_token=options.next_token,
        dropout=options.dropout,
    )


@dataclass
class ClassifyResult:
    """The outcome of :func:`train_classifier`.

    Attributes:
        fit: the training (steps, best validation accuracy, metrics rows).
        drift: how far the embeddings moved from the word-vector file (None without
            ``embeddings``); also saved as ``OUT/embedding_drift.json``.
        frozen: whether the embeddings were frozen.
        vocabulary: the words the model knows. labels: its classes.
        embeddings_found: how many of the words had a vector in the file.
        source: the data: a file's absolute path, or ``"generated"``.
    """

    fit: FitResult
    drift: dict[str, Any] | None
    frozen: bool
    vocabulary: tuple[str, ...]
    labels: tuple[str, ...]
    embeddings_found: int | None = None
    source: str = GENERATED


def train_classifier(
    out: str | os.PathLike[str],
    data: str | os.PathLike[str] | LabelledTexts | None = None,
    *,
    text_column: str | None = None,
    label_column: str | None = None,
    group_column: str | None = None,
    model: str | None = None,
    embeddings: str | os.PathLike[str] | None = None,
    freeze: bool | None = None,
    embedding_dim: int | None = None,
    num_heads: int | None = None,
    dropout: float | None = None,
    batch_size: int | None = None,
    validation: float | None = None,
    max_length: int | None = None,
    lowercase: bool | None = None,
    min_count: int | None = None,
    sentences: int | None = None,
    seed: int | None = None,
    training: Mapping[str, Any] | None = None,
    resume: bool = False,
    progress: bool = True,
    callbacks: Callbacks = (),
) -> ClassifyResult:
    """Train a text classifier (attention, or the bag-of-words baseline); write the run.

    Args:
        out: the run's folder.
        data: a CSV/TSV/JSON Lines file, ``"generated"`` (the sentiment set qkv makes, of
            ``sentences`` sentences; the default), or :class:`LabelledTexts`. When resuming,
            the run's data by default.
        text_column, label_column: the columns of a file (default ``text`` and ``label``).
        group_column: rows with the same value here stay on the same side of the
            validation split (the generated set keeps each sentence with its twin).
        model: ``"attention"`` (:class:`AttentionClassifier`) or ``"bag-of-words"``.
        embeddings: a word-vector file (word2vec, GloVe, fastText) to start the embeddings
            from; words without a vector start random (``oov="random"``).
        freeze: keep the embeddings fixed (the default with ``embeddings``) or train them.
        embedding_dim: E without ``embeddings`` (with them, the file's).
        num_heads, dropout: the attention model.
        batch_size, validation (the share of rows held out), max_length (tokens kept per
            text), lowercase, min_count (rarer words become ``<unk>``), seed: the data.
        training: fields of :class:`TrainSettings`.
        resume, progress, callbacks: as in :func:`train_recall`.

    Raises:
        DataError: a file with missing columns, empty texts or labels.
        ValueError: bad settings, embeddings whose dimension disagrees with the run or
            ``embedding_dim``, settings that differ from the resumed run's.
        EmbeddingsFileError: a damaged word-vector file.
        CheckpointError: nothing to resume, or a damaged checkpoint.

    Example:
        >>> import tempfile
        >>> from qkv import data
        >>> result = train_classifier(
        ...     tempfile.mkdtemp(), "generated", sentences=40, num_heads=2,
        ...     embeddings=data.embedding_file("glove"), freeze=False,
        ...     training={"steps": 3, "eval_every": 3}, progress=False)
        >>> result.fit.step, result.labels, result.drift["identical"]
        (3, ('negative', 'positive'), False)
    """
    saved = saved_config(out) if resume else None
    given = {
        "model": model,
        "embedding_dim": embedding_dim,
        "num_heads": num_heads,
        "dropout": dropout,
        "batch_size": batch_size,
        "validation": validation,
        "max_length": max_length,
        "lowercase": lowercase,
        "min_count": min_count,
        "sentences": sentences,
        "seed": seed,
    }
    options = classify_options(given, saved)
    settings = training_settings(training, saved, CLASSIFY_TRAINING)
    columns = {"text_column": text_column, "label_column": label_column}
    options = with_columns(options, {**columns, "group_column": group_column}, saved)
    check_classify(options)  # before the data is read
    prepared = prepare_texts(data, options, saved)
    vectors = pretrained(
        embeddings, prepared.vocabulary, given_dim=embedding_dim, seed=options.seed, saved=saved
    )
    if vectors is not None:
        options = replace(options, embedding_dim=vectors[0].shape[1])
    if options.model == "attention":
        width = "the word vectors' width" if vectors is not None else option_name("embedding_dim")
        _check_heads(options.num_heads, options.embedding_dim, width)
    frozen = freeze_choice(freeze, vectors is not None or (saved or {}).get("embeddings"), saved)
    seed_everything(options.seed)
    net, extra = build_classifier(options, prepared, vectors, frozen, saved, out)
    config = classify_config(
        options, net, prepared, embeddings_config(embeddings, vectors, frozen, saved)
    )
    result = fit(
        net,
        prepared.task,
        settings,
        out,
        config=config,
        resume=resume,
        extra_state=extra,
        callbacks=callbacks,
        progress=progress,
        title=f"classify ({options.model}): {Path(prepared.texts.source).name}",
    )
    drift = drift_report(out, extra, config, prepared.vocabulary, frozen)
    emb = config["embeddings"]
    return ClassifyResult(
        fit=result,
        drift=drift,
        frozen=frozen,
        vocabulary=prepared.vocabulary.tokens,
        labels=prepared.labels,
        embeddings_found=None if emb is None else emb["found"],
        source=config["data"]["source"],
    )
