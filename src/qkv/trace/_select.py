"""What a trace records: the checks of ``qkv.tracing``'s selections, and the slicing of a
value to the selected heads and query rows (in the value's own array library)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import array_api_compat
import numpy as np

from qkv._array import Array, library
from qkv.steps import STEP_NAMES

__all__ = [
    "PARAMETER_STEPS",
    "RecordingState",
    "and_list",
    "int_selection",
    "layer_selection",
    "row_labels",
    "step_selection",
    "take",
]

PARAMETER_STEPS = ("W_q", "W_k", "W_v", "W_o")
"""A module's weight matrices: recorded only when named in ``steps``."""


def int_selection(value: object, name: str, hint: str) -> tuple[int, ...]:
    """``heads=`` or ``queries=``: an integer or a non-empty list of them."""
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


def layer_selection(value: object) -> tuple[str | int, ...]:
    """``layers=``: a module path, a pattern, a position, or a non-empty list of them."""
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


def step_selection(value: object) -> tuple[str, ...]:
    """``steps=``: a step name or a non-empty list of them."""
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


def take(value: Array, rows: list[int], axis: int) -> Array:
    """The entries ``rows`` of ``axis`` (a copy), in the array's own library."""
    if library(value) == "numpy":
        return np.take(value, rows, axis=axis)
    xp = array_api_compat.array_namespace(value)
    indices = xp.asarray(rows, dtype=xp.int64, device=array_api_compat.device(value))
    return xp.take(value, indices, axis=axis)


def row_labels(tokens: Sequence[str] | None, rows: Sequence[int]) -> list[str]:
    """Query rows named as the tables name them: the token (``the#4`` when it repeats or is
    empty), or ``t4`` without tokens."""
    if tokens is None:
        return [f"t{i}" for i in rows]
    labels = []
    for i in rows:
        token = tokens[i] if i < len(tokens) else None
        if token is None:
            labels.append(f"t{i}")
        elif not token or tokens.count(token) > 1:
            labels.append(f"{token}#{i}")
        else:
            labels.append(token)
    return labels


def and_list(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@dataclass
class RecordingState:
    """What a trace keeps while recording: not data, not saved."""

    layer: str | None = None  # the module recording now
    call_heads: int | None = None  # query heads of the call being recorded (for kv_head)
    paths: dict[int, str] = field(default_factory=dict)  # id(module) -> path
    order: list[str] = field(default_factory=list)  # module paths, in model (or call) order
    from_model: bool = False
    unnamed: int = 0
    query_rows: list[int] | None = None  # the query rows kept, while every call agrees
    queries_differ: bool = False
    open: int | None = None  # the call record steps join now (in Trace._calls)
    core: str = "none"  # the attention core in the open call: "none", "running", "done"
    explicit: bool = False  # the open call was opened by a module (in_layer)
    names: set[str] = field(default_factory=set)  # step names of the open call

    def note_queries(self, rows: list[int]) -> None:
        if self.query_rows is None and not self.queries_differ:
            self.query_rows = rows
        elif self.query_rows != rows:
            self.query_rows, self.queries_differ = None, True
