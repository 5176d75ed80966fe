"""Attention masks: which keys each query may attend. Boolean, **True = may attend**.

A :class:`Mask` is a rule ``mask_mod(b, h, q_idx, kv_idx) -> bool`` evaluated on broadcast index
arrays, so it costs nothing until attention needs it and works for any sequence length. Masks
combine with ``&`` (both allow), ``|`` (either allows) and ``~`` (the opposite)::

    causal() & key_padding([3, 5])      # causal, and never the padding after each length

Any boolean array works as a mask as well. Masks from other conventions convert with
:func:`from_ignore` (``torch.nn.MultiheadAttention``'s True = ignore) and :func:`from_additive`
(0 / −inf additive masks); :func:`to_additive` goes the other way.

Causal alignment matters when the query and key lengths differ (Lq ≠ Lk):

- ``"top-left"``: query i sees keys 0 … i (PyTorch's ``is_causal``);
- ``"bottom-right"``: the last query sees every key, query i sees keys 0 … i + (Lk − Lq); this
  is the one for decoding with a KV cache, where the new queries are the last positions.

Example:
    >>> from qkv import masks
    >>> m = masks.causal() & masks.key_padding([2])
    >>> m
    causal('top-left') & key_padding([2])
    >>> m.dense(3, 3).astype(int)[0, 0]
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 0]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from qkv._array import Array, dtype_name, is_bool, library, namespace, shape_str, to_numpy
from qkv._array import device as array_device

__all__ = [
    "ALIGNMENTS",
    "Mask",
    "causal",
    "from_additive",
    "from_function",
    "from_ignore",
    "full",
    "key_padding",
    "sliding_window",
    "to_additive",
]

Alignment = Literal["top-left", "bottom-right"]
ALIGNMENTS: tuple[str, ...] = ("top-left", "bottom-right")

# The rule behind a mask: (b, h, q_idx, kv_idx, q_len, kv_len, xp) -> bool array.
# b, h, q_idx, kv_idx are integer arrays that broadcast against each other.
Rule = Callable[[Array, Array, Array, Array, int, int, Any], Array]


class Mask:
    """A boolean mask given by a rule on positions; True = the query may attend the key.

    Build masks with :func:`causal`, :func:`key_padding`, :func:`sliding_window`, :func:`full`
    or :func:`from_function`, and combine them with ``&``, ``|``, ``~``.
    """

    def __init__(self, rule: Rule, description: str, op: str | None = None) -> None:
        self._rule = rule
        self._description = description
        self._op = op  # "&" or "|" for a combination, None for a single rule

    def __repr__(self) -> str:
        return self._description

    def __call__(
        self, b: Array, h: Array, q_idx: Array, kv_idx: Array, q_len: int, kv_len: int, xp: Any
    ) -> Array:
        """Evaluate the rule on broadcast index arrays of namespace ``xp``."""
        return self._rule(b, h, q_idx, kv_idx, q_len, kv_len, xp)

    def __and__(self, other: Mask) -> Mask:
        _check_mask(other, "&")
        text = f"{_group(self, '&')} & {_group(other, '&')}"
        return Mask(lambda *a: self(*a) & other(*a), text, "&")

    def __or__(self, other: Mask) -> Mask:
        _check_mask(other, "|")
        text = f"{_group(self, '|')} | {_group(other, '|')}"
        return Mask(lambda *a: self(*a) | other(*a), text, "|")

    def __invert__(self) -> Mask:
        return Mask(lambda *a: ~self(*a), f"~{_group(self, '~')}")

    def dense(
        self,
        q_len: int,
        kv_len: int,
        *,
        batch: int = 1,
        heads: int = 1,
        xp: Any = None,
        device: Any = None,
    ) -> Array:
        """The mask as a boolean array of shape (batch, heads, q_len, kv_len).

        Args:
            q_len, kv_len: Lq and Lk.
            batch, heads: B and H (the rule sees b in range(B), h in range(H)).
            xp: the array namespace (NumPy by default), e.g. ``array_api_compat.torch``.
            device: where to build it (for PyTorch).
        """
        if xp is None:
            xp = np
        b = xp.reshape(xp.arange(batch, device=device), (batch, 1, 1, 1))
        h = xp.reshape(xp.arange(heads, device=device), (1, heads, 1, 1))
        q = xp.reshape(xp.arange(q_len, device=device), (1, 1, q_len, 1))
        kv = xp.reshape(xp.arange(kv_len, device=device), (1, 1, 1, kv_len))
        out = self(b, h, q, kv, q_len, kv_len, xp)
        return xp.broadcast_to(xp.asarray(out, dtype=xp.bool), (batch, heads, q_len, kv_len))


def _check_mask(other: object, op: str) -> None:
    if not isinstance(other, Mask):
        raise TypeError(
            f"a Mask combines with {op} only with another Mask, got {type(other).__name__}. "
            "Hint: wrap a boolean array with qkv.masks.from_function or combine dense arrays "
            "directly."
        )


def _group(mask: Mask, op: str) -> str:
    """The repr of ``mask`` as an operand of ``op``, in parentheses where precedence needs it."""
    return repr(mask) if mask._op in (None, op) else f"({mask!r})"


def check_alignment(alignment: str) -> None:
    if alignment not in ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be 'top-left' or 'bottom-right', got {alignment!r}. "
            "Hint: 'bottom-right' is the one for decoding with a KV cache (Lq < Lk)."
        )


def _offset(alignment: str, q_len: int, kv_len: int) -> int:
    """How far the diagonal is shifted right: 0 for top-left, Lk − Lq for bottom-right."""
    return kv_len - q_len if alignment == "bottom-right" else 0


def full() -> Mask:
    """Every query may attend every key (the mask that masks nothing)."""
    return Mask(lambda b, h, q, kv, lq, lk, xp: (q >= 0) & (kv >= 0), "full()")


def causal(alignment: Alignment = "top-left") -> Mask:
    """Query i may attend key j only when j ≤ i (+ Lk − Lq with ``"bottom-right"``).

    Example:
        >>> causal("bottom-right").dense(2, 4)[0, 0].astype(int)
        array([[1, 1, 1, 0],
               [1, 1, 1, 1]])
    """
    check_alignment(alignment)
    return Mask(
        lambda b, h, q, kv, lq, lk, xp: kv <= q + _offset(alignment, lq, lk),
        f"causal({alignment!r})",
    )


def sliding_window(before: int, after: int = 0, *, alignment: Alignment = "top-left") -> Mask:
    """Local attention: query i sees keys i − before … i + after (after causal alignment).

    ``sliding_window(w - 1)`` is the causal window of size w used by Mistral-style models.

    Example:
        >>> sliding_window(1).dense(4, 4)[0, 0].astype(int)
        array([[1, 0, 0, 0],
               [1, 1, 0, 0],
               [0, 1, 1, 0],
               [0, 0, 1, 1]])
    """
    for name, value in (("before", before), ("after", after)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"sliding_window: {name} must be an integer ≥ 0, got {value!r}. "
                "Hint: before=3 lets each query see itself and the 3 keys before it."
            )
    check_alignment(alignment)

    def rule(b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        centre = q + _offset(alignment, lq, lk)
        return (kv >= centre - before) & (kv <= centre + after)

    return Mask(rule, f"sliding_window({before}, {after}, alignment={alignment!r})")


def key_padding(lengths: Sequence[int] | Array) -> Mask:
    """Batch element b attends only its first ``lengths[b]`` keys; the rest is padding.

    Args:
        lengths: (B,) integers, the true length of each sequence in the batch.

    Example:
        >>> key_padding([1, 3]).dense(1, 3, batch=2)[:, 0, 0].astype(int)
        array([[1, 0, 0],
               [1, 1, 1]])
    """
    values = np.asarray(to_numpy(lengths) if library(lengths) == "torch" else lengths)
    if values.ndim != 1 or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"key_padding: lengths must be a non-empty 1-D sequence of integers (one per batch "
            f"element), got {values.dtype} of shape {shape_str(values.shape)}. "
            "Hint: key_padding([3, 5]) for a batch of two sequences of lengths 3 and 5."
        )
    if (values < 0).any():
        raise ValueError(f"key_padding: lengths must be ≥ 0, got {values.tolist()}")
    listed = values.tolist()

    def rule(b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        if int(b.shape[0] if b.ndim else 1) > len(listed):
            raise ValueError(
                f"key_padding has {len(listed)} lengths but the batch has {b.shape[0]} "
                "elements. Hint: give one length per batch element."
            )
        table = xp.asarray(listed, device=array_device(kv))
        return kv < table[b]

    return Mask(rule, f"key_padding({listed})")


def from_function(mask_mod: Callable[[Array, Array, Array, Array], Array], name: str = "") -> Mask:
    """A mask from your own rule ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    The rule receives integer index arrays that broadcast against each other, and must use
    only elementwise operations (comparisons, ``&``, ``|``, arithmetic).

    Example:
        >>> even_keys = from_function(lambda b, h, q, kv: kv % 2 == 0, "even keys")
        >>> even_keys.dense(1, 4)[0, 0, 0].astype(int)
        array([1, 0, 1, 0])
    """
    label = name or getattr(mask_mod, "__name__", "mask_mod")
    return Mask(lambda b, h, q, kv, lq, lk, xp: mask_mod(b, h, q, kv), f"from_function({label})")


def from_ignore(ignore: Array) -> Array:
    """Convert a True = *ignore* mask (``torch.nn.MultiheadAttention``) to qkv's True = attend.

    Example:
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
        >>> from_additive(np.array([0.0, -np.inf]))
        array([ True, False])
    """
    xp = namespace([("additive", additive)])
    return xp.logical_not(xp.isinf(additive) & (additive < 0))


def to_additive(mask: Array, dtype: Any = None) -> Array:
    """Convert a True = attend mask to an additive one: 0 where True, −inf where False.

    Example:
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
