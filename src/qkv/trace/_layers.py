"""What a :class:`~qkv.trace.Trace` selects: the heads, query rows and steps it records, and
the layers of a model (their paths, which are recorded, the title of a model trace). A base
of :class:`~qkv.trace.Trace`, apart to keep each module short."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

from qkv._array import Array
from qkv.trace._select import PARAMETER_STEPS, RecordingState, and_list, row_labels, take

__all__ = ["Selection"]


class Selection:
    """The selection of a trace: :meth:`selection`, :meth:`wants_step`, the model's layers.

    Its fields are the trace's (:class:`~qkv.trace.Trace` declares them)."""

    tokens: list[str] | None
    query_tokens: list[str] | None
    meta: dict[str, Any]
    layers: tuple[str | int, ...] | None
    heads: tuple[int, ...] | None
    queries: tuple[int, ...] | None
    record_steps: tuple[str, ...] | None
    _state: RecordingState

    # -- selection -------------------------------------------------------------------------

    def wants_step(self, name: str) -> bool:
        """Whether a step of this name is recorded.

        With no :attr:`record_steps`, every step is except the weight matrices of a module
        (W_q, W_k, W_v, W_o), which a module records only when they are named.
        """
        if self.record_steps is None:
            return name not in PARAMETER_STEPS or self._state.layer is None
        return name in self.record_steps

    def selection(self, axis: str, size: int) -> list[int] | None:
        """The indices of ``axis`` (``"head"`` or ``"query"``) to record, for an axis of
        ``size`` entries, with negative indices resolved; None when the whole axis is kept.

        A kernel may use it to compute only these rows when tracing a long sequence.

        Raises:
            ValueError: a selected index does not exist in this call.

        Example:
            >>> from qkv.trace import Trace
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
                value = take(value, rows, position)
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

    # -- the model's layers ------------------------------------------------------------

    def _use_model(
        self, model: object, modules: Sequence[tuple[str, object]] | None = None
    ) -> None:
        """Name every qkv module of ``model`` by its path (or the ``(path, module)`` pairs
        ``modules`` that a model adapter found), and check :attr:`layers`."""
        named = getattr(model, "named_modules", None)
        if not callable(named):
            raise TypeError(
                f"tracing(model=...) expects a torch.nn.Module, got {type(model).__name__}. "
                "Hint: pass the model whose attention layers you want to record."
            )
        state = self._state
        state.from_model = True
        state.order = []
        found = (
            modules
            if modules is not None
            else [(p, m) for p, m in named() if getattr(m, "_qkv_traceable", False)]
        )
        for path, module in found:
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
        self._state.open = None  # the block's last call is complete
        layers = self.meta.get("layers")
        if not layers or "name" in self.meta:
            return
        names = list(layers)
        self.meta["name"] = f"Attention in {names[0] if len(names) == 1 else 'a model'}"
        parts = [f"recorded layers: {', '.join(names)}"]
        heads = next((info["heads"] for info in layers.values() if "heads" in info), None)
        if heads is not None:
            # Heads as the section titles name them (Head 0 … Head H−1, counted from 0 as
            # ``heads=`` counts them); query rows by the labels of the tables (the token,
            # ``the#4`` when it repeats, ``t4`` without).
            total = next(iter(layers.values())).get("num_heads")
            of = f" of {total} heads" if total else ""
            parts.append(f"{and_list(['head ' + str(h) for h in heads])}{of}")
        if rows:
            parts.append(f"query rows {and_list(row_labels(self.tokens, rows))}")
        self.meta["description"] = "Recorded with qkv.tracing; " + "; ".join(parts) + "."
