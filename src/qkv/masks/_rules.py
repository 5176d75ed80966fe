"""The Mask class: a rule on positions, its combinations, its dense form and block structure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from qkv._array import Array

Alignment = Literal["top-left", "bottom-right"]
ALIGNMENTS: tuple[str, ...] = ("top-left", "bottom-right")

# The rule behind a mask: (b, h, q_idx, kv_idx, q_len, kv_len, xp) -> bool array.
# b, h, q_idx, kv_idx are integer arrays that broadcast against each other.
Rule = Callable[[Array, Array, Array, Array, int, int, Any], Array]

# The block structure of a mask: (b, h, q_start, q_end, kv_start, kv_end, q_len, kv_len)
# -> (some, every), NumPy bool arrays that broadcast like (B, H, nq, nk). The arguments are
# NumPy integer arrays shaped (B, 1, 1, 1), (1, H, 1, 1), (1, 1, nq, 1) twice and
# (1, 1, 1, nk) twice; the ends are exclusive. ``some`` False promises that the block holds no
# allowed pair; ``every`` True promises that every pair of the block is allowed.
BlockRule = Callable[..., tuple[np.ndarray, np.ndarray]]

EMPTY, PARTIAL, FULL = 0, 1, 2
"""The kinds of blocks :meth:`Mask.blocks` reports."""


class RuleCache(dict[Any, Any]):
    """A dictionary a rule keeps as its own cache (tables per device, combinations made):
    what it holds never changes what the rule computes, so FlexAttention's block-mask cache
    (:func:`qkv.kernels._flex_masks.fingerprint`) leaves it out of the rule's key, where any
    other dictionary a rule closes over counts by its content."""


class Mask:
    """A boolean mask given by a rule on positions; True = the query may attend the key.

    Build masks with :func:`causal`, :func:`key_padding`, :func:`sliding_window`,
    :func:`document`, :func:`prefix_lm`, :func:`full` or :func:`from_function`, and combine
    them with ``&``, ``|``, ``~``.

    Args:
        rule: ``(b, h, q_idx, kv_idx, q_len, kv_len, xp) -> bool array``.
        description: the repr, e.g. ``"causal('top-left')"``.
        op: ``"&"`` or ``"|"`` for a combination (for parentheses in the repr), else None.
        blocks: the block structure (see :meth:`blocks`), or None when unknown.
        per_batch: for a rule made for a given batch size (one length per batch element):
            ``(what it holds, how many)`` pairs, e.g. ``(("key_padding", "3 lengths", 3),)``;
            :meth:`check_batch` refuses any other batch.
        causal: for :func:`causal` only: its alignment (see :attr:`causal_alignment`).
        pure: the rule reads only values qkv copied when it was made (the built-in rules
            and their combinations), so it never changes (see :attr:`pure`).
    """

    def __init__(
        self,
        rule: Rule,
        description: str,
        op: str | None = None,
        *,
        blocks: BlockRule | None = None,
        per_batch: tuple[tuple[str, str, int], ...] = (),
        causal: str | None = None,
        pure: bool = False,
    ) -> None:
        self._rule = rule
        self._causal = causal  # the alignment when this is exactly causal(alignment)
        self._pure = pure  # reads only what qkv copied when it was made: never changes
        self._description = description
        self._op = op  # "&" or "|" for a combination, None for a single rule
        self._blocks = blocks
        self._per_batch = per_batch
        self._combined = RuleCache()  # (op, id(other)) -> (other, the combination)

    def __repr__(self) -> str:
        return self._description

    def __call__(
        self, b: Array, h: Array, q_idx: Array, kv_idx: Array, q_len: int, kv_len: int, xp: Any
    ) -> Array:
        """Evaluate the rule on broadcast index arrays of namespace ``xp``."""
        return self._rule(b, h, q_idx, kv_idx, q_len, kv_len, xp)

    @property
    def per_batch(self) -> tuple[tuple[str, str, int], ...]:
        """The parts made for a given batch size: ``(name, what it holds, how many)``."""
        return self._per_batch

    def check_batch(self, batch: int) -> None:
        """Refuse a batch of another size than a per-batch part was made for (one length
        per batch element): a longer list would be cut silently, a shorter one run out.

        Example:
            >>> from qkv.masks import key_padding
            >>> try:
            ...     key_padding([3, 4, 5]).check_batch(2)
            ... except ValueError as error:
            ...     print(str(error).split(". ")[0])
            key_padding has 3 lengths but the batch has 2 elements
        """
        for name, held, count in self._per_batch:
            if count != batch:
                raise ValueError(
                    f"{name} has {held} but the batch has {batch} element"
                    f"{'' if batch == 1 else 's'}. Hint: give {name} one entry per batch "
                    f"element ({batch})."
                )

    @property
    def causal_alignment(self) -> str | None:
        """The alignment when this mask is exactly ``causal(alignment)`` (a fused kernel's
        own causal mode can run it, with no mask array), else None.

        Example:
            >>> from qkv.masks import causal, key_padding
            >>> causal().causal_alignment, (causal() & key_padding([2])).causal_alignment
            ('top-left', None)
        """
        return self._causal

    @property
    def pure(self) -> bool:
        """Whether the rule reads only values qkv copied when it was made (built-in rules
        and their combinations): it never changes, so caches may key it by identity. A
        rule from :func:`from_function` may read a dictionary or a global that changes.

        Example:
            >>> from qkv.masks import causal, from_function
            >>> causal().pure, from_function(lambda b, h, q, kv: q >= kv, "mine").pure
            (True, False)
        """
        return self._pure

    @property
    def knows_blocks(self) -> bool:
        """Whether the mask knows its block structure without evaluating elements."""
        return self._blocks is not None

    def combined(self, op: str, other: Mask) -> Mask:
        """``self & other`` or ``self | other`` (``op``), the same object on every call with
        the same ``other``: the tiled kernel keeps its block plans per mask object.

        Example:
            >>> from qkv.masks import causal, key_padding
            >>> padding, rule = key_padding([3]), causal()
            >>> padding.combined("&", rule) is padding.combined("&", rule)
            True
        """
        if op not in ("&", "|"):
            raise ValueError(f"Mask.combined: op must be '&' or '|', got {op!r}.")
        found = self._combined.get((op, id(other)))
        if found is not None and found[0] is other:
            kept: Mask = found[1]
            return kept
        made = self & other if op == "&" else self | other
        self._combined[(op, id(other))] = (other, made)  # holds other: its id stays its own
        return made

    def __and__(self, other: Mask) -> Mask:
        _check_mask(other, "&")
        text = f"{_group(self, '&')} & {_group(other, '&')}"

        def blocks(*a: Any) -> tuple[np.ndarray, np.ndarray]:
            (some_a, every_a), (some_b, every_b) = self._block_pair(*a), other._block_pair(*a)
            return some_a & some_b, every_a & every_b

        parts = self._per_batch + other._per_batch
        pure = self._pure and other._pure
        return Mask(
            lambda *a: self(*a) & other(*a), text, "&", blocks=blocks, per_batch=parts, pure=pure
        )

    def __or__(self, other: Mask) -> Mask:
        _check_mask(other, "|")
        text = f"{_group(self, '|')} | {_group(other, '|')}"

        def blocks(*a: Any) -> tuple[np.ndarray, np.ndarray]:
            (some_a, every_a), (some_b, every_b) = self._block_pair(*a), other._block_pair(*a)
            return some_a | some_b, every_a | every_b

        parts = self._per_batch + other._per_batch
        pure = self._pure and other._pure
        return Mask(
            lambda *a: self(*a) | other(*a), text, "|", blocks=blocks, per_batch=parts, pure=pure
        )

    def __invert__(self) -> Mask:
        def blocks(*a: Any) -> tuple[np.ndarray, np.ndarray]:
            some, every = self._block_pair(*a)
            return ~every, ~some

        text = f"~{_group(self, '~')}"
        return Mask(
            lambda *a: ~self(*a), text, blocks=blocks, per_batch=self._per_batch, pure=self._pure
        )

    def block_bounds(
        self,
        b: Any,
        h: Any,
        q_start: Any,
        q_end: Any,
        kv_start: Any,
        kv_end: Any,
        q_len: int,
        kv_len: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(some, every) for blocks of any ranges (ends exclusive, broadcast NumPy integer
        arrays): may a pair in the block be allowed, is every pair allowed. Unknown
        structure: maybe some, not every. :meth:`blocks` is this on a regular grid."""
        return self._block_pair(b, h, q_start, q_end, kv_start, kv_end, q_len, kv_len)

    def _block_pair(self, *a: Any) -> tuple[np.ndarray, np.ndarray]:
        """(some, every) from the block rule; unknown: maybe some, not every."""
        if self._blocks is None:
            return np.ones((1, 1, 1, 1), dtype=bool), np.zeros((1, 1, 1, 1), dtype=bool)
        some, every = self._blocks(*a)
        return np.asarray(some, dtype=bool), np.asarray(every, dtype=bool)

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
        self.check_batch(batch)
        if xp is None:
            xp = np
        b = xp.reshape(xp.arange(batch, device=device), (batch, 1, 1, 1))
        h = xp.reshape(xp.arange(heads, device=device), (1, heads, 1, 1))
        q = xp.reshape(xp.arange(q_len, device=device), (1, 1, q_len, 1))
        kv = xp.reshape(xp.arange(kv_len, device=device), (1, 1, 1, kv_len))
        out = self(b, h, q, kv, q_len, kv_len, xp)
        return xp.broadcast_to(xp.asarray(out, dtype=xp.bool), (batch, heads, q_len, kv_len))

    def blocks(
        self,
        q_len: int,
        kv_len: int,
        block_q: int,
        block_kv: int,
        *,
        batch: int = 1,
        heads: int = 1,
    ) -> np.ndarray:
        """Which blocks of the (Lq, Lk) matrix are empty, partial or full, without evaluating
        the mask element by element.

        Blocks are ``block_q`` queries by ``block_kv`` keys (the last ones may be smaller).
        A mask with no block structure (see :attr:`knows_blocks`) reports every block as
        :data:`PARTIAL`: the kernel then evaluates it block by block.

        Returns:
            int8 array of shape (B or 1, H or 1, ceil(Lq / block_q), ceil(Lk / block_kv)) of
            :data:`EMPTY` (no allowed pair: skipped), :data:`PARTIAL` (some: the mask is
            evaluated) and :data:`FULL` (every pair allowed: no mask needed). The batch and
            head axes have size 1 when the structure does not depend on them.

        Example:
            >>> from qkv.masks import sliding_window
            >>> sliding_window(1).blocks(6, 6, 2, 2)[0, 0]
            array([[1, 0, 0],
                   [1, 1, 0],
                   [0, 1, 1]], dtype=int8)
        """
        self.check_batch(batch)
        b = np.arange(batch).reshape(batch, 1, 1, 1)
        h = np.arange(heads).reshape(1, heads, 1, 1)
        q_start = np.arange(0, q_len, block_q).reshape(1, 1, -1, 1)
        kv_start = np.arange(0, kv_len, block_kv).reshape(1, 1, 1, -1)
        q_end = np.minimum(q_start + block_q, q_len)
        kv_end = np.minimum(kv_start + block_kv, kv_len)
        some, every = self._block_pair(b, h, q_start, q_end, kv_start, kv_end, q_len, kv_len)
        kinds = np.where(every, FULL, np.where(some, PARTIAL, EMPTY)).astype(np.int8)
        shape = np.broadcast_shapes(kinds.shape, (1, 1, q_start.shape[2], kv_start.shape[3]))
        return np.ascontiguousarray(np.broadcast_to(kinds, shape))


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


def diagonal_offset(alignment: str, q_len: int, kv_len: int) -> int:
    """How far the diagonal is shifted right: 0 for top-left, Lk − Lq for bottom-right."""
    return kv_len - q_len if alignment == "bottom-right" else 0
