"""Whole training runs: ``train_recall`` and ``train_classifier`` (what ``qkv train`` calls).

Every setting defaults to None, which means: the run's own value when resuming, else the
default of :data:`RECALL_DEFAULTS` / :data:`CLASSIFY_DEFAULTS`. A resumed run must keep its
model, data and seed (a different value is an error that names it); the training settings
(steps, learning rate, evaluation, early stopping) may change.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.data import Vocabulary
from qkv.train._checkpoint import (
    CheckpointError,
    check_run_config,
    latest_checkpoint,
    load_checkpoint,
)
from qkv.train._drift import embedding_drift
from qkv.train._loop import BEST, CHECKPOINTS, FitResult, StepInfo, TrainSettings, fit
from qkv.train._models import AttentionClassifier, BagOfWords, RecallModel
from qkv.train._tasks import PAD, UNK, ClassifyTask, RecallTask, encode_texts
from qkv.train._text import GENERATED, LabelledTexts, generated_texts, read_labelled, split_rows

__all__ = [
    "CLASSIFY_DEFAULTS",
    "CLASSIFY_TRAINING",
    "DRIFT",
    "RECALL_DEFAULTS",
    "RECALL_TRAINING",
    "ClassifyResult",
    "seed_everything",
    "train_classifier",
    "train_recall",
]

DRIFT = "embedding_drift.json"

RECALL_DEFAULTS: dict[str, Any] = {
    "pairs": 8,
    "keys": 26,
    "values": 10,
    "validation_size": 2000,
    "d_model": 64,
    "num_heads": 4,
    "layers": 1,
    "next_token": True,
    "dropout": 0.0,
    "batch_size": 64,
    "seed": 0,
}
RECALL_TRAINING: dict[str, Any] = {
    "steps": 2000,
    "lr": 3e-3,
    "eval_every": 50,
    "patience": 10,
    "target_accuracy": None,
}
CLASSIFY_DEFAULTS: dict[str, Any] = {
    "model": "attention",
    "embedding_dim": 32,
    "num_heads": 2,
    "dropout": 0.1,
    "batch_size": 32,
    "validation": 0.2,
    "max_length": 64,
    "lowercase": True,
    "min_count": 1,
    "sentences": 2000,
    "seed": 0,
}
CLASSIFY_TRAINING: dict[str, Any] = {
    "steps": 1500,
    "lr": 3e-3,
    "eval_every": 50,
    "patience": 10,
    "target_accuracy": None,
}

Callbacks = Sequence[Callable[[StepInfo], None]]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's random generators (what ``--seed`` does)."""
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
    saved = _saved_config(out) if resume else None
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
    was = None if saved is None else {**saved["data"], **saved["model"], **saved}
    options = _resolve(given, was, RECALL_DEFAULTS)
    settings = _settings(training, saved, RECALL_TRAINING)
    task = RecallTask(
        pairs=options["pairs"],
        keys=options["keys"],
        values=options["values"],
        batch_size=options["batch_size"],
        validation_size=options["validation_size"],
        seed=options["seed"],
    )
    seed_everything(options["seed"])
    model = RecallModel(
        len(task.vocabulary),
        len(task.labels),
        d_model=options["d_model"],
        num_heads=options["num_heads"],
        layers=options["layers"],
        next_token=options["next_token"],
        dropout=options["dropout"],
    )
    config = {
        "qkv": _version(),
        "task": "recall",
        "seed": options["seed"],
        "batch_size": options["batch_size"],
        "model": model.config(),
        "data": task.data_config(),
    }
    title = f"recall: {options['pairs']} pairs, {options['layers']} layer(s)"
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
    saved = _saved_config(out) if resume else None
    was_data = None if saved is None else saved["data"]
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
    was = None
    if saved is not None:
        was = {**saved["data"], **saved["model"], **saved}
        was["model"] = saved["model"]["kind"]
    options = _resolve(given, was, CLASSIFY_DEFAULTS)
    if options["model"] not in (AttentionClassifier.kind, BagOfWords.kind):
        raise ValueError(
            f"--model must be {AttentionClassifier.kind!r} or {BagOfWords.kind!r}, got "
            f"{options['model']!r}. Hint: bag-of-words is the baseline that ignores word order."
        )
    settings = _settings(training, saved, CLASSIFY_TRAINING)
    columns = _resolve(  # another file may name its columns differently
        {"text_column": text_column, "label_column": label_column},
        was_data,
        {"text_column": "text", "label_column": "label"},
        new_values_allowed=True,
    )
    columns |= _resolve({"group_column": group_column}, was_data, {"group_column": None})
    texts = _texts(data, was_data, columns, options["sentences"])
    if was_data is not None and texts.fingerprint() != was_data["fingerprint"]:
        raise ValueError(
            f"--data {texts.source!r} is not the data the run was trained on (its texts or "
            "labels differ). Hint: resume with the same data, or start a new run with another "
            "--out."
        )
    train_rows, val_rows = split_rows(
        len(texts), options["validation"], seed=options["seed"], groups=texts.groups
    )
    if was_data is not None:
        vocabulary = Vocabulary(was_data["vocabulary"])
        labels = tuple(was_data["labels"])
    else:
        words = [
            " ".join(_tokens(texts.texts[i], options))
            for i in train_rows  # the vocabulary of the training rows only
        ]
        vocabulary = Vocabulary.from_texts(
            words, specials=(PAD, UNK), min_count=options["min_count"]
        )
        labels = tuple(sorted(set(texts.labels)))
    if len(labels) < 2:
        raise ValueError(
            f"the data has one label only ({labels[0]!r}); a classifier needs at least two. "
            "Hint: check --label-column."
        )
    encode = {"lowercase": options["lowercase"], "max_length": options["max_length"]}
    task = ClassifyTask(
        encode_texts(texts, train_rows, vocabulary, labels, **encode),
        encode_texts(texts, val_rows, vocabulary, labels, **encode),
        labels=labels,
        batch_size=options["batch_size"],
        seed=options["seed"],
    )
    vectors = _pretrained(
        embeddings, vocabulary, given_dim=embedding_dim, seed=options["seed"], saved=saved
    )
    if vectors is not None:
        options["embedding_dim"] = vectors[0].shape[1]
    frozen = _freeze(freeze, vectors is not None or (saved or {}).get("embeddings"), saved)
    seed_everything(options["seed"])
    if options["model"] == AttentionClassifier.kind:
        net: torch.nn.Module = AttentionClassifier(
            len(vocabulary),
            len(labels),
            embedding_dim=options["embedding_dim"],
            num_heads=options["num_heads"],
            dropout=options["dropout"],
        )
    else:
        net = BagOfWords(len(vocabulary), len(labels), embedding_dim=options["embedding_dim"])
    table: torch.nn.Embedding = net.embedding  # type: ignore[assignment]
    extra: dict[str, Any] = {}
    if saved is not None and saved.get("embeddings"):
        extra["embedding_start"] = _saved_start(out)  # the weights come from the checkpoint
    elif vectors is not None:
        with torch.no_grad():
            table.weight.copy_(torch.from_numpy(vectors[0]))
        extra["embedding_start"] = table.weight.detach().clone()
    table.weight.requires_grad_(not frozen)
    config = {
        "qkv": _version(),
        "task": "classify",
        "seed": options["seed"],
        "batch_size": options["batch_size"],
        "model": net.config(),  # type: ignore[operator]
        "data": {
            "source": texts.source if texts.source == GENERATED else os.path.abspath(texts.source),
            "sentences": options["sentences"] if texts.source == GENERATED else None,
            **columns,
            "validation": options["validation"],
            "lowercase": options["lowercase"],
            "max_length": options["max_length"],
            "min_count": options["min_count"],
            "fingerprint": texts.fingerprint(),
            "train_rows": len(train_rows),
            "validation_rows": len(val_rows),
            "vocabulary": list(vocabulary.tokens),
            "labels": list(labels),
        },
        "embeddings": _embeddings_config(embeddings, vectors, frozen, saved),
    }
    title = f"classify ({options['model']}): {Path(texts.source).name}"
    result = fit(
        net,
        task,
        settings,
        out,
        config=config,
        resume=resume,
        extra_state=extra,
        callbacks=callbacks,
        progress=progress,
        title=title,
    )
    drift = None
    if "embedding_start" in extra:
        best = load_checkpoint(Path(out) / BEST)
        found = (config["embeddings"] or {}).get("pretrained_words")
        drift = embedding_drift(
            extra["embedding_start"].numpy(),
            best.tensors["embedding.weight"].numpy(),
            vocabulary.tokens,
            pretrained=found,
        )
        drift["frozen"] = frozen
        drift["step"] = best.step
        _write_json(Path(out) / DRIFT, drift)
    emb = config["embeddings"]
    return ClassifyResult(
        fit=result,
        drift=drift,
        frozen=frozen,
        vocabulary=vocabulary.tokens,
        labels=labels,
        embeddings_found=None if emb is None else emb["found"],
        source=config["data"]["source"],
    )


# -- helpers --------------------------------------------------------------------------------


def _version() -> str:
    from qkv import __version__

    return __version__


_OPTION_NAMES = {
    "d_model": "--d-model",
    "num_heads": "--heads",
    "validation_size": "--validation-size",
    "next_token": "--no-next-token",
    "batch_size": "--batch-size",
    "embedding_dim": "--embedding-dim",
    "max_length": "--max-length",
    "lowercase": "--keep-case",
    "min_count": "--min-count",
    "text_column": "--text-column",
    "label_column": "--label-column",
    "group_column": "--group-column",
}


def option_name(key: str) -> str:
    """The command-line option of a setting (``d_model`` → ``--d-model``)."""
    return _OPTION_NAMES.get(key, "--" + key.replace("_", "-"))


def _resolve(
    given: Mapping[str, Any],
    saved: Mapping[str, Any] | None,
    defaults: Mapping[str, Any],
    *,
    new_values_allowed: bool = False,
) -> dict[str, Any]:
    out = {}
    for key, value in given.items():
        if saved is not None and key in saved:
            if value is not None and value != saved[key] and not new_values_allowed:
                raise ValueError(
                    f"{option_name(key)} {value!r} differs from the run being resumed, which "
                    f"has {saved[key]!r}. Hint: leave {option_name(key)} out to keep the run's, "
                    "or start a new run with another --out."
                )
            out[key] = saved[key] if value is None else value
        else:
            out[key] = defaults[key] if value is None else value
    return out


def _settings(
    training: Mapping[str, Any] | None, saved: Mapping[str, Any] | None, defaults: Mapping[str, Any]
) -> TrainSettings:
    names = {f.name for f in fields(TrainSettings)}
    given = dict(training or {})
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"unknown training settings {unknown}; expected some of {sorted(names)}.")
    base = {**defaults, **(saved or {}).get("training", {})}
    merged = {k: v for k, v in base.items() if k in names}
    merged.update(given)
    return TrainSettings(**merged)


def _saved_config(out: str | os.PathLike[str]) -> dict[str, Any]:
    where = Path(out) / CHECKPOINTS
    if latest_checkpoint(where) is None:
        raise CheckpointError(
            "nothing to resume: no checkpoint in checkpoints/",
            path=out,
            hint="give the --out folder of an earlier run, or start without --resume",
        )
    checkpoint = load_checkpoint(where)
    check_run_config(checkpoint)  # before a model is built from it
    return checkpoint.config


def _saved_start(out: str | os.PathLike[str]) -> torch.Tensor:
    state = load_checkpoint(Path(out) / CHECKPOINTS).state
    start: torch.Tensor = state["extra"]["embedding_start"]
    return start


def _texts(
    data: str | os.PathLike[str] | LabelledTexts | None,
    saved: Mapping[str, Any] | None,
    columns: Mapping[str, Any],
    sentences: int,
) -> LabelledTexts:
    if isinstance(data, LabelledTexts):
        return data
    source = data if data is not None else (saved["source"] if saved else GENERATED)
    if os.fspath(source) == GENERATED:
        return generated_texts(sentences)
    try:
        return read_labelled(
            source,
            text_column=columns["text_column"],
            label_column=columns["label_column"],
            group_column=columns["group_column"],
        )
    except OSError as error:
        raise ValueError(
            f"--data {os.fspath(source)!r}: cannot read it ({error.strerror or error}). Hint: "
            "give a CSV or JSON Lines file, or --data generated for the set qkv makes."
        ) from None


def _tokens(text: str, options: Mapping[str, Any]) -> list[str]:
    from qkv.train._text import tokenize

    tokens = tokenize(text, lowercase=options["lowercase"])
    return tokens[: options["max_length"]]


def _pretrained(
    path: str | os.PathLike[str] | None,
    vocabulary: Vocabulary,
    *,
    given_dim: int | None,
    seed: int,
    saved: Mapping[str, Any] | None,
) -> tuple[np.ndarray, list[bool]] | None:
    """The starting matrix (V, E) from a word-vector file, and which words it had."""
    if path is None:
        return None
    from qkv import embeddings as vectors_io

    shown = os.fspath(path)
    try:
        dim = vectors_io.load(path, limit=1).dim
        vectors = vectors_io.load(path, vocabulary=vocabulary.tokens)
    except OSError as error:
        raise ValueError(
            f"--embeddings {shown!r}: cannot read it ({error.strerror or error}). "
            "Hint: give a word2vec (text or binary), GloVe or fastText .vec file."
        ) from None
    expected = None if saved is None else saved["model"].get("embedding_dim")
    if expected is not None and dim != expected:
        raise ValueError(
            f"--embeddings {shown!r} has vectors of {dim} numbers, but the checkpoint's "
            f"embeddings have {expected}. Hint: resume with the word vectors the run started "
            "from, or leave --embeddings out (the checkpoint holds the embeddings)."
        )
    if saved is None and given_dim is not None and given_dim != dim:
        raise ValueError(
            f"--embedding-dim {given_dim} disagrees with --embeddings {shown!r}, whose vectors "
            f"have {dim} numbers. Hint: leave --embedding-dim out; the file sets it."
        )
    if not len(vectors):
        raise ValueError(
            f"--embeddings {shown!r}: none of the {len(vocabulary) - 2} words of the training "
            "texts has a vector in it. Hint: check that the file's words are in the same case "
            "as the texts (--keep-case keeps capitals)."
        )
    matrix = vectors.lookup(vocabulary.tokens, oov="random", seed=seed)
    matrix[vocabulary.index[PAD]] = 0.0
    return matrix, [word in vectors for word in vocabulary.tokens]


def _freeze(freeze: bool | None, pretrained: Any, saved: Mapping[str, Any] | None) -> bool:
    was = None if saved is None or not saved.get("embeddings") else saved["embeddings"]["freeze"]
    if was is not None and freeze is not None and freeze != was:
        raise ValueError(
            f"--{'freeze' if freeze else 'fine-tune'}-embeddings differs from the run being "
            f"resumed, which {'froze' if was else 'fine-tuned'} them. Hint: leave the option out."
        )
    if was is not None:
        return bool(was)
    if freeze and not pretrained:
        raise ValueError(
            "--freeze-embeddings needs --embeddings FILE: without word vectors the embeddings "
            "start random and must be trained. Hint: add --embeddings, e.g. the small file of "
            "'python -m qkv.data DIR'."
        )
    return bool(pretrained) if freeze is None else freeze


def _embeddings_config(
    path: str | os.PathLike[str] | None,
    vectors: tuple[np.ndarray, list[bool]] | None,
    frozen: bool,
    saved: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    if vectors is None:
        return None if saved is None else saved.get("embeddings")
    assert path is not None
    found = vectors[1]
    words = found[2:]  # after <pad> and <unk>
    return {
        "path": os.path.abspath(os.fspath(path)),
        "dim": int(vectors[0].shape[1]),
        "found": int(sum(words)),
        "missing": len(words) - int(sum(words)),
        "freeze": frozen,
        "pretrained_words": found,
    }


def _write_json(path: Path, data: Any) -> None:
    from qkv._io import write_atomic

    write_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
