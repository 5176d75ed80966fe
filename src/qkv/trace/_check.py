"""The trace file's checks: one-line errors naming the file and the field, and the JSON
encoding of numbers (±inf and NaN as the texts "inf", "-inf", "nan").

Every reader of a trace file goes through these helpers, so a hostile or damaged file gives
one :class:`TraceFileError` line (``trace.json: steps[2].shape: expected ...``), never a
traceback.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from qkv._format import visible

__all__ = ["MAX_META_SIZE", "MAX_TRACE_BYTES", "TRACE_FORMAT", "TRACE_VERSION", "TraceFileError"]

TRACE_FORMAT = "qkv-trace"
TRACE_VERSION = 2
"""The version :meth:`qkv.Trace.save` writes: 2, the steps grouped by attention call.
Version 1 (a flat list of steps) is still read."""

READ_VERSIONS = (1, 2)

MAX_TRACE_BYTES = 1 << 28
"""The most bytes :meth:`Trace.load` reads (256 MiB): a larger file is refused before it is
read. Record fewer layers, heads or queries to save a smaller trace."""

MAX_META_SIZE = 1 << 20
"""The largest head count or width (``num_heads``, ``d_k``, ...) a trace file's meta may
give: 1,048,576, far above any model's."""

WEIGHTS_SLACK = 1e-6
"""How far outside [0, 1] a saved attention weight may lie (the rounding of its dtype)."""


class TraceFileError(ValueError):
    """A saved trace that cannot be read: the file, the field and what was expected.

    The message reads ``"trace.json: steps[2].shape: expected a list of whole numbers, got
    a text 'x'"``; the parts are also attributes. The file's own text (keys, names, the
    file's name) is escaped in the message (:func:`qkv._format.visible`).

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
        super().__init__(visible(": ".join(p for p in (source, self.field, problem) if p)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (self.problem, self.field, self.source))


def _rebuild_error(problem: str, field: str | None, source: str | None) -> TraceFileError:
    return TraceFileError(problem, field=field, source=source)


# -- checking a saved trace, field by field ------------------------------------------------

_DTYPE_KINDS = "biuf"  # bool, signed and unsigned integers, floats
_META_SIZES = ("num_heads", "num_kv_heads", "d_k", "d_v", "d_model")
_LAYER_SIZES = ("num_heads", "num_kv_heads", "head_dim")
_META_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), "a text"),
    "description": ((str,), "a text"),
    "example": ((str,), "a text"),
    "scale_mode": ((str,), "a text"),
    "causal_alignment": ((str,), "a text"),
    "mask": ((str,), "a text"),
    "score_mod": ((str,), "a text"),
    "backend": ((str,), "a text"),
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
    "rows": ((dict,), "an object"),
    "shapes": ((dict,), "an object"),
    "prediction": ((dict,), "an object"),
    "sink": ((dict,), "an object"),
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


def _meta(value: Any, field: str = "meta") -> dict[str, Any]:
    """A trace's (or a call's) ``meta`` object, the type of each known key checked."""
    if value is None:
        return {}
    meta = dict(_expect(value, Mapping, field, "an object"))
    for key, (kinds, what) in _META_TYPES.items():
        if meta.get(key) is not None:
            _expect(meta[key], kinds, f"{field}.{key}", what)
    for i, query in enumerate(meta.get("queries") or []):
        _expect(query, (int, str), f"{field}.queries[{i}]", "a token or a position")
    for i, query in enumerate(meta.get("example_queries") or []):
        _expect(query, int, f"{field}.example_queries[{i}]", "a position")
    for key in _META_SIZES:
        _size(meta.get(key), f"{field}.{key}")
    heads, kv = meta.get("num_heads"), meta.get("num_kv_heads")
    if heads is not None and kv is not None and (kv > heads or heads % kv):
        raise TraceFileError(
            f"expected a number of key/value heads that divides num_heads ({heads}), got {kv}",
            field=f"{field}.num_kv_heads",
        )
    for name, facts in (meta.get("layers") or {}).items():
        where = f"{field}.layers.{name}"
        _expect(facts, Mapping, where, "an object of the layer's facts")
        for key in _LAYER_SIZES:
            if facts.get(key) is not None:
                _expect(facts[key], int, f"{where}.{key}", "a whole number")
                _size(facts[key], f"{where}.{key}")
    return meta


def _size(value: int | None, field: str) -> None:
    """A head count or width of ``meta``: from 1 to :data:`MAX_META_SIZE` (None: absent)."""
    if value is not None and not 1 <= value <= MAX_META_SIZE:
        raise TraceFileError(
            f"expected a whole number from 1 to {MAX_META_SIZE:,}, got {value:,}", field=field
        )


def _probabilities(value: np.ndarray, field: str) -> None:
    """A ``weights`` step's numbers: probabilities, from 0 to 1 (a masked one is 0, never
    NaN: qkv writes a row whose keys are all masked as zeros)."""
    numbers = value.astype(np.float64, copy=False).reshape(-1)
    bad = ~((numbers >= -WEIGHTS_SLACK) & (numbers <= 1 + WEIGHTS_SLACK))  # NaN is bad too
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TraceFileError(
            f"expected attention weights from 0 to 1 (each row of the softmax), got "
            f"{_encode_number(float(numbers[i]))}",
            field=f"{field}[{i}]",
        )


def _token_count(tokens: list[str] | None, key_lengths: set[int]) -> None:
    """``tokens`` label the keys: as many as the keys of one of the calls (a KV-cache
    decoding trace has fewer keys in its earlier calls)."""
    if tokens is not None and key_lengths and len(tokens) not in key_lengths:
        lengths = " or ".join(f"{n:,}" for n in sorted(key_lengths))
        raise TraceFileError(
            f"expected one token per key ({lengths}, as in the steps), got {len(tokens):,}",
            field="tokens",
        )


def _encode(value: np.ndarray) -> Any:
    """A step's numbers as a flat JSON list (booleans as true/false)."""
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
    """``value`` with tuples as lists, NumPy scalars as numbers, ±inf/NaN as texts."""
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
