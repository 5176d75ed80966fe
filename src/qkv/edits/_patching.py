"""Activation patching over every layer and head: a (layers × heads) table of a metric.

``patching(model, clean, corrupt, metric)`` records the clean run's contexts once (the fast
kernel's own) and runs the corrupt inputs once, keeping each block's output
(:mod:`qkv.edits._sweep`); then each batch of edits runs the layers above the edited one
only, one head patched per batch row, and keeps ``metric(logits)`` of each row. Only the
patched head's slice changes; every other head runs on the fast kernel. The table equals the
one of a forward per head (the tests compare them on every family).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qkv.edits._batching import bar, check_batch
from qkv.edits._intervene import _by_layer
from qkv.edits._model import Layers, layers_of
from qkv.edits._paths import THROUGH, sender_rows
from qkv.edits._record import record
from qkv.edits._specs import Edit, Recording, Target, ablate, check_layer, patch
from qkv.edits._sweep import Cell, Reuse

__all__ = [
    "BARELY",
    "Metric",
    "PatchingResult",
    "PositionPatchingResult",
    "ablation_sweep",
    "logit_diff",
    "patching",
    "path_patching",
    "position_patching",
    "prob",
]

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


BARELY = 0.01
"""Clean and corrupt *barely differ* when their metrics are within this share of the
metric's scale (the largest magnitude among them and the table's values): a fraction of the
way between them would then mostly measure noise (0.002 apart, a head that moves the metric
by 0.02 is "940 %" of the way)."""


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

    def scale(self) -> float:
        """The metric's scale: the largest magnitude among clean, corrupt and the values."""
        numbers = [self.corrupt, *(v for row in self.values for v in row)]
        numbers += [] if self.clean is None else [self.clean]
        return max((abs(v) for v in numbers if not math.isnan(v)), default=0.0)

    def barely_differ(self) -> bool:
        """Whether clean and corrupt are within :data:`BARELY` (1 %) of the metric's scale
        of each other (always False for an ablation sweep, which has no clean run).

        Example:
            >>> PatchingResult([[1.0]], ("a",), 1.002, 1.0, "context").barely_differ()
            True
        """
        if self.clean is None:
            return False
        return abs(self.clean - self.corrupt) <= BARELY * self.scale()

    def normalized(self) -> list[list[float]]:
        """(value − corrupt) / (clean − corrupt): 1 where the head restores the clean
        metric fully, 0 where it changes nothing (NaN when clean and corrupt
        :meth:`barely_differ`)."""
        if self.clean is None or self.barely_differ():
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


@dataclass(frozen=True)
class PositionPatchingResult:
    """The table of a sweep by position.

    Attributes:
        values: ``values[layer][i][head]``: the metric with that head patched at position
            ``positions[i]`` only (TransformerLens's ``[layer, pos, head]`` order).
        layers: the attention layers' module paths.
        positions: the positions patched (0-based).
        clean, corrupt: the metric on the clean and the corrupt run.
    """

    values: list[list[list[float]]]
    layers: tuple[str, ...]
    positions: tuple[int, ...]
    clean: float
    corrupt: float


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
    base: Reuse,
    rows: list[list[Cell]],
    metric: Metric,
    batch: int | None,
    progress: bool,
    where: str,
    run: Callable[[list[Cell]], list[Any]] | None = None,
) -> list[list[float]]:
    """``metric`` of each cell's run, by layer: the cells of a layer in batches (run by
    ``run``, default :meth:`Reuse.run`)."""
    run = base.run if run is None else run
    widest = max((len(row) for row in rows), default=1)
    size = check_batch(batch, widest, base.row_bytes, where)
    total = sum(len(row) for row in rows)
    values: list[list[float]] = []
    with bar(progress, total, where.split("(")[0]) as advance:
        for row in rows:
            found = [math.nan] * len(row)
            for chunk in _batches(row, size):
                for i, logits in zip(chunk, run([row[i] for i in chunk]), strict=True):
                    found[i] = _number(metric, logits)
                advance(len(chunk))
            values.append(found)
    return values


def _batches(row: list[Cell], size: int) -> Iterator[list[int]]:
    """The indices of ``row``'s cells in batches of at most ``size``, each batch of cells
    that first change one position (a batch runs from its cells' first)."""
    order = sorted(range(len(row)), key=lambda i: row[i].first)
    for _, same in itertools.groupby(order, key=lambda i: row[i].first):
        group = list(same)
        yield from (group[start : start + size] for start in range(0, len(group), size))


def _cells(layers: Layers, edits: Sequence[Edit]) -> list[Cell]:
    """The edits as batch rows, checked against the model (as ``qkv.intervene`` checks)."""
    cells = []
    for index, checked in _by_layer(layers, tuple(edits)).items():
        for edit in checked:
            edit.check_model(index, len(layers.paths))
            where = f"{edit.kind}(layer={edit.layer!r}, head={edit.head})"
            cells.append(Cell(index, edit.head, edit.apply, where))
    return cells


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


def _check_pair(clean: Any, corrupt: Any, what: str, where: str) -> None:
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


def patching(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    what: str = "context",
    batch: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Patch each head, one at a time, from the clean run into the corrupt one.

    For every attention layer and query head, the corrupt inputs run with that head's context
    (``what="context"``) or attention pattern (``what="weights"``: the context recomputed
    from the corrupt run's values) taken from the clean run, recorded once; the table holds
    ``metric(logits)`` of each run. Clean and corrupt inputs have the same shape.

    The clean and corrupt inputs run once each; then each layer's heads run as one batch
    (one head per batch row), from the kept input of that layer's block: only the layers
    above run, and in a causal language model only the positions from the first one a
    batch's patches change (docs/interventions.md). The result equals one forward per head.

    Args:
        model: a Hugging Face model or a model of ``qkv.nn`` modules.
        clean, corrupt: the inputs (a tokenizer's output, a tuple of arguments or a tensor),
            B prompts each.
        metric: :func:`logit_diff`, :func:`prob` or any function of the logits (B, ...) to
            a number.
        what: ``"context"`` or ``"weights"``.
        batch: how many heads run at once (batch rows of B prompts each); default: a
            layer's heads, at most 64, fewer when memory is short. A batch that needs more
            memory than the process may take is refused before it runs.
        progress: show a progress bar on stderr.

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
    _check_pair(clean, corrupt, what, where)
    layers = layers_of(model, where)
    source = record(model, clean, what=what)
    base = Reuse(model, layers, corrupt, where)
    edits = [
        patch(layer, head, source, what=what)
        for layer, count in enumerate(base.heads)
        for head in range(count)
    ]
    cells = _cells(layers, edits)
    if what == "context":
        cells = _from_first_change(base, cells, source)
    values = _sweep(base, _by_row(base.heads, cells), metric, batch, progress, where)
    clean_value = _number(metric, source.logits)
    return PatchingResult(values, layers.paths, clean_value, _number(metric, base.logits), what)


def _from_first_change(base: Reuse, cells: list[Cell], source: Recording) -> list[Cell]:
    """The patch cells, each knowing the first position its source context differs from
    the run's own: it changes nothing before."""
    return [
        replace(
            c, first=base.first_change(c.layer, c.head, source.head(c.layer, c.head, "context"))
        )
        for c in cells
    ]


def _by_row(heads: list[int], cells: list[Cell]) -> list[list[Cell]]:
    rows: list[list[Cell]] = [[] for _ in heads]
    for cell in cells:
        rows[cell.layer].append(cell)
    return rows


def ablation_sweep(
    model: Any,
    inputs: Any,
    metric: Metric,
    *,
    how: str = "zero",
    mean: Any = None,
    batch: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Ablate each head, one at a time: the table of ``metric(logits)`` with that head's
    context zeroed (``how="zero"``) or set to its mean (``how="mean"``, ``mean`` from
    :func:`qkv.edits.head_means`). Batched and reusing the layers below as
    :func:`patching` does (``batch``, ``progress`` as there).

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
    base = Reuse(model, layers, inputs, where)
    edits = [
        ablate(layer, head, how=how, mean=mean)
        for layer, count in enumerate(base.heads)
        for head in range(count)
    ]
    rows = _by_row(base.heads, _cells(layers, edits))
    values = _sweep(base, rows, metric, batch, progress, where)
    return PatchingResult(values, layers.paths, None, _number(metric, base.logits), how)


def _at_position(head: int, position: int, source: Any) -> Callable[[Target], None]:
    """Write the recorded context of ``head`` at sequence ``position`` (B, P, D) into the
    call's row of that position, if the call holds it."""

    def write(at: Target) -> None:
        if position not in at.positions:
            return
        row = position - at.positions.start
        held = source[:, position].to(device=at.context.device, dtype=at.context.dtype)
        at.context[:, head, row] = held.expand(int(at.context.shape[0]), -1)

    return write


def _positions(positions: object, length: int, where: str) -> tuple[int, ...]:
    if positions is None:
        return tuple(range(length))
    items = [positions] if isinstance(positions, int) else positions
    if (
        not isinstance(items, (list, tuple, range))
        or not items
        or any(isinstance(p, bool) or not isinstance(p, int) for p in items)
    ):
        raise TypeError(
            f"{where}: positions must be a position or a list of them, got {positions!r}. "
            "Hint: positions=[-1] patches the last token only; the default is every position."
        )
    bad = [p for p in items if not -length <= p < length]
    if bad:
        raise ValueError(
            f"{where}: position {bad[0]} is outside the {length} tokens. Hint: from 0 to "
            f"{length - 1}, or negative from the end."
        )
    return tuple(p % length for p in items)


def position_patching(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    positions: Any = None,
    batch: int | None = None,
    progress: bool = False,
) -> PositionPatchingResult:
    """Patch each head at each position, one (head, position) at a time, from the clean run
    into the corrupt one: the context of that head at that token only (TransformerLens's
    ``get_act_patch_attn_head_out_by_pos``). Batched and reusing the layers below as
    :func:`patching` does.

    Args:
        model, clean, corrupt, metric, batch, progress: as in :func:`patching`.
        positions: the positions to patch (negative from the end); default: all.

    Returns:
        A :class:`PositionPatchingResult`: ``values[layer][i][head]`` for position
        ``positions[i]``.

    Example:
        >>> import torch, qkv
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> table = position_patching(attn, torch.ones(1, 3, 8), torch.zeros(1, 3, 8),
        ...                           lambda out: out[0, -1].sum())
        >>> len(table.values[0]), len(table.values[0][0]), table.positions  # (N, heads)
        (3, 2, (0, 1, 2))
    """
    where = "position_patching(model, clean, corrupt, metric)"
    _check_metric(metric, where)
    _check_pair(clean, corrupt, "context", where)
    layers = layers_of(model, where)
    source = record(model, clean)
    base = Reuse(model, layers, corrupt, where)
    length = max(int(h.shape[1]) for heads in source.contexts.values() for h in heads.values())
    chosen = _positions(positions, length, where)
    _cells(layers, [patch(i, h, source) for i, n in enumerate(base.heads) for h in range(n)])

    def cell(layer: int, head: int, at: int) -> Cell:
        held = source.head(layer, head, "context")
        first = base.first_change(layer, head, held)  # before it, a patch writes what is there
        write = _at_position(head, at, held)
        return Cell(layer, head, write, f"{where} at {at}", at if first <= at else length)

    rows = [[cell(i, h, p) for p in chosen for h in range(n)] for i, n in enumerate(base.heads)]
    flat = _sweep(base, rows, metric, batch, progress, where)
    values = [
        [row[j * count : (j + 1) * count] for j in range(len(chosen))]
        for row, count in zip(flat, base.heads, strict=True)
    ]
    clean_value, corrupt_value = _number(metric, source.logits), _number(metric, base.logits)
    return PositionPatchingResult(values, layers.paths, chosen, clean_value, corrupt_value)


def path_patching(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    receiver: tuple[int | str, int],
    through: str = "keys",
    batch: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Patch each earlier head from the clean run into the corrupt one along one path only:
    as the ``receiver`` head reads it through its ``through`` (``"queries"``, ``"keys"`` or
    ``"values"``), the heads between frozen (Wang et al., 2022; see
    :mod:`qkv.edits._paths`). Batched and reusing the layers below as :func:`patching`
    does.

    Args:
        model, clean, corrupt, metric, batch, progress: as in :func:`patching`.
        receiver: (layer, head) of the head that reads the senders' outputs (layer an
            index, negative from the end, or a module path; head negative from the end).
        through: ``"queries"``, ``"keys"`` or ``"values"``.

    Returns:
        A :class:`PatchingResult` whose rows are the layers before the receiver's
        (``values[layer][head]``: the metric with that sender patched along the path) and
        whose ``what`` is ``through``.

    Example:
        >>> import torch, qkv
        >>> from qkv.edits import path_patching
        >>> blocks = torch.nn.Sequential(*(qkv.nn.TransformerBlock(8, num_heads=2)
        ...                                for _ in range(2)))
        >>> table = path_patching(blocks, torch.ones(1, 3, 8), torch.zeros(1, 3, 8),
        ...                       lambda out: out.sum(), receiver=(1, 0), through="values")
        >>> len(table.values), len(table.values[0]), table.what     # senders: layer 0
        (1, 2, 'values')
    """
    where = "path_patching(model, clean, corrupt, metric)"
    _check_metric(metric, where)
    _check_pair(clean, corrupt, "context", where)
    if through not in THROUGH:
        raise ValueError(
            f"{where}: through must be 'queries', 'keys' or 'values', got {through!r}. Hint: "
            "through='keys': what the receiver's keys take from each sender."
        )
    if not isinstance(receiver, tuple) or len(receiver) != 2:
        raise TypeError(
            f"{where}: receiver must be a (layer, head) pair, got {receiver!r}. Hint: "
            "receiver=(9, 6) is head 6 of layer 9."
        )
    layers = layers_of(model, where)
    named = f"{where} receiver={receiver!r}"
    layer = layers.index(check_layer(receiver[0], named), named)
    if layer == 0:
        raise ValueError(
            f"{named}: layer 0 has no earlier heads to send to it. Hint: a receiver in a "
            "later layer."
        )
    source, frozen = record(model, clean), record(model, corrupt)
    base = Reuse(model, layers, corrupt, where)
    head = ablate(layer, receiver[1]).head  # checks it is an integer
    heads = base.heads[layer]
    if not -heads <= head < heads:
        raise ValueError(
            f"{named}: layer {layers.paths[layer]!r} has {heads} query heads. Hint: choose a "
            f"head from 0 to {heads - 1} (or negative from the end)."
        )
    head %= heads
    senders = [patch(i, h, source) for i in range(layer) for h in range(base.heads[i])]
    rows = _by_row(base.heads[:layer], _from_first_change(base, _cells(layers, senders), source))

    def run(chunk: list[Cell]) -> list[Any]:
        return sender_rows(base, chunk, frozen, (layer, head), through, where)

    values = _sweep(base, rows, metric, batch, progress, where, run)
    clean_value, corrupt_value = _number(metric, source.logits), _number(metric, base.logits)
    return PatchingResult(values, layers.paths[:layer], clean_value, corrupt_value, through)
