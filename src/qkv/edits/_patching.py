"""Activation patching over every layer and head: a (layers × heads) table of a metric.

``patching(model, clean, corrupt, metric)`` records the clean run's contexts once (the fast
kernel's own), then runs the corrupt inputs once per (layer, head) with that one head's
context patched in from the clean run, and keeps ``metric(logits)``. Only the patched head's
slice changes in each run; every other head runs on the fast kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qkv._extras import require
from qkv.edits._intervene import intervene
from qkv.edits._model import layers_of, logits_of, run_model
from qkv.edits._record import record
from qkv.edits._specs import Edit, ablate, patch

__all__ = ["Metric", "PatchingResult", "ablation_sweep", "logit_diff", "patching", "prob"]

Metric = Callable[[Any], Any]
"""A function of the logits (B, L, V) (or of the model's output tensor) to one number."""


def _token(value: object, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(
            f"{where}: {name} must be a token id (an integer from 0), got {value!r}. Hint: "
            "tokenizer.convert_tokens_to_ids(' Paris')."
        )
    return value


def _last(logits: Any, ids: Sequence[int], where: str) -> Any:
    """The last position's logits (B, V), with the token ids checked against V."""
    vocab = int(logits.shape[-1])
    for token in ids:
        if token >= vocab:
            raise ValueError(
                f"{where}: token id {token} is not in the vocabulary of {vocab}. Hint: a "
                f"token id from 0 to {vocab - 1}."
            )
    return logits.reshape(-1, logits.shape[-2], vocab)[:, -1] if logits.ndim > 2 else logits


def logit_diff(answer: int, wrong: int) -> Metric:
    """The metric ``logit[answer] − logit[wrong]`` at the last position, averaged over the
    batch: positive when the model prefers the answer.

    Example:
        >>> import torch
        >>> logit_diff(2, 0)(torch.tensor([[[1.0, 0.0, 3.0]]]))
        2.0
    """
    where = f"logit_diff(answer={answer!r}, wrong={wrong!r})"
    answer, wrong = _token(answer, "answer", where), _token(wrong, "wrong", where)

    def metric(logits: Any) -> float:
        last = _last(logits, (answer, wrong), where)
        return float((last[:, answer] - last[:, wrong]).double().mean())

    metric.__qualname__ = where
    return metric


def prob(answer: int) -> Metric:
    """The metric: the probability of ``answer`` at the last position, averaged over the
    batch.

    Example:
        >>> import torch
        >>> round(prob(1)(torch.tensor([[[0.0, 0.0]]])), 3)
        0.5
    """
    where = f"prob(answer={answer!r})"
    answer = _token(answer, "answer", where)

    def metric(logits: Any) -> float:
        last = _last(logits, (answer,), where)
        return float(last.double().softmax(dim=-1)[:, answer].mean())

    metric.__qualname__ = where
    return metric


@dataclass(frozen=True)
class PatchingResult:
    """The table of a sweep.

    Attributes:
        values: ``values[layer][head]``: the metric with that one head edited.
        layers: the attention layers' module paths (the rows).
        clean: the metric on the clean run (None for an ablation sweep).
        corrupt: the metric on the run that is edited, unedited.
        what: ``"context"``, ``"weights"`` (patching), or ``"zero"``/``"mean"`` (ablation).
    """

    values: list[list[float]]
    layers: tuple[str, ...]
    clean: float | None
    corrupt: float
    what: str

    def normalized(self) -> list[list[float]]:
        """(value − corrupt) / (clean − corrupt): 1 where the head restores the clean
        metric fully, 0 where it changes nothing (NaN when clean equals corrupt)."""
        if self.clean is None or self.clean == self.corrupt:
            return [[math.nan for _ in row] for row in self.values]
        span = self.clean - self.corrupt
        return [[(v - self.corrupt) / span for v in row] for row in self.values]

    def best(self) -> tuple[int, int]:
        """The (layer, head) whose edit moves the metric furthest from the corrupt run."""
        cells = [
            (abs(v - self.corrupt), i, h)
            for i, row in enumerate(self.values)
            for h, v in enumerate(row)
        ]
        _, layer, head = max(cells)
        return layer, head


def _number(metric: Metric, logits: Any) -> float:
    value = metric(logits)
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"patching: the metric returned {type(value).__name__}, not one number. Hint: "
            "a function of the logits to a float, e.g. qkv.logit_diff(answer, wrong)."
        ) from None
    return number


def _sweep(
    model: Any, inputs: Any, metric: Metric, edit_of: Callable[[int, int], Edit], heads: list[int]
) -> list[list[float]]:
    torch = require("torch", feature="qkv.patching", extra="torch")
    rows: list[list[float]] = []
    with torch.no_grad():
        for layer, count in enumerate(heads):
            row = []
            for head in range(count):
                with intervene(model, edit_of(layer, head)):
                    row.append(_number(metric, logits_of(run_model(model, inputs))))
            rows.append(row)
    return rows


def _baseline(model: Any, inputs: Any, metric: Metric) -> float:
    torch = require("torch", feature="qkv.patching", extra="torch")
    with torch.no_grad(), intervene(model):
        return _number(metric, logits_of(run_model(model, inputs)))


def _shapes(inputs: Any) -> Any:
    """The shapes of some inputs (a tensor, a mapping or a tuple of them)."""
    if isinstance(inputs, Mapping):
        return {key: _shapes(value) for key, value in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(_shapes(value) for value in inputs)
    shape = getattr(inputs, "shape", None)
    return tuple(shape) if shape is not None else type(inputs).__name__


def _check_metric(metric: object, where: str) -> None:
    if not callable(metric):
        raise TypeError(
            f"{where}: metric must be a function of the logits, got "
            f"{type(metric).__name__}. Hint: qkv.logit_diff(answer, wrong) or qkv.prob(answer)."
        )


def patching(
    model: Any, clean: Any, corrupt: Any, metric: Metric, *, what: str = "context"
) -> PatchingResult:
    """Patch each head, one at a time, from the clean run into the corrupt one.

    For every attention layer and query head, the corrupt inputs run with that head's context
    (``what="context"``) or attention pattern (``what="weights"``: the context recomputed
    from the corrupt run's values) taken from the clean run, recorded once; the table holds
    ``metric(logits)`` of each run. Clean and corrupt inputs have the same shape.

    Args:
        model: a Hugging Face model or a model of ``qkv.nn`` modules.
        clean, corrupt: the inputs (a tokenizer's output, a tuple of arguments or a tensor).
        metric: :func:`logit_diff`, :func:`prob` or any function of the logits to a number.
        what: ``"context"`` or ``"weights"``.

    Returns:
        A :class:`PatchingResult` (``values[layer][head]``, and the clean and corrupt
        metrics).

    Example:
        >>> import torch, qkv
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> table = qkv.patching(attn, torch.ones(1, 3, 8), torch.zeros(1, 3, 8),
        ...                      lambda out: out.sum())
        >>> len(table.values), len(table.values[0])          # (layers, heads)
        (1, 2)
    """
    where = "patching(model, clean, corrupt, metric)"
    _check_metric(metric, where)
    if what not in ("context", "weights"):
        raise ValueError(
            f"{where}: what must be 'context' or 'weights', got {what!r}. Hint: 'weights' "
            "patches the attention pattern only."
        )
    if _shapes(clean) != _shapes(corrupt):
        raise ValueError(
            f"{where}: the clean inputs have shape {_shapes(clean)} and the corrupt ones "
            f"{_shapes(corrupt)}; patching copies each position. Hint: two prompts of as many "
            "tokens (one word changed)."
        )
    layers = layers_of(model, where)
    source = record(model, clean, what=what)
    heads = [
        len(source.contexts.get(i) or source.weights.get(i) or {}) for i in range(len(layers.paths))
    ]
    clean_value = _number(metric, source.logits)
    corrupt_value = _baseline(model, corrupt, metric)
    values = _sweep(
        model, corrupt, metric, lambda layer, head: patch(layer, head, source, what=what), heads
    )
    return PatchingResult(values, layers.paths, clean_value, corrupt_value, what)


def ablation_sweep(
    model: Any, inputs: Any, metric: Metric, *, how: str = "zero", mean: Any = None
) -> PatchingResult:
    """Ablate each head, one at a time: the table of ``metric(logits)`` with that head's
    context zeroed (``how="zero"``) or set to its mean (``how="mean"``, ``mean`` from
    :func:`qkv.edits.head_means`).

    Example:
        >>> import torch, qkv
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> table = ablation_sweep(attn, torch.ones(1, 3, 8), lambda out: out.sum())
        >>> table.what, len(table.values[0])
        ('zero', 2)
    """
    where = "ablation_sweep(model, inputs, metric)"
    _check_metric(metric, where)
    ablate(0, 0, how=how, mean=mean)  # checks how and mean once
    layers = layers_of(model, where)
    shapes = record(model, inputs)
    heads = [len(shapes.contexts.get(i, {})) for i in range(len(layers.paths))]
    base = _number(metric, shapes.logits)
    values = _sweep(
        model, inputs, metric, lambda layer, head: ablate(layer, head, how=how, mean=mean), heads
    )
    return PatchingResult(values, layers.paths, None, base, how)
