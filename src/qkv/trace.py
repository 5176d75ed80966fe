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

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qkv._array import Array, to_numpy

__all__ = ["STEP_NAMES", "Step", "Trace", "current_trace", "tracing"]

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
    """

    name: str
    value: np.ndarray
    formula: str
    description: str
    axes: tuple[str, ...]
    layer: str | None = None

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
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Step:
        dtype = np.dtype(data.get("dtype", "float64"))
        value = np.asarray(_decode(data["value"]), dtype=dtype).reshape(data["shape"])
        return cls(
            name=data["name"],
            value=value,
            formula=data.get("formula", ""),
            description=data.get("description", ""),
            axes=tuple(data["axes"]),
            layer=data.get("layer"),
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
            positions to show).

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
        """Append a step; ``value`` is copied to a NumPy array on the CPU."""
        if name not in STEP_NAMES:
            raise ValueError(f"unknown step name {name!r}; expected one of {STEP_NAMES}")
        step = Step(name, to_numpy(value), formula, description, tuple(axes), layer)
        self.steps.append(step)

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

    # -- serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "tokens": self.tokens,
            "query_tokens": self.query_tokens,
            "meta": _jsonable(self.meta),
            "steps": [step.to_dict() for step in self.steps],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        if data.get("format") != TRACE_FORMAT:
            raise ValueError(
                f"not a qkv trace: 'format' is {data.get('format')!r}, expected {TRACE_FORMAT!r}"
            )
        if data.get("version") != TRACE_VERSION:
            raise ValueError(
                f"unsupported trace version {data.get('version')!r}; "
                f"this qkv reads version {TRACE_VERSION}"
            )
        return cls(
            steps=[Step.from_dict(s) for s in data["steps"]],
            tokens=data.get("tokens"),
            query_tokens=data.get("query_tokens"),
            meta=dict(data.get("meta") or {}),
        )

    def to_json(self, *, indent: int | None = None) -> str:
        """The trace as JSON; ±inf and NaN are written as the strings "inf", "-inf", "nan"."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Trace:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON, atomically (a failed write leaves no partial file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(self.to_json(), encoding="utf-8")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


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
def tracing(trace: Trace | None = None) -> Iterator[Trace]:
    """Record every attention call inside the block into one trace.

    Args:
        trace: the trace to append to; a new one by default.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.scaled_dot_product_attention(np.ones((2, 4)), np.ones((3, 4)),
        ...                                          np.ones((3, 4)))
        >>> t["weights"].shape
        (2, 3)
    """
    trace = Trace() if trace is None else trace
    token = _current.set(trace)
    try:
        yield trace
    finally:
        _current.reset(token)


def resolve(trace: Trace | None) -> Trace | None:
    """The trace to record into: the one given, else the enclosing :func:`tracing` block's."""
    return trace if trace is not None else _current.get()
