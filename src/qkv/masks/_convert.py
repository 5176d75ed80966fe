"""Converters between qkv's boolean masks (True = may attend) and other conventions."""

from __future__ import annotations

from typing import Any

from qkv._array import Array, dtype_name, is_bool, library, namespace
from qkv._array import device as array_device


def from_ignore(ignore: Array) -> Array:
    """Convert a True = *ignore* mask (``torch.nn.MultiheadAttention``) to qkv's True = attend.

    Example:
        >>> import numpy as np
        >>> from_ignore(np.array([False, True]))
        array([ True, False])
    """
    if not is_bool(ignore):
        raise TypeError(
            f"from_ignore expects a boolean mask (True = ignore), got {dtype_name(ignore)}. "
            "Hint: for an additive 0/−inf mask use qkv.masks.from_additive."
        )
    xp = namespace([("ignore", ignore)])
    return xp.logical_not(ignore)


def from_additive(additive: Array) -> Array:
    """Convert an additive mask (0 = attend, −inf = ignore) to a boolean True = attend mask.

    Only −inf blocks a key; any finite value (a bias) counts as attend.

    Example:
        >>> import numpy as np
        >>> from_additive(np.array([0.0, -np.inf]))
        array([ True, False])
    """
    xp = namespace([("additive", additive)])
    return xp.logical_not(xp.isinf(additive) & (additive < 0))


def to_additive(mask: Array, dtype: Any = None) -> Array:
    """Convert a True = attend mask to an additive one: 0 where True, −inf where False.

    Example:
        >>> import numpy as np
        >>> to_additive(np.array([True, False]))
        array([  0., -inf])
    """
    if not is_bool(mask):
        raise TypeError(f"to_additive expects a boolean mask, got {dtype_name(mask)}")
    xp = namespace([("mask", mask)])
    dtype = xp.float32 if dtype is None and library(mask) == "torch" else dtype
    dtype = xp.float64 if dtype is None else dtype
    zero = xp.zeros(mask.shape, dtype=dtype, device=array_device(mask))
    return xp.where(
        mask, zero, xp.full(mask.shape, -xp.inf, dtype=dtype, device=array_device(mask))
    )
