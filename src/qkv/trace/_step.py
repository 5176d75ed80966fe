"""One recorded step: a named value with its formula and the meaning of each axis."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkv.steps import STEP_NAMES
from qkv.trace._check import (
    TraceFileError,
    _dtype,
    _encode,
    _expect,
    _optional_text,
    _probabilities,
    _required,
    _shape,
    _short,
    _texts,
    _values,
    _whole_numbers,
)

__all__ = ["STEP_NAMES", "Step", "Steps"]


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
        call: the position of the attention call that recorded it among its trace's call
            records (:attr:`qkv.Trace.calls`); None for a step added by hand, which joins
            a call by the order of the steps.
    """

    name: str
    value: np.ndarray
    formula: str
    description: str
    axes: tuple[str, ...]
    layer: str | None = None
    index: dict[str, list[int]] | None = None
    call: int | None = field(default=None, compare=False)

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
        """The step as JSON-able data (its numbers as a flat list)."""
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
        if name == "weights":
            _probabilities(value, f"{field}.value")
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


class Steps:
    """Steps read by name: what a :class:`~qkv.trace.Trace` and one call of it share.

    A subclass holds ``steps`` and names itself in :meth:`_where` (for the KeyError).
    """

    steps: Sequence[Step]

    def _where(self) -> str:
        return "this trace"

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __contains__(self, name: object) -> bool:
        return any(step.name == name for step in self.steps)

    def __getitem__(self, name: str) -> Step:
        """The last step recorded under ``name``."""
        step = self.get(name)
        if step is None:
            recorded = ", ".join(dict.fromkeys(s.name for s in self.steps)) or "none"
            raise KeyError(f"no step named {name!r} in {self._where()} (recorded: {recorded})")
        return step

    def get(self, name: str) -> Step | None:
        """The last step recorded under ``name``, or None."""
        return next((step for step in reversed(self.steps) if step.name == name), None)

    @property
    def names(self) -> list[str]:
        """The names of the recorded steps, in order."""
        return [step.name for step in self.steps]
