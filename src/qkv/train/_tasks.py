"""The two training tasks: what a batch is at each step, and the validation set.

A task's batch at step ``s`` depends only on its seed and ``s``, so a run resumed at step
``s`` sees exactly the batches the uninterrupted run would have seen.

Shape legend: B batch, L tokens (padded to the longest of the batch), N examples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qkv.data import Vocabulary, recall
from qkv.train._text import DataError, LabelledTexts, tokenize

__all__ = ["Batch", "ClassifyTask", "Encoded", "RecallTask", "derived_seed", "encode_texts"]

PAD, UNK = "<pad>", "<unk>"


@dataclass(frozen=True)
class Batch:
    """A batch: ``tokens`` (B, L) int64 padded with id 0, ``lengths`` (B,), ``targets`` (B,)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.targets.shape[0])


def derived_seed(seed: int, *stream: int) -> int:
    """A seed for one stream of random numbers of a run (independent of the others).

    Example:
        >>> derived_seed(0, 1, 5) == derived_seed(0, 1, 5) != derived_seed(0, 1, 6)
        True
    """
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, np.uint64)[0])


class RecallTask:
    """Associative recall with fresh sequences at every step (:func:`qkv.data.recall`).

    The classes are the value tokens; the model reads the answer at the last (query)
    position. The validation sequences come from their own seed, so they are held out.

    Example:
        >>> task = RecallTask(pairs=2, batch_size=3, seed=0)
        >>> batch = task.train_batch(0)
        >>> batch.tokens.shape, task.labels[:3]
        (torch.Size([3, 5]), ('0', '1', '2'))
    """

    name = "recall"

    def __init__(
        self,
        *,
        pairs: int = 8,
        keys: int = 26,
        values: int = 10,
        batch_size: int = 64,
        validation_size: int = 2000,
        seed: int = 0,
    ) -> None:
        probe = recall(1, pairs=pairs, keys=keys, values=values, seed=0)  # checks the numbers
        self.pairs, self.keys, self.values = pairs, keys, values
        self.batch_size, self.validation_size, self.seed = batch_size, validation_size, seed
        self.vocabulary = probe.vocabulary
        self.labels: tuple[str, ...] = tuple(probe.vocabulary.tokens[keys:])

    def data_config(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "keys": self.keys,
            "values": self.values,
            "validation_size": self.validation_size,
            "vocabulary": list(self.vocabulary.tokens),
            "labels": list(self.labels),
        }

    def sequences(self, n: int, seed: int) -> Batch:
        """``n`` sequences drawn with ``seed``, as a batch."""
        made = recall(n, pairs=self.pairs, keys=self.keys, values=self.values, seed=seed)
        tokens = torch.from_numpy(made.tokens)  # (N, 2·P + 1)
        lengths = torch.full((n,), tokens.shape[1], dtype=torch.int64)
        return Batch(tokens, lengths, torch.from_numpy(made.targets - self.keys))

    def train_batch(self, step: int) -> Batch:
        return self.sequences(self.batch_size, derived_seed(self.seed, 1, step))

    def validation_batches(self) -> Iterator[Batch]:
        whole = self.sequences(self.validation_size, derived_seed(self.seed, 2))
        yield from _chunks(whole, 1024)

    def test_batches(self, n: int, seed: int = 0) -> Iterator[Batch]:
        """Held-out sequences for ``qkv evaluate``: a stream apart from training and
        validation."""
        yield from _chunks(self.sequences(n, derived_seed(self.seed, 3, seed)), 1024)


@dataclass(frozen=True)
class Encoded:
    """Texts as token ids: ``ids[i]`` the ids of text i (at most ``max_length``), ``targets``
    (N,) the class of each, ``tokens`` the words of each (for explanations and reports)."""

    ids: tuple[np.ndarray, ...]
    targets: np.ndarray
    tokens: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows: Sequence[int] | np.ndarray) -> Batch:
        """The rows as one batch, padded with id 0 to the longest."""
        chosen = [self.ids[int(i)] for i in rows]
        lengths = [len(ids) for ids in chosen]
        tokens = np.zeros((len(chosen), max(lengths)), dtype=np.int64)  # (B, L)
        for row, ids in enumerate(chosen):
            tokens[row, : len(ids)] = ids
        return Batch(
            torch.from_numpy(tokens),
            torch.tensor(lengths, dtype=torch.int64),
            torch.from_numpy(self.targets[np.asarray(rows, dtype=np.int64)]),
        )


def encode_texts(
    texts: LabelledTexts,
    rows: Sequence[int],
    vocabulary: Vocabulary,
    labels: Sequence[str],
    *,
    lowercase: bool,
    max_length: int,
) -> Encoded:
    """Token ids and class ids of some rows; unknown words get the id of ``<unk>``.

    Raises:
        ValueError: a label that is not one of ``labels`` (naming the line and the labels).
    """
    label_ids = {label: i for i, label in enumerate(labels)}
    ids, targets, words = [], [], []
    for i in rows:
        label = texts.labels[i]
        if label not in label_ids:
            shown = ", ".join(repr(x) for x in labels)
            raise DataError(
                f"the label {label!r} is not one the model knows ({shown})",
                source=texts.source,
                line=texts.lines[i],
                hint="a model predicts only the labels it was trained on; fix the label or "
                "train a model with it",
            )
        tokens = tuple(tokenize(texts.texts[i], lowercase=lowercase)[:max_length])
        ids.append(vocabulary.encode(tokens, unknown=UNK))
        targets.append(label_ids[label])
        words.append(tokens)
    return Encoded(tuple(ids), np.array(targets, dtype=np.int64), tuple(words))


class ClassifyTask:
    """Text classification: a shuffled pass over the training rows per epoch.

    The order of epoch ``e`` is a permutation drawn from the seed and ``e``, so the batch at
    any step is known without replaying the ones before it.

    Example:
        >>> from qkv.train._text import generated_texts
        >>> texts = generated_texts(20)
        >>> vocabulary = Vocabulary.from_texts(texts.texts, specials=(PAD, UNK))
        >>> labels = ("negative", "positive")
        >>> train = encode_texts(texts, range(16), vocabulary, labels, lowercase=True,
        ...                      max_length=64)
        >>> val = encode_texts(texts, range(16, 20), vocabulary, labels, lowercase=True,
        ...                    max_length=64)
        >>> task = ClassifyTask(train, val, labels=labels, batch_size=8, seed=0)
        >>> len(task.train_batch(0)), len(task.train_batch(1)), task.steps_per_epoch
        (8, 8, 2)
    """

    name = "classify"

    def __init__(
        self,
        train: Encoded,
        validation: Encoded,
        *,
        labels: Sequence[str],
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        self.train, self.validation = train, validation
        self.labels = tuple(labels)
        self.batch_size, self.seed = batch_size, seed
        self.steps_per_epoch = -(-len(train) // batch_size)
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng(derived_seed(self.seed, 4, epoch))
            self._order = (epoch, rng.permutation(len(self.train)))
        return self._order[1]

    def train_batch(self, step: int) -> Batch:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        return self.train.batch(order[index * self.batch_size : (index + 1) * self.batch_size])

    def validation_batches(self) -> Iterator[Batch]:
        yield from batches_of(self.validation, 256)


def batches_of(encoded: Encoded, size: int) -> Iterator[Batch]:
    """The rows of ``encoded`` in order, ``size`` at a time."""
    for start in range(0, len(encoded), size):
        yield encoded.batch(range(start, min(start + size, len(encoded))))


def _chunks(batch: Batch, size: int) -> Iterator[Batch]:
    for start in range(0, len(batch), size):
        end = start + size
        yield Batch(batch.tokens[start:end], batch.lengths[start:end], batch.targets[start:end])
