"""Packed variable-length sequences in FlashAttention's convention (``flash_attn_varlen_func``).

Sequences of different lengths are concatenated along the tokens, with no padding:
``query`` is (total_q, H, D) and sequence s holds rows ``cu_seqlens_q[s]`` to
``cu_seqlens_q[s + 1]``. Inside, this is one attention call over the packed tokens,
(1, H, total_q, D), with the document rule (a query sees only keys of its own sequence),
so the tiled kernel skips every block between two sequences; causality and the local window
are measured from each sequence's end, as FlashAttention does when a sequence has more keys
than queries (bottom-right alignment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from qkv._array import Array
from qkv.attention._backends import BackendName
from qkv.attention._dispatch import scaled_dot_product_attention
from qkv.masks import Mask, ScoreMod, document, from_function

__all__ = ["varlen_attention"]


def varlen_attention(
    query: Any,
    key: Any,
    value: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    dropout_p: float = 0.0,
    generator: Any = None,
    backend: BackendName = "auto",
) -> Any:
    """Attention over packed sequences of different lengths, each attending only to itself.

    FlashAttention's ``flash_attn_varlen_func`` convention: no padding, the sequences one
    after another. A query row with no key to attend (an empty key sequence, or causal with
    more queries than keys) gets zeros. Gradients flow to query, key and value.

    Args:
        query: (total_q, H, D), the queries of every sequence, concatenated.
        key: (total_k, Hkv, D); Hkv divides H (grouped-query attention when smaller).
        value: (total_k, Hkv, Dv).
        cu_seqlens_q: (B + 1,) integers, 0 first, non-decreasing, ``total_q`` last:
            sequence s holds query rows ``cu_seqlens_q[s]`` to ``cu_seqlens_q[s + 1]``.
        cu_seqlens_k: (B + 1,), the same for the keys and values.
        max_seqlen_q, max_seqlen_k: at least the longest sequence (as FlashAttention takes
            them; checked).
        is_causal: query i of a sequence sees key j ≤ i + Lk − Lq of the same sequence
            (aligned to the sequence's end when Lk ≠ Lq, as FlashAttention does).
        window_size: (left, right): query i sees keys i + Lk − Lq − left … i + Lk − Lq +
            right of its sequence; −1 is no limit on that side. With ``is_causal``, right
            is 0.
        scale: multiplies the scores; default 1/√D.
        score_mod: a :class:`qkv.masks.ScoreMod` (``masks.softcap(50.0)``) or
            ``fn(score, b, h, q_idx, kv_idx)`` on the packed positions.
        dropout_p, generator: as in :func:`qkv.scaled_dot_product_attention`.
        backend: as in :func:`qkv.scaled_dot_product_attention` (auto: the tiled kernel
            skips the blocks between sequences).

    Returns:
        (total_q, H, Dv), in the dtype of query.

    Raises:
        ValueError: on shapes, lengths or options that do not fit, naming the argument.

    Example:
        >>> import torch, qkv
        >>> lengths = [3, 5]                                     # two sequences, 8 tokens
        >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        >>> q = k = v = torch.randn(8, 2, 16)                    # (total, H, D)
        >>> out = qkv.varlen_attention(q, k, v, cu, cu, 5, 5, is_causal=True)
        >>> alone = qkv.scaled_dot_product_attention(            # the second one, unpacked
        ...     q[3:].transpose(0, 1), k[3:].transpose(0, 1), v[3:].transpose(0, 1),
        ...     is_causal=True)
        >>> bool(torch.allclose(out[3:], alone.transpose(0, 1), atol=1e-6))
        True
    """
    _check_tokens(query, key, value)
    starts_q = _offsets(cu_seqlens_q, "cu_seqlens_q", int(query.shape[0]), "query")
    starts_k = _offsets(cu_seqlens_k, "cu_seqlens_k", int(key.shape[0]), "key")
    if len(starts_q) != len(starts_k):
        raise ValueError(
            f"varlen_attention: cu_seqlens_q has {len(starts_q)} entries and cu_seqlens_k "
            f"{len(starts_k)}; expected the same B + 1. Hint: one entry per sequence and a "
            "leading 0, for queries and keys alike."
        )
    _check_max(starts_q, max_seqlen_q, "max_seqlen_q", "queries")
    _check_max(starts_k, max_seqlen_k, "max_seqlen_k", "keys")
    left, right = _window(window_size, is_causal)
    heads, kv_heads = int(query.shape[1]), int(key.shape[1])
    if query.shape[0] == 0 or key.shape[0] == 0:
        return query.new_zeros(int(query.shape[0]), heads, int(value.shape[2]))
    rule = _packed_rule(starts_q, starts_k, left, right)
    out = scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # (1, H, total_q, D)
        key.transpose(0, 1)[None],  # (1, Hkv, total_k, D)
        value.transpose(0, 1)[None],  # (1, Hkv, total_k, Dv)
        mask=rule,
        scale=scale,
        score_mod=score_mod,
        enable_gqa=heads != kv_heads,
        dropout_p=dropout_p,
        generator=generator,
        backend=backend,
    )  # (1, H, total_q, Dv)
    return out[0].transpose(0, 1)  # (total_q, H, Dv)


def _check_tokens(query: Any, key: Any, value: Any) -> None:
    import torch

    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            got = f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            raise ValueError(
                f"varlen_attention: {name} must be a tensor (total, heads, dim), got {got}. "
                "Hint: concatenate the sequences along the first axis, no padding."
            )
    if key.shape[0] != value.shape[0] or key.shape[1] != value.shape[1]:
        raise ValueError(
            f"varlen_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must "
            "have the same tokens and heads. Hint: value is (total_k, Hkv, Dv)."
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"varlen_attention: query and key must have the same head dim, got "
            f"{query.shape[2]} and {key.shape[2]}."
        )
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] != 0:
        raise ValueError(
            f"varlen_attention: the key/value heads ({key.shape[1]}) must divide the query "
            f"heads ({query.shape[1]}). Hint: grouped-query attention shares each key/value "
            "head among H / Hkv query heads."
        )


def _offsets(cu: Any, name: str, total: int, tokens: str) -> list[int]:
    """The checked offsets of ``cu`` (read to the host once)."""
    array = np.asarray(cu.detach().cpu() if hasattr(cu, "detach") else cu)
    if array.ndim != 1 or array.size < 2 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"varlen_attention: {name} must be integers of shape (B + 1,), got "
            f"{array.dtype} of shape {tuple(array.shape)}. Hint: torch.tensor([0, 3, 8], "
            "dtype=torch.int32) for sequences of 3 and 5 tokens."
        )
    offsets = [int(n) for n in array]
    if offsets[0] != 0 or any(b < a for a, b in pairwise(offsets)):
        raise ValueError(
            f"varlen_attention: {name} must start at 0 and never decrease, got {offsets[:8]}"
            f"{' ...' if len(offsets) > 8 else ''}. Hint: the running sum of the lengths, "
            "with a leading 0."
        )
    if offsets[-1] != total:
        raise ValueError(
            f"varlen_attention: {name} ends at {offsets[-1]} but {tokens} has {total} "
            f"tokens. Hint: its last entry is the total length."
        )
    return offsets


def _check_max(offsets: Sequence[int], given: int, name: str, what: str) -> None:
    longest = max(b - a for a, b in pairwise(offsets))
    if isinstance(given, bool) or not isinstance(given, int) or given < longest:
        raise ValueError(
            f"varlen_attention: {name} must be an integer ≥ the longest sequence's {what} "
            f"({longest}), got {given!r}."
        )


def _window(window_size: Any, is_causal: bool) -> tuple[int | None, int | None]:
    """(left, right) limits, None for no limit; causal sets right to 0."""
    ok = isinstance(window_size, tuple | list) and len(window_size) == 2
    if not ok or any(isinstance(n, bool) or not isinstance(n, int) or n < -1 for n in window_size):
        raise ValueError(
            f"varlen_attention: window_size must be two integers (left, right), each ≥ 0 "
            f"or −1 for no limit, got {window_size!r}. Hint: (255, 0) with is_causal=True is "
            "a causal window of 256 keys."
        )
    left, right = (None if n < 0 else int(n) for n in window_size)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _packed_rule(
    starts_q: list[int], starts_k: list[int], left: int | None, right: int | None
) -> Mask:
    """The document rule of the packed sequences, and the window measured from each
    sequence's end (bottom-right, as FlashAttention), with its block hint."""
    lengths_q, lengths_k = np.diff(starts_q), np.diff(starts_k)
    ids_q = np.repeat(np.arange(len(lengths_q)), lengths_q)  # (total_q,)
    ids_k = np.repeat(np.arange(len(lengths_k)), lengths_k)  # (total_k,)
    rule = document(ids_q, ids_k)
    if left is None and right is None:
        return rule
    # each position's place counted from its sequence's end: −Lq … −1 for the queries
    from_end_q = np.arange(len(ids_q)) - np.asarray(starts_q[1:])[ids_q]
    from_end_k = np.arange(len(ids_k)) - np.asarray(starts_k[1:])[ids_k]
    tables: dict[tuple[int, str], tuple[Array, Array]] = {}

    def window(b: Any, h: Any, q: Any, kv: Any) -> Any:
        key = (id(type(q)), str(getattr(q, "device", "cpu")))
        if key not in tables:
            if isinstance(q, np.ndarray):
                tables[key] = (from_end_q, from_end_k)
            else:
                import torch

                tables[key] = (
                    torch.as_tensor(from_end_q, device=q.device),
                    torch.as_tensor(from_end_k, device=q.device),
                )
        table_q, table_k = tables[key]
        offset_q, offset_k = table_q[q], table_k[kv]
        if left is None:
            return offset_k <= offset_q + right
        if right is None:
            return offset_k >= offset_q - left
        return (offset_k >= offset_q - left) & (offset_k <= offset_q + right)

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any) -> tuple[Any, Any]:
        q_low = np.minimum.reduceat(from_end_q, q0.reshape(-1))[:, None]  # (nq, 1)
        q_high = np.maximum.reduceat(from_end_q, q0.reshape(-1))[:, None]
        k_low = np.minimum.reduceat(from_end_k, k0.reshape(-1))[None, :]  # (1, nk)
        k_high = np.maximum.reduceat(from_end_k, k0.reshape(-1))[None, :]
        some = np.ones((q_low.shape[0], k_low.shape[1]), dtype=bool)
        every = some.copy()
        if left is not None:
            some &= k_high >= q_low - left
            every &= k_low >= q_high - left
        if right is not None:
            some &= k_low <= q_high + right
            every &= k_high <= q_low + right
        return some[None, None], every[None, None]

    return rule & from_function(window, "window from each sequence's end", blocks=blocks)
