"""Applying edits to one attention call: only the edited heads' slices change.

The fast kernel has computed every head's context (B, H, Lq, D). An edit of head h writes
``context[:, h]`` (or one row of it) and nothing else: the other heads, also those that share
h's key/value head under GQA, keep the kernel's numbers. A weight edit computes only its own
rows, ``w · V`` in O(rows · Lk). When a ``qkv.tracing`` block records the layer, the trace's
``context`` (and ``weights``) steps are changed to the edited numbers and the call's meta
lists the edits (``edits``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qkv._edit_point import Editor, EditSite
from qkv._extras import require
from qkv.edits._model import Layers
from qkv.edits._specs import Ablate, Edit, HeadMeans, Patch, Scale, SetWeights
from qkv.trace import current_trace

__all__ = ["HeadEditor", "positions_of"]


def positions_of(site: EditSite) -> range:
    """The sequence positions of the call's query rows: after its keys' first position
    (``site.first_key``, past the tokens a windowed cache let go), the last Lq of its keys
    when the queries come last, else the first."""
    q_len, kv_len = int(site.query.shape[2]), int(site.key.shape[2])
    start = kv_len - q_len if site.queries_last and q_len <= kv_len else 0
    return range(site.first_key + start, site.first_key + start + q_len)


@dataclass
class _Rows:
    """The weight rows an edit wrote: head, row indices in the call, (B, rows, Lk) values."""

    head: int
    rows: list[int]
    values: Any


class HeadEditor:
    """The editor of a ``qkv.intervene`` block: the edits of each layer, applied at each of
    its calls (after the edits of an enclosing block, if any)."""

    def __init__(self, layers: Layers, edits: dict[int, list[Edit]], outer: Editor | None):
        self.layers = layers
        self.edits = edits
        self.outer = outer
        self._index = {id(m): i for i, m in enumerate(layers.modules)}

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        if self.outer is not None:
            context, weights = self.outer(site)
            site = replace(site, context=context, weights=weights)
        layer = self._index.get(id(site.module))
        edits = self.edits.get(layer, []) if layer is not None else []
        if layer is None or not edits:
            return site.context, site.weights
        return _apply(site, layer, self.layers.paths[layer], edits)


def _apply(site: EditSite, layer: int, path: str, edits: list[Edit]) -> tuple[Any, Any]:
    context = site.context.clone()
    weights = None if site.weights is None else site.weights.clone()
    heads, kv_heads = int(context.shape[1]), int(site.key.shape[1])
    group = heads // kv_heads
    positions = positions_of(site)
    written: list[_Rows] = []
    applied: list[dict[str, Any]] = []
    for edit in edits:
        where = f"{edit.kind}(layer={edit.layer!r}, head={edit.head})"
        if edit.head >= heads:
            raise ValueError(
                f"{where}: layer {path!r} has {heads} query heads. Hint: choose a head from 0 "
                f"to {heads - 1}."
            )
        value = site.value[:, edit.head // group]  # (B, Lk, Dv): this head's key/value head
        rows = _edit_head(edit, context, value, (positions, site.first_key), layer, where)
        if rows is None:
            continue
        applied.append(edit.describe())
        if isinstance(rows, _Rows):
            written.append(rows)
            if weights is not None:
                weights[:, rows.head, rows.rows] = rows.values.to(weights.dtype)
    if applied:
        _amend_trace(context, written, applied)
    return context, weights


def _edit_head(
    edit: Edit, context: Any, value: Any, where_in: tuple[range, int], layer: int, where: str
) -> _Rows | bool | None:
    """Write one edit into ``context`` (B, H, Lq, D); the weight rows it set, True for a
    context edit, None when the edit does not touch this call. ``where_in``: the positions
    of the call's queries and of its first key."""
    h = edit.head
    positions, first_key = where_in
    if isinstance(edit, Scale):
        context[:, h] = context[:, h] * edit.factor
        return True
    if isinstance(edit, Ablate):
        if edit.how == "zero":
            context[:, h] = 0
            return True
        mean = edit.mean.of(layer, h) if isinstance(edit.mean, HeadMeans) else edit.mean
        if mean.shape[-1] != context.shape[-1]:
            raise ValueError(
                f"{where}: mean has {mean.shape[-1]} features, the head has "
                f"{context.shape[-1]}. Hint: the head means of the same model."
            )
        context[:, h] = mean.to(device=context.device, dtype=context.dtype)
        return True
    if isinstance(edit, Patch):
        assert edit.source is not None
        source = edit.source.head(layer, h, edit.what)
        source = _rows_of(source, positions, context.shape[0], where)
        if edit.what == "context":
            context[:, h] = source.to(device=context.device, dtype=context.dtype)
            return True
        pattern = _keys(source, first_key, int(value.shape[1]))
        pattern = pattern.to(device=value.device, dtype=value.dtype)
        context[:, h] = (pattern @ value).to(context.dtype)  # (B, Lq, Lk)·(B, Lk, Dv)
        return _Rows(h, list(range(len(positions))), pattern)
    assert isinstance(edit, SetWeights)
    end = positions.stop
    position = edit.query if edit.query >= 0 else end + edit.query
    if position < 0:
        raise ValueError(
            f"{where}: query {edit.query} is before the sequence of {end} tokens. Hint: "
            f"choose a position from 0 to {end - 1}, or from -{end}."
        )
    if position not in positions:
        return None
    row = position - positions.start
    w = edit.weights
    keys, span = int(value.shape[1]), first_key + int(value.shape[1])
    if w.shape[-1] != span or (w.ndim == 2 and w.shape[0] not in (1, context.shape[0])):
        raise ValueError(
            f"{where}: weights of shape {tuple(w.shape)} for a row of {span} keys and a batch "
            f"of {context.shape[0]}. Hint: pass ({span},) or ({context.shape[0]}, {span})."
        )
    if first_key and bool(w[..., :first_key].any()):
        raise ValueError(
            f"{where}: weights on keys 0 to {first_key - 1}, which the cache's window has "
            f"let go before query {position}. Hint: weights only on keys {first_key} to "
            f"{span - 1}, or a cache with a longer max_length."
        )
    w = w[..., first_key:].to(device=value.device, dtype=value.dtype)
    w = w.reshape(-1, 1, keys).expand(context.shape[0], 1, keys)  # (B, 1, Lk)
    context[:, h, row] = (w @ value)[:, 0].to(context.dtype)
    return _Rows(h, [row], w)


def _rows_of(source: Any, positions: range, batch: int, where: str) -> Any:
    """The recorded rows (B, Lq, ·) of this call's positions."""
    held, size = int(source.shape[1]), int(source.shape[0])
    if positions.stop > held:
        raise ValueError(
            f"{where}: the call reaches position {positions.stop - 1} but the recording holds "
            f"{held} positions. Hint: record the source on inputs as long as this run's."
        )
    if size not in (1, batch):
        raise ValueError(
            f"{where}: the recording has a batch of {size}, this run {batch}. Hint: record "
            "the source with the same batch size (or one prompt)."
        )
    return source[:, positions.start : positions.stop].expand(batch, -1, -1)


def _keys(pattern: Any, first: int, keys: int) -> Any:
    """The columns of recorded weight rows (one per key position) of this call's ``keys``
    from position ``first`` on, padded with zeros past the recording (a causal row gives no
    weight to later keys)."""
    cut = pattern[..., first : first + keys]
    held = int(cut.shape[-1])
    if held == keys:
        return cut
    pad = pattern.new_zeros((*pattern.shape[:-1], keys - held))
    return _torch().cat((cut, pad), dim=-1)


def _amend_trace(context: Any, written: list[_Rows], applied: list[dict[str, Any]]) -> None:
    """Show the edited numbers in the trace recording this call, and say what was edited."""
    trace = current_trace()
    if trace is None or trace.current_layer is None:
        return
    values: dict[str, np.ndarray] = {}
    step = trace.step_of_last_call("context")
    if step is not None and len(step.axes) == context.ndim:
        values["context"] = _cut(_numpy(context), step.axes, step.index).astype(step.value.dtype)
    step = trace.step_of_last_call("weights")
    if step is not None and written and step.axes == ("batch", "head", "query", "key"):
        new = step.value.copy()
        index = step.index or {}
        for rows in written:
            heads = index.get("head", list(range(new.shape[1])))
            if rows.head not in heads:
                continue
            kept = index.get("query", list(range(new.shape[2])))
            for j, row in enumerate(rows.rows):
                if row in kept:
                    new[:, heads.index(rows.head), kept.index(row)] = _numpy(rows.values[:, j])
        values["weights"] = new
    trace.amend_last_call(values, edits=applied)


def _numpy(x: Any) -> np.ndarray:
    """A tensor as NumPy: float64 stays, any other float becomes float32."""
    x = x.detach()
    if x.dtype != _torch().float64:
        x = x.float()
    return np.asarray(x.cpu().numpy())


def _torch() -> Any:
    return require("torch", feature="qkv.intervene", extra="torch")


def _cut(value: np.ndarray, axes: tuple[str, ...], index: dict[str, list[int]] | None) -> Any:
    """The entries of ``value`` a step kept (its ``index`` along its axes)."""
    for position, axis in enumerate(axes):
        kept = (index or {}).get(axis)
        if kept is not None:
            value = np.take(value, kept, axis=position)
    return value
