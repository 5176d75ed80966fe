"""The stages of a text-classification run (:func:`qkv.train.train_classifier`).

:func:`classify_options` → :func:`prepare_texts` (read, split, vocabulary, encode) →
:func:`pretrained` (word vectors) → :func:`build_classifier` → :func:`classify_config` →
``fit`` → :func:`drift_report`. Each stage takes the settings it needs and what the earlier
stages made; they run in this order, so that the random numbers, and a resumed run, stay the
same.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from qkv._io import write_atomic
from qkv._train_settings import ClassifySettings
from qkv.data import Vocabulary
from qkv.train._checkpoint import load_checkpoint
from qkv.train._drift import embedding_drift
from qkv.train._loop import BEST
from qkv.train._models import AttentionClassifier, BagOfWords
from qkv.train._resolve import qkv_version, resolve, saved_start
from qkv.train._tasks import PAD, UNK, ClassifyTask, encode_texts
from qkv.train._text import (
    GENERATED,
    LabelledTexts,
    generated_texts,
    read_labelled,
    split_rows,
    tokenize,
)

__all__ = [
    "DRIFT",
    "PreparedTexts",
    "build_classifier",
    "classify_config",
    "classify_options",
    "drift_report",
    "embeddings_config",
    "freeze_choice",
    "prepare_texts",
    "pretrained",
    "with_columns",
]

DRIFT = "embedding_drift.json"
_DEFAULTS = ClassifySettings()


@dataclass(frozen=True)
class PreparedTexts:
    """The data of a run: the texts, their split, the vocabulary, the labels and the task."""

    texts: LabelledTexts
    train_rows: list[int]
    val_rows: list[int]
    vocabulary: Vocabulary
    labels: tuple[str, ...]
    task: ClassifyTask


def classify_options(given: Mapping[str, Any], saved: Mapping[str, Any] | None) -> ClassifySettings:
    """The model and data settings: each given value, else the resumed run's, else the
    default (the columns keep their defaults here: :func:`with_columns`).

    Raises:
        ValueError: a model other than attention or bag-of-words, or a value that differs
            from the resumed run's.
    """
    was = None
    if saved is not None:
        was = {**saved["data"], **saved["model"], **saved}
        was["model"] = saved["model"]["kind"]
    options = resolve(given, was, {key: getattr(_DEFAULTS, key) for key in given})
    if options["model"] not in (AttentionClassifier.kind, BagOfWords.kind):
        raise ValueError(
            f"--model must be {AttentionClassifier.kind!r} or {BagOfWords.kind!r}, got "
            f"{options['model']!r}. Hint: bag-of-words is the baseline that ignores word order."
        )
    return replace(_DEFAULTS, **options)


def with_columns(
    options: ClassifySettings,
    columns: Mapping[str, str | None],
    saved: Mapping[str, Any] | None,
) -> ClassifySettings:
    """``options`` with the data file's columns: given, else the resumed run's, else the
    defaults. Another file may name its text and label columns differently, so a resumed run
    may change those; not its groups."""
    was_data = None if saved is None else saved["data"]
    names = ("text_column", "label_column")
    resolved = resolve(  # another file may name its columns differently
        {key: columns[key] for key in names},
        was_data,
        {key: getattr(_DEFAULTS, key) for key in names},
        new_values_allowed=True,
    )
    resolved |= resolve(
        {"group_column": columns["group_column"]},
        was_data,
        {"group_column": _DEFAULTS.group_column},
    )
    return replace(options, **resolved)


def prepare_texts(
    data: str | os.PathLike[str] | LabelledTexts | None,
    options: ClassifySettings,
    saved: Mapping[str, Any] | None,
) -> PreparedTexts:
    """Read (or generate) the texts, split them, build the vocabulary of the training rows
    (a resumed run keeps its own) and encode both sides into the task's batches.

    Raises:
        ValueError: data that is not the resumed run's, or with one label only.
        DataError: a file with missing columns, empty texts or labels.
    """
    was_data = None if saved is None else saved["data"]
    texts = _texts(data, was_data, options)
    if was_data is not None and texts.fingerprint() != was_data["fingerprint"]:
        raise ValueError(
            f"--data {texts.source!r} is not the data the run was trained on (its texts or "
            "labels differ). Hint: resume with the same data, or start a new run with another "
            "--out."
        )
    train_rows, val_rows = split_rows(
        len(texts), options.validation, seed=options.seed, groups=texts.groups
    )
    if was_data is not None:
        vocabulary = Vocabulary(was_data["vocabulary"])
        labels = tuple(was_data["labels"])
    else:
        words = [
            " ".join(_tokens(texts.texts[i], options))
            for i in train_rows  # the vocabulary of the training rows only
        ]
        vocabulary = Vocabulary.from_texts(words, specials=(PAD, UNK), min_count=options.min_count)
        if len(vocabulary) == 2:  # <pad> and <unk> alone: every word would be <unk>
            _no_word_left(words, options.min_count)
        labels = tuple(sorted(set(texts.labels)))
    if len(labels) < 2:
        raise ValueError(
            f"the data has one label only ({labels[0]!r}); a classifier needs at least two. "
            "Hint: check --label-column."
        )
    encode = functools.partial(
        encode_texts, lowercase=options.lowercase, max_length=options.max_length
    )
    task = ClassifyTask(
        encode(texts, train_rows, vocabulary, labels),
        encode(texts, val_rows, vocabulary, labels),
        labels=labels,
        batch_size=options.batch_size,
        seed=options.seed,
    )
    return PreparedTexts(texts, train_rows, val_rows, vocabulary, labels, task)


def _no_word_left(texts: Sequence[str], min_count: int) -> NoReturn:
    """The error of a ``--min-count`` that leaves no word in the vocabulary."""
    counts = Counter(word for text in texts for word in text.split())
    if not counts:
        raise ValueError(
            "the training texts hold no word. Hint: check --text-column, or the data file"
        )
    word, most = counts.most_common(1)[0]
    raise ValueError(
        f"--min-count {min_count}: expected a count some word reaches, but the most "
        f"frequent word of the training texts ({word!r}) appears {most:,} times, so every "
        f"word would be {UNK}. Hint: --min-count {most} or lower (the default is 1)"
    )


def build_classifier(
    options: ClassifySettings,
    prepared: PreparedTexts,
    vectors: tuple[np.ndarray, list[bool]] | None,
    frozen: bool,
    saved: Mapping[str, Any] | None,
    out: str | os.PathLike[str],
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model, its embeddings started from the word vectors (or, resuming, as the run
    started them) and frozen or not; and the extra state the checkpoints keep (the starting
    embeddings, to measure the drift against). Seed the generators first."""
    vocabulary, labels = prepared.vocabulary, prepared.labels
    if options.model == AttentionClassifier.kind:
        net: torch.nn.Module = AttentionClassifier(
            len(vocabulary),
            len(labels),
            embedding_dim=options.embedding_dim,
            num_heads=options.num_heads,
            dropout=options.dropout,
        )
    else:
        net = BagOfWords(len(vocabulary), len(labels), embedding_dim=options.embedding_dim)
    table: torch.nn.Embedding = net.embedding  # type: ignore[assignment]
    extra: dict[str, Any] = {}
    if saved is not None and saved.get("embeddings"):
        extra["embedding_start"] = saved_start(out)  # the weights come from the checkpoint
    elif vectors is not None:
        with torch.no_grad():
            table.weight.copy_(torch.from_numpy(vectors[0]))
        extra["embedding_start"] = table.weight.detach().clone()
    table.weight.requires_grad_(not frozen)
    return net, extra


def classify_config(
    options: ClassifySettings,
    net: torch.nn.Module,
    prepared: PreparedTexts,
    embeddings: dict[str, Any] | None,
) -> dict[str, Any]:
    """What the run's checkpoints record: the model, the data (to check a resumed run
    against) and the word vectors."""
    texts = prepared.texts
    generated = texts.source == GENERATED
    return {
        "qkv": qkv_version(),
        "task": "classify",
        "seed": options.seed,
        "batch_size": options.batch_size,
        "model": net.config(),  # type: ignore[operator]
        "data": {
            "source": texts.source if generated else os.path.abspath(texts.source),
            "sentences": options.sentences if generated else None,
            "text_column": options.text_column,
            "label_column": options.label_column,
            "group_column": options.group_column,
            "validation": options.validation,
            "lowercase": options.lowercase,
            "max_length": options.max_length,
            "min_count": options.min_count,
            "fingerprint": texts.fingerprint(),
            "train_rows": len(prepared.train_rows),
            "validation_rows": len(prepared.val_rows),
            "vocabulary": list(prepared.vocabulary.tokens),
            "labels": list(prepared.labels),
        },
        "embeddings": embeddings,
    }


def drift_report(
    out: str | os.PathLike[str],
    extra: Mapping[str, Any],
    config: Mapping[str, Any],
    vocabulary: Vocabulary,
    frozen: bool,
) -> dict[str, Any] | None:
    """How far the best checkpoint's embeddings moved from where they started, written to
    ``OUT/embedding_drift.json`` (None when they did not start from word vectors)."""
    if "embedding_start" not in extra:
        return None
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
    return drift


def _texts(
    data: str | os.PathLike[str] | LabelledTexts | None,
    saved: Mapping[str, Any] | None,
    options: ClassifySettings,
) -> LabelledTexts:
    if isinstance(data, LabelledTexts):
        return data
    source = data if data is not None else (saved["source"] if saved else GENERATED)
    if os.fspath(source) == GENERATED:
        return generated_texts(options.sentences)
    try:
        return read_labelled(
            source,
            text_column=options.text_column,
            label_column=options.label_column,
            group_column=options.group_column,
        )
    except OSError as error:
        raise ValueError(
            f"--data {os.fspath(source)!r}: cannot read it ({error.strerror or error}). Hint: "
            "give a CSV or JSON Lines file, or --data generated for the set qkv makes."
        ) from None


def _tokens(text: str, options: ClassifySettings) -> list[str]:
    tokens = tokenize(text, lowercase=options.lowercase)
    return tokens[: options.max_length]


def pretrained(
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
    from qkv.embeddings import load as load_vectors

    shown = os.fspath(path)
    try:
        dim = load_vectors(path, limit=1).dim
        vectors = load_vectors(path, vocabulary=vocabulary.tokens)
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


def freeze_choice(freeze: bool | None, pretrained: Any, saved: Mapping[str, Any] | None) -> bool:
    """Whether the embeddings stay fixed: the resumed run's choice, else ``freeze``, else
    fixed exactly when they start from word vectors."""
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


def embeddings_config(
    path: str | os.PathLike[str] | None,
    vectors: tuple[np.ndarray, list[bool]] | None,
    frozen: bool,
    saved: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    """The word vectors the run started from, for its config (None without them)."""
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
    write_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
