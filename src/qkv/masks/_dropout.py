"""The dropout pattern every backend shares: a counter-based hash of the position."""

from __future__ import annotations

from typing import Any

import numpy as np

from qkv._array import Array
from qkv._array import device as array_device
from qkv.masks._rules import Mask

_MASK32 = 0xFFFFFFFF


def _times32(x: Array, constant: int) -> Array:
    """``x · constant`` modulo 2³² for int64 arrays holding 32-bit values, without overflow:
    the constant is taken in two 16-bit halves, so no product exceeds 2⁴⁸ (int64 never wraps,
    and NumPy never warns, on arrays or on 0-d values)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(xp: Any, x: Array) -> Array:
    """A 32-bit integer hash (MurmurHash3's finaliser) on int64 arrays holding 32-bit values.

    Every product is taken modulo 2³² by :func:`_times32`, so NumPy and PyTorch give the same
    bits.
    """
    x = x ^ (x >> 16)
    x = _times32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _times32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def dropout_keep(p: float, seed: int) -> Mask:
    """The dropout pattern shared by every backend: True = the weight is kept.

    Whether weight (b, h, i, j) is kept is a hash of (seed, b, h, i, j) compared with p: a
    counter-based random number, as in FlashAttention. Any block of the pattern can be made
    on its own, so the tiled kernel drops exactly the weights the reference drops, in the
    forward and the backward pass, without storing anything. Each weight is kept with
    probability 1 − p, independently in practice.

    Args:
        p: the dropout probability, 0 ≤ p < 1.
        seed: a 62-bit integer (see ``generator`` of :func:`qkv.scaled_dot_product_attention`).

    Example:
        >>> keep = dropout_keep(0.25, seed=7).dense(64, 64)
        >>> round(float(keep.mean()), 2)
        0.75
    """
    threshold = int(p * 2**32)
    low, high = seed & _MASK32, (seed >> 32) & _MASK32

    def rule(b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        dev = array_device(kv)

        def ints(x: Any) -> Array:
            return xp.astype(xp.asarray(x, device=dev), xp.int64)

        head = _mix32(xp, (ints(b) * 0x9E3779B1 + ints(h) * 0x7FEB352D + high) & _MASK32)
        row = _mix32(xp, (head ^ ((ints(q) * 0x2545F491 + low) & _MASK32)))
        column = (ints(kv) * 0x846CA68B) & _MASK32
        return _mix32(xp, row ^ column) >= threshold

    return Mask(rule, f"dropout_keep(p={p}, seed={seed})")


def draw_seed(generator: Any, *, torch_inputs: bool) -> int:
    """The dropout seed of one call, drawn from ``generator``.

    An int is the seed itself; a ``torch.Generator`` or ``numpy.random.Generator`` gives one
    draw (so it advances, and the next call drops differently); None draws from torch's
    global generator (for tensors) or from fresh entropy (NumPy).
    """
    if isinstance(generator, int) and not isinstance(generator, bool):
        return generator & (2**62 - 1)
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, 2**62))
    if generator is None and not torch_inputs:
        return int(np.random.default_rng().integers(0, 2**62))
    if generator is None or type(generator).__name__ == "Generator":
        import torch

        device = getattr(generator, "device", "cpu")
        return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())
    raise TypeError(
        f"generator must be an int seed, a numpy.random.Generator, a torch.Generator or None, "
        f"got {type(generator).__name__}. Hint: generator=0 makes dropout reproducible."
    )
