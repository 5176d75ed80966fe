"""The step trace: every intermediate of attention, with its name, formula and numbers.

A :class:`Trace` is a list of :class:`Step` objects. Pass ``trace=qkv.Trace()`` to an attention
function, or run it inside ``with qkv.tracing() as t:``; with neither, nothing is recorded and
nothing is converted, so tracing costs nothing when it is off.

Step names are a public interface (renderers and the JSON file use them):
``embeddings``, ``W_q``, ``W_k``, ``W_v``, ``Q``, ``K``, ``V``, ``scores``, ``scaled``, ``bias``,
``masked``, ``weights``, ``dropout``, ``context``, ``concat``, ``W_o``, ``output``.

Each step names its axes, so a renderer can pick one head or one batch element out of it:
``batch``, ``head`` (query heads), ``kv_head`` (key/value heads, fewer under GQA), ``query``,
``key``, ``token``, ``model`` (d_model features), ``dim`` (per-head features) and ``feature``
(the columns of a projection matrix, all heads side by side).

On a model, ``qkv.tracing(model=model, layers=..., heads=..., queries=...)`` records only the
chosen attention modules (named by their path in the model, e.g. ``"blocks.0.attn"``), heads
and query rows: a step is sliced along its ``head``/``kv_head`` and ``query`` axes before it is
copied to the CPU, so memory holds only what was asked. Values are always detached copies.

Example:
    >>> import numpy as np, qkv
    >>> x = np.eye(2)
    >>> with qkv.tracing() as t:
    ...     _ = qkv.self_attention(x, np.eye(2), np.eye(2), np.eye(2))
    >>> [s.name for s in t][:5]
    ['embeddings', 'W_q', 'W_k', 'W_v', 'Q']
    >>> t["weights"].value.round(4)
    array([[0.6698, 0.3302],
           [0.3302, 0.6698]])
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import array_api_compat
import numpy as np

from qkv._array import Array, library, to_numpy
from qkv._io import write_atomic
from qkv._read import FileLimitError, json_value, read_bytes

__all__ = [
    "MAX_TRACE_BYTES",
    "STEP_NAMES",
    "Step",
    "Trace",
    "TraceFileError",
    "current_trace",
    "suspended",
    "tracing",
]

STEP_NAMES = (
    "embeddings",
    "W_q",
    "W_k",
    "W_v",
    "Q",
    "K",
    "V",
    "scores",
    "scaled",
    "bias",
    "masked",
    "weights",
    "dropout",
    "context",
    "concat",
    "W_o",
    "output",
)
"""The step names, in the order of computation."""

TRACE_FORMAT = "qkv-trace"
TRACE_VERSION = 1


@dataclass
class Step:
    """One recorded step: a named value with its formula and the meaning of each axis.

    Attributes:
        name: one of :data:`STEP_NAMES`.
        value: a NumPy copy of the value, e.g. shape (B, H, Lq, Lk) for ``weights``.
        formula: the formula in plain text, e.g. ``"A = softmax(S')"``.
        description: one line on what the step means, in the seeds' words.
        axes: one name per axis of ``value`` (see the module docstring).
        layer: the module that recorded it, when the trace spans a model.
        index: for each axis the trace sliced (``head``, ``kv_head``, ``query``), the
            original index of each entry kept, e.g. ``{"head": [2, 5]}``; None when whole.
    """

    name: str
    value: np.ndarray
    formula: str
    description: str
    axes: tuple[str, ...]
    layer: str | None = None
    index: dict[str, list[int]] | None = None

    def __post_init__(self) -> None:
        if len(self.axes) != self.value.ndim:
            raise ValueError(
                f"step {self.name!r}: {len(self.axes)} axis names {self.axes} for a value of "
                f"{self.value.ndim} dimensions {self.value.shape}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def select(self, *, head: int = 0, batch: int = 0, group_size: int = 1) -> np.ndarray:
        """The 2-D (or 1-D) slice for one head of one batch element.

        Args:
            head: the query head; a ``kv_head`` axis is indexed with ``head // group_size``.
            batch: the batch element (every axis other than head, query, key, token, model,
                dim and feature is indexed with it).
            group_size: query heads per key/value head (1 without GQA).
        """
        index: list[int | slice] = []
        for axis in self.axes:
            if axis == "head":
                index.append(head)
            elif axis == "kv_head":
                index.append(head // group_size)
            elif axis in ("query", "key", "token", "model", "dim", "feature"):
                index.append(slice(None))
            else:
                index.append(batch)
        return self.value[tuple(index)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "formula": self.formula,
            "description": self.description,
            "axes": list(self.axes),
            "shape": list(self.shape),
            "dtype": str(self.value.dtype),
            "value": _encode(self.value),
        }
        if self.layer is not None:
            out["layer"] = self.layer
        if self.index:
            out["index"] = {axis: list(rows) for axis, rows in self.index.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, field: str = "step") -> Step:
        """A step from :meth:`to_dict`'s form, every field checked.

        Raises:
            TraceFileError: a field is missing or of the wrong type, the value does not
                match the shape, or a number does not fit the dtype; the message names the
                field (``steps[2].shape``).
        """
        data = _expect(data, Mapping, field, "an object with name, axes, shape and value")
        name = _expect(_required(data, "name", field), str, f"{field}.name", "a step name")
        if name not in STEP_NAMES:
            raise TraceFileError(
                f"unknown step name {_short(name)}; expected one of {', '.join(STEP_NAMES)}",
                field=f"{field}.name",
            )
        axes = _texts(_required(data, "axes", field), f"{field}.axes", "axis names")
        shape = _shape(_required(data, "shape", field), f"{field}.shape")
        if len(axes) != len(shape):
            raise TraceFileError(
                f"{len(axes)} axis names for a shape of {len(shape)} dimensions {list(shape)}",
                field=f"{field}.axes",
            )
        dtype = _dtype(data.get("dtype", "float64"), f"{field}.dtype")
        value = _values(_required(data, "value", field), shape, dtype, f"{field}.value")
        index = None
        if data.get("index") is not None:
            given = _expect(data["index"], Mapping, f"{field}.index", "an object of axis: rows")
            index = {
                str(k): list(_whole_numbers(v, f"{field}.index.{k}")) for k, v in given.items()
            }
        return cls(
            name=name,
            value=value,
            formula=_optional_text(data, "formula", field) or "",
            description=_optional_text(data, "description", field) or "",
            axes=axes,
            layer=_optional_text(data, "layer", field),
            index=index or None,
        )


@dataclass
class Trace:
    """The steps of one or more attention computations, in the order they ran.

    Attributes:
        steps: the recorded steps.
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
    _state: _RecordingState = field(
        default_factory=lambda: _RecordingState(), init=False, repr=False, compare=False
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
        self.steps.append(Step(name, to_numpy(value), formula, description, axes, layer, index))

    # -- selection -------------------------------------------------------------------------

    def wants_step(self, name: str) -> bool:
        """Whether a step of this name is recorded.

        With no :attr:`record_steps`, every step is except the weight matrices of a module
        (W_q, W_k, W_v, W_o), which a module records only when they are named.
        """
        if self.record_steps is None:
            return name not in _PARAMETER_STEPS or self._state.layer is None
        return name in self.record_steps

    def selection(self, axis: str, size: int) -> list[int] | None:
        """The indices of ``axis`` (``"head"`` or ``"query"``) to record, for an axis of
        ``size`` entries, with negative indices resolved; None when the whole axis is kept.

        A kernel may use it to compute only these rows when tracing a long sequence.

        Raises:
            ValueError: a selected index does not exist in this call.

        Example:
            >>> Trace(queries=(0, -1)).selection("query", 5)
            [0, 4]
        """
        chosen = {"head": self.heads, "query": self.queries}.get(axis)
        if chosen is None:
            return None
        where = f" in layer {self._state.layer!r}" if self._state.layer else ""
        resolved = []
        for i in chosen:
            if not -size <= i < size:
                kind = "heads" if axis == "head" else "queries"
                raise ValueError(
                    f"tracing {kind}={list(chosen)}: index {i} does not exist{where}, which "
                    f"has {size} {'heads' if axis == 'head' else 'query rows'}. Hint: choose "
                    f"indices from 0 to {size - 1} (or negative ones from the end)."
                )
            resolved.append(i % size)
        return resolved

    def _slice(self, value: Array, axes: tuple[str, ...]) -> tuple[Array, dict[str, list[int]]]:
        """Keep only the selected entries of the head, kv_head and query axes of ``value``."""
        index: dict[str, list[int]] = {}
        state = self._state
        for position, axis in enumerate(axes):
            size = int(value.shape[position])
            if axis == "head":
                state.call_heads = size
                rows = self.selection("head", size)
            elif axis == "kv_head":
                rows = self._kv_rows(size)
            elif axis == "query":
                rows = self.selection("query", size)
                if rows is not None:
                    state.note_queries(rows)
            else:
                continue
            if rows is None:
                continue
            index[axis] = rows
            if rows != list(range(size)):
                value = _take(value, rows, position)
        return value, index

    def _kv_rows(self, size: int) -> list[int] | None:
        """The key/value head of each selected query head (one row per selected head)."""
        heads = self._state.call_heads
        if self.heads is None or heads is None or heads % size:
            return None
        chosen = self.selection("head", heads)
        assert chosen is not None
        group = heads // size
        return [h // group for h in chosen]

    # -- layers of a model -----------------------------------------------------------------

    @property
    def current_layer(self) -> str | None:
        """The path of the module recording now (inside :meth:`in_layer`), else None."""
        return self._state.layer

    def layer_name(self, module: object) -> str:
        """The path of a qkv module in the traced model (``"blocks.0.attn"``).

        Modules found by ``tracing(model=...)`` have their path in the model; any other one
        is named by its class and the order of its first call (``"MultiHeadAttention.0"``).
        """
        state = self._state
        name = state.paths.get(id(module))
        if name is None:
            name = f"{type(module).__name__}.{state.unnamed}"
            state.unnamed += 1
            state.paths[id(module)] = name
            if not state.from_model:
                state.order.append(name)
        return name

    def records_layer(self, name: str) -> bool:
        """Whether the module at path ``name`` is recorded (see :attr:`layers`)."""
        return self.layers is None or any(self._selects(s, name) for s in self.layers)

    def _selects(self, selector: str | int, name: str) -> bool:
        """Whether one layer selector (a path, pattern or position) selects ``name``."""
        if isinstance(selector, str):
            return fnmatch.fnmatchcase(name, selector) or name.startswith(selector + ".")
        order = self._state.order
        return -len(order) <= selector < len(order) and order[selector] == name

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
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)
            state.layer, state.call_heads = previous, previous_heads

    def _use_model(self, model: object) -> None:
        """Name every qkv module of ``model`` by its path, and check :attr:`layers`."""
        named = getattr(model, "named_modules", None)
        if not callable(named):
            raise TypeError(
                f"tracing(model=...) expects a torch.nn.Module, got {type(model).__name__}. "
                "Hint: pass the model whose attention layers you want to record."
            )
        state = self._state
        state.from_model = True
        state.order = []
        for path, module in named():
            if getattr(module, "_qkv_traceable", False):
                name = path or type(module).__name__
                state.paths[id(module)] = name
                state.order.append(name)
        if not state.order:
            raise ValueError(
                f"tracing(model=...): the {type(model).__name__} has no qkv attention module "
                "to record. Hint: build it with qkv.nn.MultiHeadAttention (or convert a "
                "torch.nn.MultiheadAttention with MultiHeadAttention.from_torch)."
            )
        for selector in self.layers or ():
            if not any(self._selects(selector, name) for name in state.order):
                shown = ", ".join(repr(n) for n in state.order[:8])
                more = f" and {len(state.order) - 8} more" if len(state.order) > 8 else ""
                raise ValueError(
                    f"tracing layers: {selector!r} selects no attention module of the model. "
                    f"Hint: its attention modules are {shown}{more} (or 0 to "
                    f"{len(state.order) - 1} by position)."
                )

    def _finish(self) -> None:
        """At the end of a tracing block: label the query rows kept by their positions (when
        every call kept the same), and title a model trace by what it recorded."""
        rows = self._state.query_rows
        if rows and self.query_tokens is None:
            tokens = self.tokens
            self.query_tokens = [
                tokens[i] if tokens is not None and i < len(tokens) else f"t{i}" for i in rows
            ]
        layers = self.meta.get("layers")
        if not layers or "name" in self.meta:
            return
        names = list(layers)
        self.meta["name"] = f"Attention in {names[0] if len(names) == 1 else 'a model'}"
        parts = [f"recorded layers: {', '.join(names)}"]
        heads = next((info["heads"] for info in layers.values() if "heads" in info), None)
        if heads is not None:
            total = next(iter(layers.values())).get("num_heads")
            of = f" of {total}" if total else ""
            parts.append(f"heads {', '.join(str(h + 1) for h in heads)}{of} (numbered from 1)")
        if rows:
            parts.append(f"query rows {', '.join(map(str, rows))} (from 0)")
        self.meta["description"] = "Recorded with qkv.tracing; " + "; ".join(parts) + "."

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __contains__(self, name: object) -> bool:
        return any(step.name == name for step in self.steps)

    def __getitem__(self, name: str) -> Step:
        """The last step recorded under ``name``."""
        for step in reversed(self.steps):
            if step.name == name:
                return step
        recorded = ", ".join(dict.fromkeys(s.name for s in self.steps)) or "none"
        raise KeyError(f"no step named {name!r} in this trace (recorded: {recorded})")

    def get(self, name: str) -> Step | None:
        """The last step recorded under ``name``, or None."""
        matches = [step for step in self.steps if step.name == name]
        return matches[-1] if matches else None

    @property
    def names(self) -> list[str]:
        """The names of the recorded steps, in order."""
        return [step.name for step in self.steps]

    def _repr_html_(self) -> str | None:
        """Jupyter shows the interactive page (:func:`qkv.render.html`) in a sandboxed iframe."""
        from qkv.render._html import notebook_html  # the render layer sits above this one

        return notebook_html(self)

    # -- serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "tokens": self.tokens,
            "query_tokens": self.query_tokens,
            "meta": _jsonable(self.meta),
            "steps": [step.to_dict() for step in self.steps],
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
        """A trace from :meth:`to_dict`'s form, every field checked.

        Raises:
            TraceFileError: not a qkv trace, another version, or a field that is missing,
                of the wrong type or inconsistent; the message names the field.
        """
        data = _expect(data, Mapping, "", "a JSON object (a trace saved with Trace.save)")
        if data.get("format") != TRACE_FORMAT:
            raise TraceFileError(
                f"not a qkv trace: 'format' is {_short(data.get('format'))}, expected "
                f"{TRACE_FORMAT!r}"
            )
        if data.get("version") != TRACE_VERSION:
            raise TraceFileError(
                f"unsupported trace version {_short(data.get('version'))}; "
                f"this qkv reads version {TRACE_VERSION}"
            )
        selection = _expect(data.get("selection") or {}, Mapping, "selection", "an object")

        def chosen(key: str, kinds: tuple[type, ...]) -> tuple[Any, ...] | None:
            value = selection.get(key)
            if value is None:
                return None
            items = _expect(value, list, f"selection.{key}", "a list")
            for i, item in enumerate(items):
                _expect(item, kinds, f"selection.{key}[{i}]", "a name or a whole number")
            return tuple(items)

        steps = _expect(_required(data, "steps", ""), list, "steps", "a list of steps")
        return cls(
            steps=[Step.from_dict(s, field=f"steps[{i}]") for i, s in enumerate(steps)],
            tokens=_token_list(data.get("tokens"), "tokens"),
            query_tokens=_token_list(data.get("query_tokens"), "query_tokens"),
            meta=_meta(data.get("meta")),
            layers=chosen("layers", (str, int)),
            heads=chosen("heads", (int,)),
            queries=chosen("queries", (int,)),
            record_steps=chosen("record_steps", (str,)),
        )

    def to_json(self, *, indent: int | None = None) -> str:
        """The trace as JSON; ±inf and NaN are written as the strings "inf", "-inf", "nan"."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Trace:
        """A trace from the JSON text of :meth:`to_json`.

        Raises:
            TraceFileError: not valid JSON, nested too deeply, or not a valid trace.
        """
        try:
            data = json_value(text)
        except json.JSONDecodeError as error:
            raise TraceFileError(
                f"not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
            ) from None
        except FileLimitError as error:
            raise TraceFileError(error.problem) from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON, atomically (a failed write leaves no partial file)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace saved with :meth:`save`.

        Raises:
            TraceFileError: not a regular file, larger than :data:`MAX_TRACE_BYTES`, not
                UTF-8, not valid JSON or not a valid trace; the message names the file and
                the field.
            OSError: the file does not exist or cannot be read.
        """
        source = os.fspath(path)
        try:
            raw = read_bytes(path, limit=MAX_TRACE_BYTES, what="a trace file")
        except FileLimitError as error:
            raise TraceFileError(error.problem, source=source) from None
        try:
            return cls.from_json(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise TraceFileError(
                f"not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})",
                source=source,
            ) from None
        except TraceFileError as error:
            raise TraceFileError(error.problem, field=error.field, source=source) from None


MAX_TRACE_BYTES = 1 << 28
"""The most bytes :meth:`Trace.load` reads (256 MiB): a larger file is refused before it is
read. Record fewer layers, heads or queries to save a smaller trace."""


class TraceFileError(ValueError):
    """A saved trace that cannot be read: the file, the field and what was expected.

    The message reads ``"trace.json: steps[2].shape: expected a list of whole numbers, got
    a text 'x'"``; the parts are also attributes.

    Attributes:
        problem: what is wrong.
        field: the path of the offending value (``steps[2].shape``), or None.
        source: the file, when the trace was read from one.
    """

    def __init__(
        self, problem: str, *, field: str | None = None, source: str | None = None
    ) -> None:
        self.problem = problem
        self.field = field or None
        self.source = source
        super().__init__(": ".join(p for p in (source, self.field, problem) if p))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (self.problem, self.field, self.source))


def _rebuild_error(problem: str, field: str | None, source: str | None) -> TraceFileError:
    return TraceFileError(problem, field=field, source=source)


# -- checking a saved trace, field by field ------------------------------------------------

_DTYPE_KINDS = "biuf"  # bool, signed and unsigned integers, floats
_META_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), "a text"),
    "description": ((str,), "a text"),
    "example": ((str,), "a text"),
    "scale_mode": ((str,), "a text"),
    "causal_alignment": ((str,), "a text"),
    "mask": ((str,), "a text"),
    "score_mod": ((str,), "a text"),
    "causal": ((bool,), "true or false"),
    "scale": ((int, float), "a number"),
    "d_k": ((int,), "a whole number"),
    "d_v": ((int,), "a whole number"),
    "d_model": ((int,), "a whole number"),
    "num_heads": ((int,), "a whole number"),
    "num_kv_heads": ((int,), "a whole number"),
    "queries": ((list,), "a list of tokens or positions"),
    "example_queries": ((list,), "a list of positions"),
    "layers": ((dict,), "an object"),
    "partial": ((dict,), "an object"),
    "prediction": ((dict,), "an object"),
}


def _short(value: Any) -> str:
    """A value from the file for a message, at most about 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "…" + text[-3:]


def _kind(value: Any) -> str:
    """What a JSON value is, in words: ``"a list"``, ``"the text 'x'"``, ``"the number 3"``."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the text {_short(value)}"
    if isinstance(value, bool):
        return f"the truth value {'true' if value else 'false'}"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return f"the number {_short(value)}"
    return type(value).__name__


def _expect(value: Any, kinds: Any, field: str, what: str) -> Any:
    """``value`` when it is one of ``kinds`` (``bool`` is not a number here), else an error."""
    wanted = kinds if isinstance(kinds, tuple) else (kinds,)
    ok = isinstance(value, wanted) and not (isinstance(value, bool) and bool not in wanted)
    if not ok:
        raise TraceFileError(f"expected {what}, got {_kind(value)}", field=field)
    return value


def _required(data: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in data:
        raise TraceFileError(f"the key {key!r} is missing", field=field)
    return data[key]


def _optional_text(data: Mapping[str, Any], key: str, field: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    text: str = _expect(value, str, f"{field}.{key}", "a text")
    return text


def _texts(value: Any, field: str, what: str) -> tuple[str, ...]:
    items = _expect(value, list, field, f"a list of {what}")
    return tuple(_expect(item, str, f"{field}[{i}]", "a text") for i, item in enumerate(items))


def _token_list(value: Any, field: str) -> list[str] | None:
    return None if value is None else list(_texts(value, field, "tokens (texts)"))


def _whole_numbers(value: Any, field: str) -> tuple[int, ...]:
    items = _expect(value, list, field, "a list of whole numbers")
    return tuple(
        _expect(item, int, f"{field}[{i}]", "a whole number") for i, item in enumerate(items)
    )


def _shape(value: Any, field: str) -> tuple[int, ...]:
    shape = _whole_numbers(value, field)
    if any(size < 0 for size in shape):
        raise TraceFileError(f"expected sizes ≥ 0, got {list(shape)}", field=field)
    return shape


def _dtype(value: Any, field: str) -> np.dtype[Any]:
    text = _expect(value, str, field, "a NumPy dtype name like 'float64'")
    try:
        dtype: np.dtype[Any] | None = np.dtype(text)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _DTYPE_KINDS:
        raise TraceFileError(
            "expected a dtype of floats, whole numbers or truth values (float64, float32, "
            f"int64, bool), got {_short(text)}",
            field=field,
        )
    return dtype


def _values(value: Any, shape: tuple[int, ...], dtype: np.dtype[Any], field: str) -> np.ndarray:
    """The numbers of a step as an array of ``shape`` and ``dtype``, each one checked."""
    count = math.prod(shape)
    if not shape and isinstance(value, list):
        raise TraceFileError("expected one number (the shape is []), got a list", field=field)
    items = value if isinstance(value, list) else [value]
    if len(items) != count:
        raise TraceFileError(
            f"expected {count:,} numbers (the shape is {list(shape)}), got {len(items):,}",
            field=field,
        )
    for i, item in enumerate(items):
        fine = (
            item in ("nan", "inf", "-inf")
            if isinstance(item, str)
            else isinstance(item, int | float) and (dtype.kind == "b" or not isinstance(item, bool))
        )
        if not fine:
            raise TraceFileError(
                f"expected a number, 'nan', 'inf' or '-inf', got {_kind(item)}",
                field=f"{field}[{i}]",
            )
    try:
        numbers = np.array([float(v) for v in items], dtype=np.float64)
    except OverflowError:
        raise TraceFileError("a whole number is too large for a float", field=field) from None
    if dtype.kind in "iub":
        bad = ~np.isfinite(numbers)
        bad[~bad] |= numbers[~bad] != np.round(numbers[~bad])
        if dtype.kind == "b":
            expected = "true or false"
            bad |= (numbers != 0) & (numbers != 1)
        else:
            info = np.iinfo(dtype)
            expected = f"a whole number from {info.min} to {info.max}"
            bad |= (numbers < info.min) | (numbers > info.max)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TraceFileError(
                f"expected {expected} (the dtype is {dtype}), got {_kind(items[i])}",
                field=f"{field}[{i}]",
            )
    with np.errstate(over="ignore"):  # float64 numbers beyond float16/float32 become ±inf
        return numbers.astype(dtype).reshape(shape)


def _meta(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    meta = dict(_expect(value, Mapping, "meta", "an object"))
    for key, (kinds, what) in _META_TYPES.items():
        if meta.get(key) is not None:
            _expect(meta[key], kinds, f"meta.{key}", what)
    for i, query in enumerate(meta.get("queries") or []):
        _expect(query, (int, str), f"meta.queries[{i}]", "a token or a position")
    for i, query in enumerate(meta.get("example_queries") or []):
        _expect(query, int, f"meta.example_queries[{i}]", "a position")
    return meta


_PARAMETER_STEPS = ("W_q", "W_k", "W_v", "W_o")


@dataclass
class _RecordingState:
    """What a trace keeps while recording: not data, not saved."""

    layer: str | None = None  # the module recording now
    call_heads: int | None = None  # query heads of the call being recorded (for kv_head)
    paths: dict[int, str] = field(default_factory=dict)  # id(module) -> path
    order: list[str] = field(default_factory=list)  # module paths, in model (or call) order
    from_model: bool = False
    unnamed: int = 0
    query_rows: list[int] | None = None  # the query rows kept, while every call agrees
    queries_differ: bool = False

    def note_queries(self, rows: list[int]) -> None:
        if self.query_rows is None and not self.queries_differ:
            self.query_rows = rows
        elif self.query_rows != rows:
            self.query_rows, self.queries_differ = None, True


def _take(value: Array, rows: list[int], axis: int) -> Array:
    """The entries ``rows`` of ``axis`` (a copy), in the array's own library."""
    if library(value) == "numpy":
        return np.take(value, rows, axis=axis)
    xp = array_api_compat.array_namespace(value)
    indices = xp.asarray(rows, dtype=xp.int64, device=array_api_compat.device(value))
    return xp.take(value, indices, axis=axis)


def _encode(value: np.ndarray) -> Any:
    if value.dtype == np.bool_:
        return value.tolist()
    flat = [_encode_number(float(v)) for v in value.reshape(-1)]
    return flat if value.ndim != 0 else flat[0]


def _encode_number(v: float) -> float | str:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [float(v) if isinstance(v, str) else v for v in value]
    return float(value) if isinstance(value, str) else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float):
        return _encode_number(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


# -- the recorder in a ContextVar ----------------------------------------------------------

_current: ContextVar[Trace | None] = ContextVar("qkv_trace", default=None)


def current_trace() -> Trace | None:
    """The trace being recorded by an enclosing :func:`tracing` block, or None."""
    return _current.get()


@contextmanager
def tracing(
    trace: Trace | None = None,
    *,
    model: object = None,
    layers: str | int | Sequence[str | int] | None = None,
    heads: int | Sequence[int] | None = None,
    queries: int | Sequence[int] | None = None,
    steps: str | Sequence[str] | None = None,
) -> Iterator[Trace]:
    """Record every attention call inside the block into one trace.

    On a model, choose what to record: only the chosen layers, heads and query rows are
    copied (to the CPU, detached), so a trace of a long sequence stays small. It works under
    ``torch.no_grad()`` and while training.

    Args:
        trace: the trace to append to; a new one by default.
        model: the model (a ``torch.nn.Module``) whose qkv attention modules to name by their
            path, e.g. ``"blocks.0.attn"``. Without it, modules are named by class and call
            order (``"MultiHeadAttention.0"``).
        layers: module paths, glob patterns (``"blocks.*.attn"``; ``"blocks.0"`` selects
            the attention inside ``blocks.0``) or positions among the model's attention
            modules (``0``, ``-1``); default: all.
        heads: query heads to record, e.g. ``[0, 3]``; default: all.
        queries: query rows to record, e.g. ``-1`` (the last token of each call); default:
            all.
        steps: step names to record, e.g. ``["weights"]``; default: every step of the
            computation (a module's W_q, W_k, W_v, W_o only when named).

    Raises:
        ValueError, TypeError: a selection that is not a list of integers or names, an
            unknown step name, or layers that select no attention module of ``model``.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.scaled_dot_product_attention(np.ones((2, 4)), np.ones((3, 4)),
        ...                                          np.ones((3, 4)))
        >>> t["weights"].shape
        (2, 3)
        >>> q = np.ones((1, 4, 5, 2))                    # (B, H, Lq, D)
        >>> with qkv.tracing(heads=[1, 3], queries=-1) as t:
        ...     _ = qkv.scaled_dot_product_attention(q, q, q)
        >>> t["weights"].shape, t["weights"].index
        ((1, 2, 1, 5), {'head': [1, 3], 'query': [4]})
    """
    trace = Trace() if trace is None else trace
    if layers is not None:
        trace.layers = _layer_selection(layers)
    if heads is not None:
        trace.heads = _int_selection(heads, "heads", "heads=[0, 3] records heads 0 and 3")
    if queries is not None:
        trace.queries = _int_selection(
            queries, "queries", "queries=-1 records the last query row of each call"
        )
    if steps is not None:
        trace.record_steps = _step_selection(steps)
    if model is not None:
        trace._use_model(model)
    elif trace.layers is not None and any(isinstance(s, int) and s < 0 for s in trace.layers):
        raise ValueError(
            f"tracing layers={list(trace.layers)}: a negative position needs model=... to know "
            "how many attention modules there are. Hint: qkv.tracing(model=model, layers=-1)."
        )
    token = _current.set(trace)
    try:
        yield trace
    finally:
        _current.reset(token)
        trace._finish()


@contextmanager
def suspended() -> Iterator[None]:
    """Record nothing inside the block, even inside a :func:`tracing` block.

    A module whose layer is not selected runs its attention in here, so that the fast
    path runs and nothing is copied.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t, suspended():
        ...     _ = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
        >>> len(t)
        0
    """
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def _int_selection(value: object, name: str, hint: str) -> tuple[int, ...]:
    items = [value] if isinstance(value, int) else value
    if (
        not isinstance(items, Sequence)
        or isinstance(items, str)
        or not items
        or any(isinstance(i, bool) or not isinstance(i, int) for i in items)
    ):
        raise TypeError(
            f"tracing {name} must be an integer or a non-empty list of integers, got "
            f"{value!r}. Hint: {hint}."
        )
    return tuple(int(i) for i in items)


def _layer_selection(value: object) -> tuple[str | int, ...]:
    items = [value] if isinstance(value, str | int) else value
    if (
        not isinstance(items, Sequence)
        or not items
        or any(isinstance(i, bool) or not isinstance(i, str | int) for i in items)
    ):
        raise TypeError(
            f"tracing layers must be a module path, a position, or a non-empty list of them, "
            f"got {value!r}. Hint: layers=['blocks.0.attn'], layers='blocks.*.attn' or "
            "layers=[0, -1]."
        )
    return tuple(items)


def _step_selection(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not items:
        raise TypeError(
            f"tracing steps must be a step name or a non-empty list of them, got {value!r}. "
            "Hint: steps=['weights'] records only the attention weights."
        )
    unknown = [s for s in items if s not in STEP_NAMES]
    if unknown:
        raise ValueError(
            f"tracing steps: unknown step name {unknown[0]!r}. Hint: the steps are "
            f"{', '.join(STEP_NAMES)}."
        )
    return tuple(items)


def resolve(trace: Trace | None) -> Trace | None:
    """The trace to record into: the one given, else the enclosing :func:`tracing` block's."""
    return trace if trace is not None else _current.get()
