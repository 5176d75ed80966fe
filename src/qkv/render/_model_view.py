"""The page's model view: a layer × head grid of small attention-weight maps.

A trace of a model (its calls named by layer) gets, above the head view, one row per layer
and one small map per head: the attention weights of the query rows the trace holds,
pooled down to at most :data:`THUMBNAIL` × :data:`THUMBNAIL` cells. Clicking a map (or
Enter on it) selects that layer and head on the page (``assets/model_view.js``).

Pooling keeps probabilities: a cell of the map is the share of attention that its group of
query rows (averaged) gives to its group of keys (summed), so a head that attends to one
key in a long sequence stays visible. Each map also carries, for every query row, the key
it attends to most and that weight, which the page writes in the map's label.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from qkv.render._narrative import Heads, _index, _labels, query_labels
from qkv.trace import Trace, TraceCall

__all__ = ["THUMBNAIL", "model_view"]

THUMBNAIL = 24
"""The most rows and columns of one map of the grid."""


def model_view(
    trace: Trace,
    calls: Sequence[TraceCall],
    names: Sequence[str],
    label_id: Callable[[Sequence[str]], int],
    *,
    precision: int = 4,
) -> dict[str, Any] | None:
    """The grid's data for the page's calls (``calls[i]`` is the page's call ``i``), or
    None when there is no grid to show: the calls are not a model's (no layer names), or
    fewer than two maps would be drawn.

    Args:
        trace: the trace the calls come from (its tokens label the rows and keys).
        calls: the calls on the page, in the page's order.
        names: their names on the page (``"blocks.0.attn"``).
        label_id: stores a list of labels once and returns its position in the page's
            label lists.
        precision: decimals of the weights written in the maps' labels.

    Returns:
        ``{"rows": [{"call", "name", "queries", "keys", "heads": [{"head", "number",
        "title", "shape", "max", "data", "top"}]}], "start": {"call", "head"} or None}``:
        ``head`` is the map's position among the call's recorded heads, ``number`` the
        head's own (from 0, as the column header shows it); ``data`` is
        the pooled map as base64 bytes (0 to 255, 255 at its largest share ``max``), ``top``
        for each query row the key it attends to most and that weight.

    Example:
        >>> import numpy as np, qkv
        >>> t = qkv.Trace(tokens=["a", "b"])
        >>> for layer in ("l.0", "l.1"):
        ...     t.record("weights", np.full((2, 2, 2), 0.5), formula="A", description="",
        ...              axes=("head", "query", "key"), layer=layer)
        >>> view = model_view(t, t.calls, ["l.0", "l.1"], lambda labels: 0)
        >>> [len(row["heads"]) for row in view["rows"]], view["rows"][0]["heads"][1]["top"]
        ([2, 2], [[0, 0.5], [0, 0.5]])
    """
    if not any(call.layer is not None for call in calls):
        return None
    rows = []
    for position, (call, name) in enumerate(zip(calls, names, strict=True)):
        row = _row(trace, call, position, name, label_id, precision)
        if row is not None:
            rows.append(row)
    if sum(len(row["heads"]) for row in rows) < 2:
        return None
    return {"rows": rows, "start": _start(trace.meta.get("selected"), calls, rows)}


def _row(
    trace: Trace,
    call: TraceCall,
    position: int,
    name: str,
    label_id: Callable[[Sequence[str]], int],
    precision: int,
) -> dict[str, Any] | None:
    """One layer of the grid: a map per recorded head (None: the call has no weights)."""
    weights = next(
        (
            step
            for step in reversed(call.steps)
            if step.name == "weights" and {"query", "key"} <= set(step.axes)
        ),
        None,
    )
    if weights is None:
        return None
    sub = trace.subset([call])
    (own,) = sub.calls
    heads = Heads(sub, own)
    lq = int(weights.value.shape[weights.axes.index("query")])
    lk = int(weights.value.shape[weights.axes.index("key")])
    queries = query_labels(trace, lq, _index(call.steps, "query"))
    keys = _labels(trace.tokens, lk, "t")
    return {
        "call": position,
        "name": name,
        "queries": label_id(queries),
        "keys": label_id(keys),
        "heads": [
            _map(heads.select(weights, h), h, heads.numbers[h], heads.title(h), precision)
            for h in range(heads.count)
        ],
    }


def _map(matrix: np.ndarray, head: int, number: int, title: str, precision: int) -> dict[str, Any]:
    values = np.atleast_2d(np.nan_to_num(np.asarray(matrix, dtype=np.float64), nan=0.0))
    pooled = _pool(np.where(np.isfinite(values), values, 0.0))
    largest = float(pooled.max()) if pooled.size else 0.0
    scaled = np.zeros_like(pooled) if largest <= 0 else pooled / largest
    data = np.rint(np.clip(scaled, 0.0, 1.0) * 255).astype(np.uint8)
    top = np.argmax(values, axis=1)
    return {
        "head": head,
        "number": number,
        "title": title,
        "shape": list(data.shape),
        "max": round(largest, precision),
        "data": base64.b64encode(data.tobytes()).decode("ascii"),
        "top": [[int(k), round(float(values[i, k]), precision)] for i, k in enumerate(top)],
    }


def _pool(values: np.ndarray) -> np.ndarray:
    """At most THUMBNAIL × THUMBNAIL cells: rows averaged, keys summed, in near-equal groups."""
    rows, cols = values.shape
    if rows > THUMBNAIL:
        edges = np.linspace(0, rows, THUMBNAIL + 1).round().astype(int)
        values = np.add.reduceat(values, edges[:-1], axis=0) / np.diff(edges)[:, None]
    if cols > THUMBNAIL:
        edges = np.linspace(0, cols, THUMBNAIL + 1).round().astype(int)
        values = np.add.reduceat(values, edges[:-1], axis=1)
    return values


def _start(
    selected: object, calls: Sequence[TraceCall], rows: Sequence[Mapping[str, Any]]
) -> dict[str, int] | None:
    """The cell the page opens on: the trace's ``meta["selected"]`` (``{"layer": path,
    "head": original head number}``, as ``qkv explain --hf --layer --head`` asks), when the
    page holds it."""
    if not isinstance(selected, Mapping):
        return None
    layer, head = selected.get("layer"), selected.get("head")
    for row in rows:
        call = calls[row["call"]]
        if call.layer != layer:
            continue
        numbers = _index(call.steps, "head")
        position = head if numbers is None else numbers.index(head) if head in numbers else 0
        if not isinstance(position, int) or not 0 <= position < len(row["heads"]):
            position = 0
        return {"call": int(row["call"]), "head": position}
    return None
