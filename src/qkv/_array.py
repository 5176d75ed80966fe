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
from typing import Any

import array_api_compat
import numpy as np

Array = Any
"""An array of any supported library (NumPy ndarray or torch.Tensor)."""

_HALF = ("float16", "bfloat16")
_FLOATS = ("float16", "bfloat16", "float32", "float64")


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
        same_place(first_name, first, kind, name, a)
    if kind == "other":
        return array_api_compat.array_namespace(*(a for _, a in given))
    return namespace_of(kind)


def same_place(first_name: str, first: Array, kind: str, name: str, x: Array) -> None:
    """``x`` comes from ``first``'s library ``kind`` (and, for tensors, sits on its device).

    Raises:
        TypeError: another library, naming both arrays.
        ValueError: PyTorch tensors on different devices.
    """
    if library(x) != kind:
        raise TypeError(
            f"{first_name} is a {_kind(first)} but {name} is a {_kind(x)}: all inputs must "
            "come from one library (mixed namespaces). Hint: convert with "
            "torch.as_tensor(...) or tensor.numpy()."
        )
    if kind == "torch" and x.device != first.device:
        raise ValueError(
            f"{first_name} is on device {first.device} but {name} is on {x.device}. "
            f"Hint: move both to one device, e.g. {name}.to({first_name}.device)."
        )


def _kind(a: object) -> str:
    return {"numpy": "NumPy array", "torch": "PyTorch tensor"}.get(library(a), type(a).__name__)


def dtype_name(x: Array) -> str:
    """The short dtype name of an array: ``"float32"``, ``"bool"``, ``"int64"`` ..."""
    return str(x.dtype).removeprefix("torch.")


def is_floating(x: Array) -> bool:
    return dtype_name(x) in _FLOATS


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
    if library(out) != "torch" or library(like) != "torch" or out.ndim != like.ndim:
        return out
    if out.shape == like.shape and out.stride() == like.stride():
        return out  # the usual call: Dv = D and torch laid it out as the query
    ndim = out.ndim
    order = sorted(range(ndim), key=lambda axis: (like.stride(axis), -axis))  # inner first
    if order[0] != ndim - 1:
        order.remove(ndim - 1)
        order.insert(0, ndim - 1)
    strides = [0] * ndim
    step = 1
    for axis in order:
        strides[axis] = step
        step *= int(out.shape[axis])
    if list(out.stride()) == strides:
        return out
    laid_out = out.new_empty_strided(tuple(out.shape), tuple(strides))
    laid_out.copy_(out)
    return laid_out
