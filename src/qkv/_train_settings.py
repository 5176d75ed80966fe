"""The settings of a training run, declared once: their names, types and defaults.

``qkv train``'s help, :func:`qkv.train.train_recall`, :func:`qkv.train.train_classifier` and
docs/training.md (checked by a test) all read their defaults from these frozen dataclasses:

- :class:`TrainSettings`: how to train (steps, AdamW, evaluation, early stopping), with
  :data:`RECALL_TRAINING` and :data:`CLASSIFY_TRAINING`, each task's defaults;
- :class:`RecallSettings`: the sequences and the model of associative recall;
- :class:`ClassifySettings`: the data and the model of text classification.

Plain data without PyTorch (this module sits outside ``qkv.train``, whose import needs
PyTorch), so that ``qkv --help`` and ``qkv explain`` build the command line without it.

Example:
    >>> RecallSettings().d_model, CLASSIFY_TRAINING.steps, TrainSettings().lr
    (64, 1500, 0.003)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "CLASSIFY_TRAINING",
    "RECALL_TRAINING",
    "ClassifySettings",
    "RecallSettings",
    "TrainSettings",
]


@dataclass(frozen=True)
class TrainSettings:
    """How to train.

    Attributes:
        steps: stop after this many optimizer steps (in all, counting a resumed run's).
        lr: AdamW's learning rate (after the warm-up).
        weight_decay: AdamW's decoupled weight decay, on the weight matrices of the linear
            layers only (not on embeddings, norms or biases).
        warmup: steps over which the learning rate rises linearly from 0 to ``lr``.
        eval_every: evaluate on the validation set (and save a checkpoint) every this many
            steps, and at the last step.
        patience: stop when this many evaluations in a row do not improve the validation
            accuracy (or its loss at equal accuracy); None never stops early.
        target_accuracy: stop as soon as the validation accuracy reaches this; None: never.
        clip: clip the gradients' global L2 norm to this; None: no clipping.
        keep: how many checkpoints to keep in ``checkpoints/``.
    """

    steps: int = 1000
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 0
    eval_every: int = 100
    patience: int | None = 10
    target_accuracy: float | None = None
    clip: float | None = 1.0
    keep: int = 2

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("eval_every", 1), ("warmup", 0), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}.")
        if self.patience is not None and (not isinstance(self.patience, int) or self.patience < 1):
            raise ValueError(
                f"patience must be a whole number >= 1 or None, got {self.patience!r}."
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}. Hint: 3e-3.")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(
                f"target_accuracy must be in (0, 1], got {self.target_accuracy!r}. Hint: 0.99."
            )
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive or None, got {self.clip!r}.")

    def lr_at(self, step: int) -> float:
        """The learning rate of the step that follows ``step`` steps (warm-up, then flat)."""
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.lr


RECALL_TRAINING = TrainSettings(steps=2000, eval_every=50)
"""How ``qkv train recall`` trains by default."""

CLASSIFY_TRAINING = TrainSettings(steps=1500, eval_every=50)
"""How ``qkv train classify`` trains by default."""


@dataclass(frozen=True)
class RecallSettings:
    """The sequences and the model of an associative-recall run (:func:`train_recall`).

    Attributes:
        pairs, keys, values: key-value pairs per sequence, key tokens (a..z), value tokens
            (0..9) (:func:`qkv.data.recall`).
        validation_size: held-out sequences to measure accuracy on.
        d_model, num_heads, layers: the model's width, attention heads and transformer blocks.
        next_token: give the model the next-token embedding (without it, attention alone must
            carry each value to its key).
        dropout: the model's dropout.
        batch_size: fresh sequences per step.
        seed: seeds the weights, the sequences and their order.
    """

    pairs: int = 8
    keys: int = 26
    values: int = 10
    validation_size: int = 2000
    d_model: int = 64
    num_heads: int = 4
    layers: int = 1
    next_token: bool = True
    dropout: float = 0.0
    batch_size: int = 64
    seed: int = 0


@dataclass(frozen=True)
class ClassifySettings:
    """The data and the model of a text-classification run (:func:`train_classifier`).

    Attributes:
        model: ``"attention"`` (self-attention and attention pooling) or ``"bag-of-words"``.
        embedding_dim: E without word vectors (with them, the file's).
        num_heads, dropout: the attention model.
        batch_size: texts per step.
        validation: the share of rows held out for validation.
        max_length: tokens kept per text.
        lowercase: lower-case the texts.
        min_count: words seen fewer times in training become ``<unk>``.
        sentences: how many sentences the generated set has.
        seed: seeds the weights, the split and the order of the batches.
        text_column, label_column, group_column: the columns of a data file (rows with the
            same group stay on one side of the split; None: no groups).
    """

    model: str = "attention"
    embedding_dim: int = 32
    num_heads: int = 2
    dropout: float = 0.1
    batch_size: int = 32
    validation: float = 0.2
    max_length: int = 64
    lowercase: bool = True
    min_count: int = 1
    sentences: int = 2000
    seed: int = 0
    text_column: str = "text"
    label_column: str = "label"
    group_column: str | None = None
