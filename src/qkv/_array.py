"""Array namespace helpers and the dtype policy.

qkv computes with whatever library the inputs come from: NumPy arrays stay NumPy, PyTorch
tensors stay PyTorch (same device, same dtype), through the array API standard as bridged by
``array-api-compat``. Nothing here imports PyTorch: a tensor is recognised without it.

Dtype policy:

- inputs must be floating point (float16, bfloat16, float32, float64);
- float16 and bfloat16 are computed in float32 and the results cast back;
- Python lists and scalars are taken as NumPy float64.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

Array = Any
"""An array of any supported library (NumPy ndarray or torch.Tensor)."""

_HALF = ("float16", "bfloat16")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""The floating-point dtypes qkv computes with, by their short names."""


def library(x: object) -> str:
    """The name of the library an array comes from: ``"numpy"``, ``"torch"`` or ``"other"``.

    Two ``isinstance`` checks (a tensor exists only once torch is imported), which
    ``torch.compile`` traces without a graph break.
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    return "other"


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the running code (False without torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.compiler.is_compiling())


def namespace_of(name: str) -> Any:
    """The array API namespace of a library named by :func:`library` (``"numpy"`` or
    ``"torch"``), without looking at an array."""
    if name == "torch":
        import array_api_compat.torch as torch_xp

        return torch_xp
    import array_api_compat.numpy as numpy_xp

    return numpy_xp


def as_array(x: object, name: str) -> Array:
    """Return ``x`` unchanged if it is a NumPy array or a tensor; lists become float64 arrays.

    Raises:
        TypeError: ``x`` is something else (a string, a dict, ...), with its type named.
    """
    if library(x) != "other" or array_api_compat.is_array_api_obj(x):
        return x
    if isinstance(x, list | tuple | int | float):
        try:
            return np.asarray(x, dtype=np.float64)
        except ValueError as error:
            raise ValueError(
                f"{name} must be a rectangular array of numbers; could not read the list "
                f"({error}). Hint: every row must have the same length."
            ) from None
    raise TypeError(
        f"{name} must be a NumPy array or a PyTorch tensor, got {type(x).__name__}. "
        f"Hint: wrap it with numpy.asarray({name})."
    )


def namespace(arrays: Sequence[tuple[str, Array | None]]) -> Any:
    """The array API namespace shared by named arrays (``None`` entries are skipped).

    Raises:
        TypeError: the arrays come from different libraries, naming the first two that differ.
        ValueError: PyTorch tensors on different devices.
    """
    given = [(name, a) for name, a in arrays if a is not None]
    first_name, first = given[0]
    kind = library(first)
    for name, a in given[1:]:
        same_place(first_name, kind, getattr(first, "device", None), name, a)
    if kind == "other":
        return array_api_compat.array_namespace(*(a for _, a in given))
    return namespace_of(kind)


def same_place(first_name: str, kind: str, device: Any, name: str, x: Array) -> None:
    """``x`` comes from the library ``kind`` of the array ``first_name`` (and, for tensors,
    sits on its ``device``).

    Raises:
        TypeError: another library, naming both arrays.
        ValueError: PyTorch tensors on different devices.
    """
    if library(x) != kind:
        raise TypeError(
            f"{first_name} is a {_KINDS.get(kind, kind)} but {name} is a {_kind(x)}: all "
            "inputs must come from one library (mixed namespaces). Hint: convert with "
            "torch.as_tensor(...) or tensor.numpy()."
        )
    if kind == "torch" and x.device != device:
        raise ValueError(
            f"{first_name} is on device {device} but {name} is on {x.device}. "
            f"Hint: move both to one device, e.g. {name}.to({first_name}.device)."
        )


_KINDS = {"numpy": "NumPy array", "torch": "PyTorch tensor"}


def _kind(a: object) -> str:
    return _KINDS.get(library(a), type(a).__name__)


def dtype_name(x: Array) -> str:
    """The short dtype name of an array: ``"float32"``, ``"bool"``, ``"int64"`` ..."""
    return str(x.dtype).removeprefix("torch.")


def is_floating(x: Array) -> bool:
    return dtype_name(x) in FLOAT_DTYPES


def is_bool(x: Array) -> bool:
    return dtype_name(x) == "bool"


def compute_dtype(xp: Any, x: Array) -> Any:
    """The dtype the math runs in: float32 for half-precision inputs, else the input's own."""
    return xp.float32 if dtype_name(x) in _HALF else x.dtype


def is_torch_namespace(xp: Any) -> bool:
    """Whether ``xp`` is PyTorch's namespace (``torch`` or ``array_api_compat.torch``)."""
    return getattr(xp, "__name__", "") in ("torch", "array_api_compat.torch")


def device(x: Array) -> Any:
    """The device an array lives on (``"cpu"`` for NumPy)."""
    return x.device if library(x) == "torch" else array_api_compat.device(x)


def to_numpy(x: Array) -> np.ndarray:
    """A NumPy copy of any array (a tensor is detached and moved to the CPU first).

    bfloat16 has no NumPy dtype and comes back as float32.
    """
    if library(x) == "torch":
        t = x.detach().to("cpu")
        if dtype_name(t) == "bfloat16":
            t = t.float()
        return np.array(t.numpy(), copy=True)
    return np.array(x, copy=True)


def shape_str(shape: Sequence[int]) -> str:
    """``(2, 3)`` for a shape, ``()`` for a scalar: how shapes appear in messages."""
    return "(" + ", ".join(str(int(n)) for n in shape) + ("," if len(shape) == 1 else "") + ")"


class DtypeMismatchError(TypeError, ValueError):
    """Inputs that must share one dtype (query, key and value) do not.

    Both a ``TypeError`` (qkv's convention for a wrong dtype) and a ``ValueError`` (what
    ``torch.nn.attention.flex_attention`` raises for the same mistake, and what its tests
    expect), so that code written against either catches it, as NumPy's ``AxisError`` is
    both a ``ValueError`` and an ``IndexError``.
    """


def check_scale(scale: object) -> None:
    """``scale`` is None (meaning 1/√d_k) or a finite real number; NaN or ±inf would make
    every score, and so every output, NaN."""
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale)
    ):
        raise TypeError(
            f"scale must be a finite number or None (meaning 1/√d_k), got {scale!r}. "
            "Hint: scale=1.0 means no scaling."
        )


def like_layout(out: Array, like: Array) -> Array:
    """``out`` laid out in memory as ``like`` is: the same order of axes by stride, as
    PyTorch's SDPA and flex_attention lay out their output after the query. A copy only
    when the layouts differ; NumPy arrays come back as they are.

    A query ``x.view(B, L, H, D).transpose(1, 2)`` gives an output that
    ``.transpose(1, 2).view(B, L, H * D)`` takes without a copy. Axes of equal stride keep
    their order as torch orders them (the later axis inner); the last axis stays innermost.

    Example:
        >>> import torch
        >>> query = torch.zeros(2, 5, 3, 4).transpose(1, 2)         # (B, H, L, D), L outer
        >>> like_layout(torch.ones(2, 3, 5, 4), query).stride()
        (60, 4, 12, 1)
    """
    if library(like) != "torch":
        return out
    return with_layout(out, like.stride())


def with_layout(out: Array, strides: tuple[int, ...] | None) -> Array:
    """``out`` laid out in memory with its axes in the order of ``strides`` (a query's, as
    :func:`like_layout` says); a copy only when its layout differs. ``None``, or an array
    of another library or rank: ``out`` as it is."""
    if strides is None or library(out) != "torch" or out.ndim != len(strides):
        return out
    if out.stride() == strides:
        return out  # the usual call: Dv = D and torch laid it out as the query
    ndim = out.ndim
    order = sorted(range(ndim), key=lambda axis: (strides[axis], -axis))  # inner first
    if order[0] != ndim - 1:
        order.remove(ndim - 1)
        order.insert(0, ndim - 1)
    wanted = [0] * ndim
    step = 1
    for axis in order:
        wanted[axis] = step
        step *= int(out.shape[axis])
    if list(out.stride()) == wanted:
        return out
    laid_out = out.new_empty_strided(tuple(out.shape), tuple(wanted))
    laid_out.copy_(out)
    return laid_out


class Inputs(NamedTuple):
    """Query, key and value as arrays of one library, looked at once: what the checks and
    the backends of an attention call read about them (:func:`inputs`)."""

    library: str
    """``"numpy"`` or ``"torch"`` (or ``"other"`` for another array API library)."""
    xp: Any
    """Their array API namespace."""
    query: Array
    key: Array
    value: Array
    dtypes: tuple[str, str, str]
    """The short dtype names of query, key and value."""
    device: Any
    """The query's device (``"cpu"`` for NumPy)."""
    strides: tuple[int, ...] | None
    """The query's strides for a tensor, else None: the layout of the output
    (:func:`with_layout`)."""


def inputs(query: object, key: object, value: object) -> Inputs:
    """Query, key and value as arrays of one library on one device: the one look at them
    an attention call takes (lists become float64 NumPy arrays).

    Raises:
        TypeError: something that is no array, or arrays of two libraries, naming them.
        ValueError: tensors on two devices.

    Example:
        >>> import numpy as np
        >>> found = inputs(np.ones((2, 4)), [[1.0] * 4], np.ones((1, 3), np.float32))
        >>> found.library, found.dtypes
        ('numpy', ('float64', 'float64', 'float32'))
    """
    kind = library(query)
    if kind == "other" or library(key) != kind or library(value) != kind:
        query, key, value = (
            as_array(a, n) for a, n in ((query, "query"), (key, "key"), (value, "value"))
        )
        kind = library(query)
        where = getattr(query, "device", None)
        same_place("query", kind, where, "key", key)
        same_place("query", kind, where, "value", value)
    elif kind == "torch" and not (key.device == query.device == value.device):  # type: ignore[attr-defined]
        same_place("query", kind, query.device, "key", key)  # type: ignore[attr-defined]
        same_place("query", kind, query.device, "value", value)  # type: ignore[attr-defined]
    if kind == "torch":
        return Inputs(
            kind,
            namespace_of(kind),
            query,
            key,
            value,
            tuple(str(x.dtype).removeprefix("torch.") for x in (query, key, value)),  # type: ignore[arg-type, attr-defined]
            query.device,  # type: ignore[attr-defined]
            query.stride(),  # type: ignore[attr-defined]
        )
    xp = namespace([("query", query)]) if kind == "other" else namespace_of(kind)
    names = tuple(str(x.dtype) for x in (query, key, value))  # type: ignore[attr-defined]
    return Inputs(kind, xp, query, key, value, names, array_api_compat.device(query), None)  # type: ignore[arg-type]
