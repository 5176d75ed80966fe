"""The :class:`Trace`: the steps of one or more attention calls, grouped by call.

See :mod:`qkv.trace` for the whole story. This module holds the recording (``record``,
the call brackets ``begin_call``/``end_call`` the attention core uses, a model's layers)
and the reading side (the flat view of steps, the call records, the file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from qkv._array import Array, library, to_numpy
from qkv._io import write_atomic
from qkv.steps import STEP_NAMES
from qkv.trace._calls import CallInfo, TraceCall, group_calls
from qkv.trace._check import (
    TRACE_FORMAT,
    TRACE_VERSION,
    TraceFileError,
    _jsonable,
)
from qkv.trace._file import parse_json, read_parts, read_text
from qkv.trace._layers import Selection
from qkv.trace._select import RecordingState
from qkv.trace._step import Step, Steps

__all__ = ["Trace", "blocks_open", "current", "current_or_none", "using"]

current: ContextVar[Trace | None] = ContextVar("qkv_trace", default=None)
"""The trace an enclosing ``qkv.tracing`` block (or a module's layer) records into."""

_OPEN: list[Trace | None] = []
"""One entry per block that sets :data:`current` and is still open, in any thread. While it
is empty no trace can be current, and :func:`current_or_none` answers without reading the
context variable, which ``torch.compile`` cannot trace (it reads this list's length, and
compiles again when a block opens)."""


@contextmanager
def using(trace: Trace | None) -> Iterator[None]:
    """Make ``trace`` the current one (None: record nothing) inside the block."""
    token = current.set(trace)
    _OPEN.append(trace)  # list.append and pop are atomic: safe across threads
    try:
        yield
    finally:
        _OPEN.pop()
        current.reset(token)


def blocks_open() -> bool:
    """Whether some tracing (or suspending) block is open, in any thread."""
    return len(_OPEN) > 0


def current_or_none() -> Trace | None:
    """The current trace, or None; without a context-variable read when no block is open."""
    return current.get() if _OPEN else None


_AFTER_CORE = ("concat", "W_o", "output")  # steps that close a multi-head call


@dataclass
class Trace(Selection, Steps):
    """The steps of one or more attention calls, in the order they ran, grouped by call.

    Read it flat (``trace.steps``, ``trace["weights"]``: the last step of that name) or by
    call (:attr:`calls`, :meth:`layer_names`, :meth:`call`).

    Attributes:
        steps: the recorded steps, every call's one after the other (the flat view).
        tokens: labels of the key/value positions (and of the queries, unless
            ``query_tokens`` is set), for tables and pictures.
        query_tokens: labels of the query positions when they differ (cross-attention).
        meta: facts about the run: ``num_heads``, ``num_kv_heads``, ``d_k``, ``scale``,
            ``scale_mode`` (``"sqrt_dk"``, ``"none"`` or ``"custom"``), ``causal``, ``mask``,
            and for a worked example ``name``, ``description`` and ``queries`` (the query
            positions to show). A model trace adds ``layers``: for each recorded module
            path, its ``num_heads``, ``num_kv_heads``, ``head_dim`` and what was selected.
        layers: which attention modules of a model to record: module paths or glob patterns
            (``"blocks.*.attn"``; a path also selects the modules inside it, so
            ``"blocks.0"`` selects ``"blocks.0.attn"``) and integers (the n-th attention
            module of the model, negative from the end); None records every one.
        heads: which query heads to record (negative from the end); None records all. The
            key/value steps keep the key/value head of each selected query head.
        queries: which query rows to record (negative from the end, e.g. ``-1`` for the last
            token of each call); None records all.
        record_steps: which step names to record; None records every step of the attention
            computation (a module's weight matrices ``W_q`` … ``W_o`` only when named here).

    Example:
        >>> import numpy as np
        >>> t = Trace(tokens=["a", "b"])
        >>> t.record("Q", np.ones((2, 3)), formula="Q = X·W_q", description="queries",
        ...          axes=("query", "dim"))
        >>> Trace.from_json(t.to_json())["Q"].shape
        (2, 3)
    """

    steps: list[Step] = field(default_factory=list)
    tokens: list[str] | None = None
    query_tokens: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    layers: tuple[str | int, ...] | None = None
    heads: tuple[int, ...] | None = None
    queries: tuple[int, ...] | None = None
    record_steps: tuple[str, ...] | None = None
    _calls: list[CallInfo] = field(
        default_factory=list, init=False, repr=False, compare=False
    )  # one per attention call, indexed by Step.call
    _state: RecordingState = field(
        default_factory=lambda: RecordingState(), init=False, repr=False, compare=False
    )

    def record(
        self,
        name: str,
        value: Array,
        *,
        formula: str,
        description: str,
        axes: tuple[str, ...],
        layer: str | None = None,
    ) -> None:
        """Append a step; ``value`` is copied to a NumPy array on the CPU.

        Only the selected heads and query rows are copied (see :attr:`heads`,
        :attr:`queries`); a step not in :attr:`record_steps` is skipped. Inside a module's
        :meth:`in_layer` block, ``layer`` defaults to the module's path.
        """
        if name not in STEP_NAMES:
            raise ValueError(f"unknown step name {name!r}; expected one of {STEP_NAMES}")
        if not self.wants_step(name):
            return
        axes = tuple(axes)
        if library(value) == "torch":
            value = value.detach()  # never part of the autograd graph
        value, index = self._slice(value, axes)
        layer = self._state.layer if layer is None else layer
        call = self._call_for(name, layer)
        self.steps.append(
            Step(name, to_numpy(value), formula, description, axes, layer, index, call)
        )

    def add(self, step: Step) -> None:
        """Append a step already copied to NumPy and already cut to the selection (its
        :attr:`~Step.index` says which rows it holds), as a kernel computing only the
        selected rows does; it joins the call being recorded and the current layer.
        A step not in :attr:`record_steps` is skipped."""
        if step.name not in STEP_NAMES:
            raise ValueError(f"unknown step name {step.name!r}; expected one of {STEP_NAMES}")
        if not self.wants_step(step.name):
            return
        layer = self._state.layer if step.layer is None else step.layer
        self.steps.append(replace(step, layer=layer, call=self._call_for(step.name, layer)))

    # -- call records ----------------------------------------------------------------------

    def begin_call(self, **facts: Any) -> None:
        """Open the record of one attention call (the attention core calls it before its
        first step); ``facts`` (JSON-able: ``backend``, ``shapes``, ...) go into the call's
        meta only. Steps recorded just before it by the same caller (a multi-head call's
        embeddings and projections, a module's) belong to the same call."""
        state = self._state
        if state.open is None or state.core != "none" or self._open_info().layer != state.layer:
            self._open_call(state.layer)
        state.core = "running"
        self._open_info().meta.update(facts)

    def note(self, **facts: Any) -> None:
        """Write facts of the call being recorded into its meta and into :attr:`meta`."""
        self.meta.update(facts)
        if self._state.open is not None:
            self._open_info().meta.update(facts)

    def note_sink(self, share: Array, axes: tuple[str, ...], logits: Sequence[float]) -> None:
        """Record an attention sink: the share of attention each row gives to it.

        Goes into the meta of the call being recorded (and :attr:`meta`) as ``sink``:
        ``{"logits": [one per head], "axes": [..., "query"], "share": nested lists}``, the
        share of each row being exp(sink_h) / (Σ_j exp(S'_ij) + exp(sink_h)) = 1 − Σ_j A_ij,
        cut to the selected heads and query rows (``index`` says which, as for a step).
        """
        if library(share) == "torch":
            share = share.detach()
        value, index = self._slice(share, tuple(axes))
        entry: dict[str, Any] = {
            "logits": [float(x) for x in logits],
            "axes": list(axes),
            "share": to_numpy(value).tolist(),
        }
        if index:
            entry["index"] = {k: list(v) for k, v in index.items()}
        self.note(sink=entry)

    def end_call(self, **facts: Any) -> None:
        """Close the attention core's part of a call: :meth:`note` its ``facts`` (scale,
        causality, heads, ...). Only a multi-head call's last steps (concat, W_o, output)
        may still join it."""
        self.note(**facts)
        if self._state.open is not None:
            self._state.core = "done"

    def amend_last_call(self, values: Mapping[str, Any], **facts: Any) -> None:
        """Change the call recorded last, after the fact: an intervention edited its result.

        ``values`` maps a step name to its new value (a NumPy array of the step's shape, cut
        to the step's selection); ``facts`` go into the call's meta (``edits``: what was
        edited). A step the call did not record is left out.
        """
        if not self._calls:
            return
        last = len(self._calls) - 1
        for position in range(len(self.steps) - 1, -1, -1):
            step = self.steps[position]
            if step.call is not None and step.call < last:
                break
            new = values.get(step.name)
            if step.call == last and new is not None and np.shape(new) == step.shape:
                self.steps[position] = replace(step, value=np.asarray(new))
        self._calls[last].meta.update(facts)

    def step_of_last_call(self, name: str) -> Step | None:
        """The step ``name`` of the call recorded last, or None."""
        last = len(self._calls) - 1
        for step in reversed(self.steps):
            if step.call is not None and step.call < last:
                break
            if step.call == last and step.name == name:
                return step
        return None

    def _open_info(self) -> CallInfo:
        assert self._state.open is not None
        return self._calls[self._state.open]

    def _open_call(self, layer: str | None, *, explicit: bool = False) -> None:
        state = self._state
        self._calls.append(CallInfo(layer, {}))
        state.open, state.core, state.explicit, state.names = (
            len(self._calls) - 1,
            "none",
            explicit,
            set(),
        )

    def _call_for(self, name: str, layer: str | None) -> int:
        """The call a step joins: the open one, unless it belongs to a new call (another
        layer; after the core, a step other than concat, W_o, output; without brackets, a
        step name that comes again)."""
        state = self._state
        if (
            state.open is None
            or self._open_info().layer != layer
            or (state.core == "done" and name not in _AFTER_CORE)
            or (state.core == "none" and not state.explicit and name in state.names)
        ):
            self._open_call(layer)
        state.names.add(name)
        assert state.open is not None
        return state.open

    @property
    def calls(self) -> list[TraceCall]:
        """One record per attention call, in the order they ran: its ``layer``, ``meta``
        (scale, causality, shapes, heads, backend, ...) and ``steps``.

        Example:
            >>> import numpy as np, qkv
            >>> with qkv.tracing() as t:
            ...     _ = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
            ...     _ = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2),
            ...                                          scale=1.0)
            >>> [(c.index, c.meta["scale"], c.meta["backend"]) for c in t.calls]
            [(0, 0.7071067811865475, 'reference'), (1, 1.0, 'reference')]
        """
        return group_calls(self.steps, self._calls, self.meta)

    def layer_names(self) -> list[str]:
        """The layers (module paths) that recorded calls, each once, in order of first call."""
        return list(dict.fromkeys(c.layer for c in self.calls if c.layer is not None))

    def call(self, layer: str | None = None, index: int = 0) -> Trace:
        """One call as a trace of its own, to render or save like any trace.

        Args:
            layer: the module path (``"blocks.3.attn"``): ``index`` counts that layer's
                calls. None: ``index`` counts every call of the trace.
            index: 0-based position; negative from the end (``-1``: the last call).

        Returns:
            A :class:`Trace` holding that call's steps, the trace's tokens, and the trace's
            meta with the call's facts over it.

        Raises:
            ValueError: no such layer, or no call at that position (the message says what
                there is).

        Example:
            >>> import numpy as np, qkv
            >>> with qkv.tracing() as t:
            ...     _ = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
            ...     _ = qkv.scaled_dot_product_attention(np.eye(3), np.eye(3), np.eye(3))
            >>> t.call(index=-1)["weights"].shape
            (3, 3)
        """
        records = self.calls
        if layer is not None:
            records = [c for c in records if c.layer == layer]
            if not records:
                known = ", ".join(repr(n) for n in self.layer_names()) or "none"
                raise ValueError(
                    f"call(layer={layer!r}): no call of that layer in this trace. Hint: its "
                    f"layers are {known}."
                )
        where = f"layer {layer!r} has" if layer is not None else "the trace has"
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"call(index=...) must be an integer, got {index!r}.")
        if not -len(records) <= index < len(records):
            raise ValueError(
                f"call(index={index}): {where} {len(records)} call(s). Hint: choose an index "
                f"from 0 to {len(records) - 1}, or a negative one from the end."
            )
        return self.subset([records[index]])

    def subset(self, records: Sequence[TraceCall]) -> Trace:
        """A trace of these calls only (records of this trace), with the same tokens; with
        one call, its facts are laid over the trace's meta (``trace["weights"]`` and
        ``trace.meta["scale"]`` are that call's)."""
        meta = dict(self.meta)
        if len(records) == 1:
            meta.update(records[0].meta)
            layers = meta.get("layers")
            if isinstance(layers, Mapping) and records[0].layer in layers:
                meta["layers"] = {records[0].layer: layers[records[0].layer]}
        sub = Trace(
            steps=[replace(s, call=i) for i, rec in enumerate(records) for s in rec.steps],
            tokens=self.tokens,
            query_tokens=self.query_tokens,
            meta=meta,
            layers=self.layers,
            heads=self.heads,
            queries=self.queries,
            record_steps=self.record_steps,
        )
        sub._calls = [CallInfo(rec.layer, dict(rec.meta)) for rec in records]
        return sub

    # -- the model's layers ------------------------------------------------------------

    @contextmanager
    def in_layer(self, name: str, **facts: Any) -> Iterator[Trace]:
        """Record the steps inside the block as the steps of the module at path ``name``.

        ``facts`` (JSON-able: ``num_heads``, ``head_dim``, ...) are kept in
        ``meta["layers"][name]``, with the heads and query rows selected.
        """
        state = self._state
        previous, previous_heads = state.layer, state.call_heads
        state.layer, state.call_heads = name, None
        layers = self.meta.setdefault("layers", {})
        info = layers.setdefault(name, {})
        info.update(facts)
        if self.heads is not None and isinstance(facts.get("num_heads"), int):
            info["heads"] = self.selection("head", facts["num_heads"])
        self._open_call(name, explicit=True)  # one call record per forward of the module
        self._open_info().meta.update(facts)
        try:
            with using(self):
                yield self
        finally:
            state.layer, state.call_heads = previous, previous_heads
            state.open = None

    # -- serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON-able data, version 2: the flat ``steps`` (each with the
        position of its ``call``) and one ``calls`` entry per call (``layer``, ``meta``)."""
        records = self.calls
        out = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "tokens": self.tokens,
            "query_tokens": self.query_tokens,
            "meta": _jsonable(self.meta),
            "calls": [{"layer": c.layer, "meta": _jsonable(dict(c.meta))} for c in records],
            "steps": [{**step.to_dict(), "call": c.index} for c in records for step in c],
        }
        selection = {
            "layers": self.layers,
            "heads": self.heads,
            "queries": self.queries,
            "record_steps": self.record_steps,
        }
        if any(v is not None for v in selection.values()):
            out["selection"] = {k: list(v) for k, v in selection.items() if v is not None}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        """A trace from :meth:`to_dict`'s form (version 1 or 2), every field checked.

        Raises:
            TraceFileError: not a qkv trace, another version, or a field that is missing,
                of the wrong type or inconsistent; the message names the field.
        """
        parts, infos = read_parts(data)
        trace = cls(**parts)
        trace._calls = infos
        return trace

    def to_json(self, *, indent: int | None = None) -> str:
        """The trace as JSON; ±inf and NaN are written as the strings "inf", "-inf", "nan"."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Trace:
        """A trace from the JSON text of :meth:`to_json`.

        Raises:
            TraceFileError: not valid JSON, nested too deeply, or not a valid trace.
        """
        return cls.from_dict(parse_json(text))

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON, atomically (a failed write leaves no partial file)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace saved with :meth:`save` (file version 1 or 2).

        Raises:
            TraceFileError: not a regular file, larger than :data:`MAX_TRACE_BYTES`, not
                UTF-8, not valid JSON or not a valid trace; the message names the file and
                the field.
            OSError: the file does not exist or cannot be read.
        """
        source = os.fspath(path)
        try:
            return cls.from_json(read_text(path))
        except TraceFileError as error:
            raise TraceFileError(error.problem, field=error.field, source=source) from None
