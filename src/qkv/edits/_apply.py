"""Applying edits to one attention call: only the edited heads' slices change.

The fast kernel has computed every head's context (B, H, Lq, D). An edit of head h writes
``context[:, h]`` (or one row of it) and nothing else: the other heads, also those that share
h's key/value head under GQA, keep the kernel's numbers. A weight edit computes only its own
rows, ``w · V`` in O(rows · Lk). When a ``qkv.tracing`` block records the layer, the trace's
``context`` (and ``weights``) steps are changed to the edited numbers and the call's meta
lists the edits (``edits``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from qkv._edit_point import Editor, EditSite
from qkv._extras import require
from qkv.edits._model import Layers
from qkv.edits._specs import Edit, Rows, Target
from qkv.trace import current_trace

__all__ = ["HeadEditor", "positions_of"]


def positions_of(site: EditSite) -> range:
    """The sequence positions of the call's query rows: after its keys' first position
    (``site.first_key``, past the tokens a windowed cache let go), the last Lq of its keys
    when the queries come last, else the first."""
    q_len, kv_len = int(site.query.shape[2]), int(site.key.shape[2])
    start = kv_len - q_len if site.queries_last and q_len <= kv_len else 0
    return range(site.first_key + start, site.first_key + start + q_len)


class HeadEditor:
    """The editor of a ``qkv.intervene`` block: the edits of each layer, applied at each of
    its calls (after the edits of an enclosing block, if any)."""

    def __init__(self, layers: Layers, edits: dict[int, list[Edit]], outer: Editor | None):
        self.layers = layers
        self.edits = edits
        self.outer = outer
        self._index = {id(m): i for i, m in enumerate(layers.modules)}
        for index, some in edits.items():  # what each edit copies: from a model like this one
            for edit in some:
                edit.check_model(index, len(layers.paths))

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
    written: list[Rows] = []
    applied: list[dict[str, Any]] = []
    for edit in edits:
        where = f"{edit.kind}(layer={edit.layer!r}, head={edit.head})"
        if edit.head >= heads:
            raise ValueError(
                f"{where}: layer {path!r} has {heads} query heads. Hint: choose a head from 0 "
                f"to {heads - 1}."
            )
        value = site.value[:, edit.head // group]  # (B, Lk, Dv): this head's key/value head
        rows = edit.apply(Target(context, value, positions, site.first_key, layer, where))
        if rows is None:
            continue
        applied.append(edit.describe())
        if isinstance(rows, Rows):
            written.append(rows)
            if weights is not None:
                weights[:, rows.head, rows.rows] = rows.values.to(weights.dtype)
    if applied:
        _amend_trace(context, written, applied)
    return context, weights


def _amend_trace(context: Any, written: list[Rows], applied: list[dict[str, Any]]) -> None:
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
