"""The built-in masks: full, causal, sliding window, key padding, prefix LM, documents, and
masks from your own rule; each with its block structure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qkv._array import Array, library, shape_str, to_numpy
from qkv._array import device as array_device
from qkv.masks._rules import (
    Alignment,
    BlockRule,
    Mask,
    RuleCache,
    check_alignment,
    diagonal_offset,
)


def full() -> Mask:
    """Every query may attend every key (the mask that masks nothing)."""

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        return np.ones((1, 1, 1, 1), bool), np.ones((1, 1, 1, 1), bool)

    return Mask(
        lambda b, h, q, kv, lq, lk, xp: (q >= 0) & (kv >= 0), "full()", blocks=blocks, pure=True
    )


def causal(alignment: Alignment = "top-left") -> Mask:
    """Query i may attend key j only when j ≤ i (+ Lk − Lq with ``"bottom-right"``).

    Example:
        >>> causal("bottom-right").dense(2, 4)[0, 0].astype(int)
        array([[1, 1, 1, 0],
               [1, 1, 1, 1]])
    """
    check_alignment(alignment)

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        off = diagonal_offset(alignment, lq, lk)
        # some pair with j ≤ i + off: the smallest key against the largest query;
        # every pair: the largest key against the smallest query.
        return k0 <= q1 - 1 + off, k1 - 1 <= q0 + off

    return Mask(
        lambda b, h, q, kv, lq, lk, xp: kv <= q + diagonal_offset(alignment, lq, lk),
        f"causal({alignment!r})",
        blocks=blocks,
        causal=alignment,
        pure=True,
    )


def with_causal(mask: Mask | None, is_causal: bool, alignment: str = "top-left") -> Mask | None:
    """``mask & causal(alignment)`` when ``is_causal`` (the causal rule alone without a mask),
    else ``mask``: the one place where qkv combines a mask rule with ``is_causal=True``.

    Example:
        >>> with_causal(key_padding([2]), True)
        key_padding([2]) & causal('top-left')
        >>> with_causal(None, False) is None
        True
    """
    if not is_causal:
        return mask
    check_alignment(alignment)
    side: Alignment = "bottom-right" if alignment == "bottom-right" else "top-left"
    # The same objects from call to call: the tiled kernel keeps its block plan and the
    # masks of partial blocks per mask object.
    rule = _CAUSAL.get(side)
    if rule is None:
        rule = _CAUSAL.setdefault(side, causal(side))
    if mask is None:
        return rule
    return mask.combined("&", rule)


_CAUSAL: dict[str, Mask] = {}


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
        centre = q + diagonal_offset(alignment, lq, lk)
        return (kv >= centre - before) & (kv <= centre + after)

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        off = diagonal_offset(alignment, lq, lk)
        some = (k0 <= q1 - 1 + off + after) & (k1 - 1 >= q0 + off - before)
        every = (k0 >= q1 - 1 + off - before) & (k1 - 1 <= q0 + off + after)
        return some, every

    description = f"sliding_window({before}, {after}, alignment={alignment!r})"
    return Mask(rule, description, blocks=blocks, pure=True)


def _per_batch_lengths(values: Sequence[int] | Array, what: str, example: str) -> list[int]:
    array = np.asarray(to_numpy(values) if library(values) == "torch" else values)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{what} must be a non-empty 1-D sequence of integers (one per batch element), got "
            f"{array.dtype} of shape {shape_str(array.shape)}. Hint: {example}"
        )
    if (array < 0).any():
        raise ValueError(f"{what} must be ≥ 0, got {array.tolist()}")
    return [int(n) for n in array.tolist()]


def _lookup(listed: list[int], b: Array, kv: Array, xp: Any, name: str) -> Array:
    """``listed[b]`` as an array that broadcasts with b, on kv's device."""
    if int(b.shape[0] if b.ndim else 1) > len(listed):
        raise ValueError(
            f"{name} has {len(listed)} lengths but the batch has {b.shape[0]} elements. "
            "Hint: give one length per batch element."
        )
    table = xp.asarray(listed, device=array_device(kv))
    return table[b]


def _check_lengths(listed: list[int], lk: int) -> None:
    """A key padding length beyond the number of keys points past the end: refuse it."""
    if max(listed) > lk:
        raise ValueError(
            f"key_padding: lengths must be at most the key length Lk = {lk}, got {listed}. "
            "Hint: each length counts the real (not padding) keys of its sequence; a longer "
            "one points past the end."
        )


def key_padding(lengths: Sequence[int] | Array) -> Mask:
    """Batch element b attends only its first ``lengths[b]`` keys; the rest is padding.

    Args:
        lengths: (B,) integers, the true length of each sequence in the batch.

    Example:
        >>> key_padding([1, 3]).dense(1, 3, batch=2)[:, 0, 0].astype(int)
        array([[1, 0, 0],
               [1, 1, 1]])
    """
    listed = _per_batch_lengths(
        lengths, "key_padding: lengths", "key_padding([3, 5]) for two sequences of 3 and 5."
    )

    def rule(b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        _check_lengths(listed, lk)
        return kv < _lookup(listed, b, kv, xp, "key_padding")

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        _check_lengths(listed, lk)
        length = np.asarray(listed)[b]  # (B, 1, 1, 1)
        return k0 < length, k1 - 1 < length

    count = len(listed)
    per_batch = (("key_padding", f"{count} length{'' if count == 1 else 's'}", count),)
    return Mask(rule, f"key_padding({listed})", blocks=blocks, per_batch=per_batch, pure=True)


def prefix_lm(prefix: int | Sequence[int] | Array, *, alignment: Alignment = "top-left") -> Mask:
    """Prefix language model: every query sees the first ``prefix`` keys (the prompt, attended
    bidirectionally) and is causal after them.

    Args:
        prefix: the prefix length, one for the whole batch or (B,) one per batch element.
        alignment: the causal alignment for the rest.

    Example:
        >>> prefix_lm(2).dense(4, 4)[0, 0].astype(int)
        array([[1, 1, 0, 0],
               [1, 1, 0, 0],
               [1, 1, 1, 0],
               [1, 1, 1, 1]])
    """
    if isinstance(prefix, int) and not isinstance(prefix, bool):
        listed, per_batch = [prefix], False
        if prefix < 0:
            raise ValueError(f"prefix_lm: prefix must be ≥ 0, got {prefix}")
    else:
        listed = _per_batch_lengths(
            prefix, "prefix_lm: prefix", "prefix_lm(16), or prefix_lm([16, 9]) per batch element."
        )
        per_batch = True

    def rule(b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        length = _lookup(listed, b, kv, xp, "prefix_lm") if per_batch else listed[0]
        return kv < length

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        length = np.asarray(listed)[b] if per_batch else listed[0]
        return k0 < length, k1 - 1 < length

    shown = listed if per_batch else listed[0]
    count = len(listed)
    held = (("prefix_lm", f"{count} prefix{'' if count == 1 else 'es'}", count),)
    in_prefix = Mask(rule, f"prefix({shown})", blocks=blocks)
    combined = causal(alignment) | in_prefix
    return Mask(
        combined._rule,
        f"prefix_lm({shown}, alignment={alignment!r})",
        blocks=combined._blocks,
        per_batch=held if per_batch else (),
        pure=True,
    )


def document(segment_ids: Sequence[int] | Array, kv_segment_ids: Any = None) -> Mask:
    """Document (segment) masking: a query attends only keys of its own document.

    Several sequences packed into one row attend only within themselves. Combine with
    :func:`causal` for packed causal language modelling: ``document(ids) & causal()``.

    Args:
        segment_ids: integers, (L,) for every batch element or (B, L), the document of each
            position; documents are usually consecutive runs (0, 0, 0, 1, 1, 2, ...), which
            lets the kernel skip whole blocks.
        kv_segment_ids: the documents of the keys when they differ from the queries' (cross-
            attention, or Lq ≠ Lk); default ``segment_ids``.

    Example:
        >>> document([0, 0, 1, 1, 1]).dense(5, 5)[0, 0].astype(int)
        array([[1, 1, 0, 0, 0],
               [1, 1, 0, 0, 0],
               [0, 0, 1, 1, 1],
               [0, 0, 1, 1, 1],
               [0, 0, 1, 1, 1]])
    """
    q_ids = _segment_ids(segment_ids, "segment_ids")
    kv_ids = q_ids if kv_segment_ids is None else _segment_ids(kv_segment_ids, "kv_segment_ids")
    if q_ids.ndim != kv_ids.ndim or (q_ids.ndim == 2 and q_ids.shape[0] != kv_ids.shape[0]):
        raise ValueError(
            f"document: segment_ids {shape_str(q_ids.shape)} and kv_segment_ids "
            f"{shape_str(kv_ids.shape)} must both be (L,) or both (B, L) with the same B."
        )
    originals = (segment_ids, kv_segment_ids if kv_segment_ids is not None else segment_ids)
    cache = RuleCache()  # (namespace, device) -> the id tables there

    def tables(xp: Any, dev: Any) -> tuple[Array, Array]:
        key = (id(xp), str(dev))
        if key not in cache:
            made = []
            for original, ids in zip(originals, (q_ids, kv_ids), strict=True):
                same = library(original) == "torch" and str(array_device(original)) == str(dev)
                made.append(original if same and xp is not np else xp.asarray(ids, device=dev))
            cache[key] = (made[0], made[1])
        found: tuple[Array, Array] = cache[key]
        return found

    def rule(b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        _check_length(q_ids, lq, "segment_ids", "queries")
        _check_length(
            kv_ids, lk, "kv_segment_ids" if kv_segment_ids is not None else "segment_ids", "keys"
        )
        q_table, kv_table = tables(xp, array_device(kv))
        if q_ids.ndim == 1:
            return q_table[q] == kv_table[kv]
        return q_table[b, q] == kv_table[b, kv]

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        q_low, q_high = _block_range(q_ids, q0.reshape(-1), lq)  # (B', nq)
        k_low, k_high = _block_range(kv_ids, k0.reshape(-1), lk)  # (B', nk)
        q_low, q_high = q_low[:, None, :, None], q_high[:, None, :, None]
        k_low, k_high = k_low[:, None, None, :], k_high[:, None, None, :]
        some = (q_low <= k_high) & (k_low <= q_high)
        every = (q_low == q_high) & (k_low == k_high) & (q_low == k_low)
        return some, every

    held: tuple[tuple[str, str, int], ...] = ()
    if q_ids.ndim == 2:
        rows = int(q_ids.shape[0])
        held = (("document", f"segment_ids for {rows} sequence{'' if rows == 1 else 's'}", rows),)
    return Mask(rule, f"document({_ids_repr(q_ids)})", blocks=blocks, per_batch=held, pure=True)


def _segment_ids(ids: Any, name: str) -> np.ndarray:
    array = np.asarray(to_numpy(ids) if library(ids) == "torch" else ids)
    if array.ndim not in (1, 2) or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"document: {name} must be integers of shape (L,) or (B, L), got {array.dtype} of "
            f"shape {shape_str(array.shape)}. Hint: document([0, 0, 0, 1, 1]) packs a document "
            "of 3 tokens and one of 2."
        )
    return array.copy()  # the rule's own: a caller's array changed later changes nothing


def _check_length(ids: np.ndarray, length: int, name: str, what: str) -> None:
    if ids.shape[-1] != length:
        raise ValueError(
            f"document: {name} has {ids.shape[-1]} positions but there are {length} {what}. "
            f"Hint: give one document id per position."
        )


def _block_range(ids: np.ndarray, starts: np.ndarray, length: int) -> tuple[Any, Any]:
    """The smallest and largest id in each block that starts at ``starts`` (B', n)."""
    _check_length(ids, length, "segment_ids", "positions")
    rows = ids.reshape(-1, ids.shape[-1])
    return np.minimum.reduceat(rows, starts, axis=1), np.maximum.reduceat(rows, starts, axis=1)


def _ids_repr(ids: np.ndarray) -> str:
    flat = ids.reshape(-1).tolist()
    shown = ", ".join(str(i) for i in flat[:6]) + (", ..." if len(flat) > 6 else "")
    return f"[{shown}]" if ids.ndim == 1 else f"{shape_str(ids.shape)} ids"


def from_function(
    mask_mod: Callable[[Array, Array, Array, Array], Array],
    name: str = "",
    *,
    blocks: Callable[..., tuple[Any, Any]] | None = None,
) -> Mask:
    """A mask from your own rule ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    The rule receives integer index arrays that broadcast against each other, and must use
    only elementwise operations (comparisons, ``&``, ``|``, arithmetic).

    Args:
        mask_mod: the rule; True = may attend.
        name: how the mask shows in its repr and in traces.
        blocks: optional block hint ``blocks(b, h, q_start, q_end, kv_start, kv_end) ->
            (some, every)`` on NumPy integer arrays (ends exclusive; see :meth:`Mask.blocks`):
            ``some`` False promises the block is empty, ``every`` True that it is full. A
            wrong hint gives wrong results; without one, the tiled kernel evaluates the rule
            on each block and still skips the blocks that turn out empty.

    Example:
        >>> even_keys = from_function(lambda b, h, q, kv: kv % 2 == 0, "even keys")
        >>> even_keys.dense(1, 4)[0, 0, 0].astype(int)
        array([1, 0, 1, 0])
    """
    label = name or getattr(mask_mod, "__name__", "mask_mod")
    block_rule: BlockRule | None = None
    if blocks is not None:
        hint = blocks

        def block_rule(
            b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int
        ) -> tuple[Any, Any]:
            return hint(b, h, q0, q1, k0, k1)

    return Mask(
        lambda b, h, q, kv, lq, lk, xp: mask_mod(b, h, q, kv),
        f"from_function({label})",
        blocks=block_rule,
    )


RULES: dict[str, Callable[..., Mask]] = {
    rule.__name__: rule
    for rule in (full, causal, sliding_window, key_padding, prefix_lm, document, from_function)
}
"""The mask rules a user makes, by name: the one list the tests draw rules from (block
structure against the dense mask, the tiled kernel and FlexAttention against the
reference) and the kernels page's table of rules lists. A new rule is a function here,
with its block hint, added to this registry (and exported by ``qkv.masks``)."""
