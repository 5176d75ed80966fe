"""Traces of long sequences: the (Lq, Lk) steps of the selected heads and query rows only.

When a fast backend computes the context (the full steps would not fit, or a fast backend
was asked for), the trace still gets every step: Q, K, V and the context whole, and the
(Lq, Lk) steps (scores, weights, ...) computed by the reference on the selected heads and
query rows only, with each step's ``index`` saying which rows it holds.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from qkv._array import Array, library
from qkv.attention import _backend
from qkv.attention._backend import MEMORY_FRACTION, REFERENCE_COPIES, itemsize, size_text
from qkv.attention._options import Call
from qkv.attention._recorder import Positions, Recorder, call_facts, shapes_of
from qkv.attention._reference import attend
from qkv.trace import Trace

__all__ = ["record_partial"]


def record_partial(call: Call, trace: Trace, context: Array, *, backend: str) -> None:
    """Record the steps of ``call`` into ``trace`` with (Lq, Lk) steps cut to a selection;
    ``backend`` (which computed ``context``) goes into the trace's record of the call."""
    heads_total = int(call.query.shape[-3]) if "head" in call.lead else 1
    q_len, kv_len = int(call.query.shape[-2]), int(call.key.shape[-2])
    heads = trace.selection("head", heads_total) if "head" in call.lead else None
    queries = trace.selection("query", q_len)
    rows = queries if queries is not None else list(range(q_len))
    head_rows = heads if heads is not None else list(range(heads_total))
    per_row = (call.scores_elements() // max(q_len * heads_total, 1)) * itemsize(call)
    budget = (_backend.available_memory(call.query) or 1 << 30) * MEMORY_FRACTION
    need = per_row * len(rows) * len(head_rows) * REFERENCE_COPIES * 2
    if need > budget:
        keep = max(1, int(budget // (per_row * len(head_rows) * REFERENCE_COPIES * 2)))
        if keep < len(rows):
            step = max(1, len(rows) // keep)
            rows = sorted({*rows[::step][: keep - 1], rows[-1]})
        warnings.warn(
            f"tracing attention over Lq = {q_len}, Lk = {kv_len}: the full (Lq, Lk) steps "
            f"would need {size_text(need)}; recording {len(rows)} query rows "
            f"({_rows_text(rows)}) of {len(head_rows)} heads only. Hint: choose them with "
            "qkv.tracing(heads=[...], queries=[...]).",
            stacklevel=4,
        )
        reduced = {"heads": head_rows, "queries": rows, "q_len": q_len}
    else:
        reduced = None
    trace.begin_call(
        backend=backend,
        shapes=shapes_of(call.query, call.key, call.value),
        rows={"heads": head_rows, "queries": rows, "q_len": q_len},
    )
    if reduced is not None:
        trace.note(partial=reduced)
    positions = Positions(
        heads=head_rows if "head" in call.lead else None, queries=rows, q_len=q_len
    )
    _record_rows(call, trace, positions, context)


def _rows_text(rows: list[int]) -> str:
    return ", ".join(map(str, rows)) if len(rows) <= 6 else f"{rows[0]}, {rows[1]}, …, {rows[-1]}"


def _record_rows(call: Call, trace: Trace, positions: Positions, context: Array) -> None:
    """Q, K, V and the context whole (the trace applies its own selection); the (Lq, Lk)
    steps computed by the reference on the selected rows only."""
    xp = call.xp
    lead = call.lead
    options = call.options
    rows = positions.queries
    q_axis = len(lead)  # the query axis of (…lead, Lq, D)
    query = _take(xp, call.query, rows, q_axis)
    key, value = call.key, call.value
    scores_shape = (*call.query.shape[:-2], call.query.shape[-2], call.key.shape[-2])
    mask, bias = options.dense_mask, options.bias
    mask = None if mask is None else _take(xp, _broadcast(xp, mask, scores_shape), rows, q_axis)
    bias = None if bias is None else _take(xp, _broadcast(xp, bias, scores_shape), rows, q_axis)
    if positions.heads is not None:
        h_axis = lead.index("head")
        group = int(call.query.shape[-3]) // int(call.key.shape[-3])
        heads = positions.heads
        query = _take(xp, query, heads, h_axis)
        key = _take(xp, key, [h // group for h in heads], h_axis)
        value = _take(xp, value, [h // group for h in heads], h_axis)
        mask = None if mask is None else _take(xp, mask, heads, h_axis)
        bias = None if bias is None else _take(xp, bias, heads, h_axis)
    # The rows' own options: the rule evaluates at the original positions (the recorder's
    # ``positions``), a dense mask and bias are cut to the rows.
    rows_options = replace(options, mask=options.mask if mask is None else mask, bias=bias)
    partial = Trace()
    recorder = Recorder(partial, squeeze_heads=call.recorder.squeeze_heads, positions=positions)
    with _no_grad(query):  # recorded values only: no autograd graph for them
        attend(xp, query, key, value, rows_options, lead=lead, recorder=recorder)
    whole = {"Q": call.query, "K": call.key, "V": call.value, "context": context}
    index = {"query": list(rows)}
    if positions.heads is not None:
        index["head"] = list(positions.heads)
    for step in partial:
        if step.name in whole:
            trace.record(
                step.name,
                whole[step.name],
                formula=call.recorder.formulas.get(step.name, step.formula),
                description=step.description,
                axes=step.axes,
            )
        else:  # already cut to the selection: added as it is, with the rows it holds
            trace.add(replace(step, index=index))
    sink = partial.meta.get("sink")
    if sink is not None:  # the share of the selected rows: say which, as the steps do
        sink["index"] = index
    # The facts of the whole call (its own num_heads and num_kv_heads, its mask as the
    # caller gave it), never of the rows recomputed here: which heads and rows those are is
    # said by each step's ``index`` and the call's ``rows``.
    facts = {**partial.meta, **call_facts(call.query, call.key, call.value, lead, options)}
    trace.end_call(**facts)


def _no_grad(x: Array) -> AbstractContextManager[Any]:
    """``torch.no_grad()`` for a tensor (imported only then), else nothing."""
    if library(x) != "torch":
        return nullcontext()
    import torch

    return torch.no_grad()


def _take(xp: Any, x: Array, rows: list[int], axis: int) -> Array:
    indices = (
        xp.asarray(rows, device=getattr(x, "device", None))
        if library(x) == "torch"
        else (xp.asarray(rows))
    )
    return xp.take(x, indices, axis=axis)


def _broadcast(xp: Any, x: Array, scores_shape: tuple[int, ...]) -> Array:
    """A mask or bias broadcast (as a view) to the scores' shape, to take rows from."""
    return xp.broadcast_to(x, scores_shape)
