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

from collections.abc import Callable
from typing import Any

from qkv.attention._backends import BackendName
from qkv.attention._dispatch import scaled_dot_product_attention
from qkv.attention._packed import check_max, offsets, packed_rule, window
from qkv.masks import Mask, ScoreMod

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
    total_q = int(query.shape[0])
    rule = _rule(
        query, key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, window_size
    )
    heads, kv_heads = int(query.shape[1]), int(key.shape[1])
    if rule is None:  # no query or no key: nothing to attend
        return query.new_zeros(total_q, heads, int(value.shape[2]))
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


def _rule(
    query: Any,
    key: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    is_causal: bool,
    window_size: Any,
) -> Mask | None:
    """The checked offsets as the rule of the packed tokens (None when there is no query or
    no key): read once to the host, or, while torch.compile traces, tensors whose values are
    checked when the graph runs."""
    import torch

    total_q, total_k, device = int(query.shape[0]), int(key.shape[0]), query.device
    left, right = window(window_size, is_causal)
    if torch.compiler.is_compiling():
        from qkv.attention._packed_graph import Sequences, graph_rule, traced_offsets

        who = "varlen_attention"
        cu_q = traced_offsets(
            cu_seqlens_q, "cu_seqlens_q", total_q, "query", who, device,
            ("max_seqlen_q", max_seqlen_q, "queries"),
        )  # fmt: skip
        cu_k = traced_offsets(
            cu_seqlens_k, "cu_seqlens_k", total_k, "key", who, device,
            ("max_seqlen_k", max_seqlen_k, "keys"),
        )  # fmt: skip
        _same_count(int(cu_q.shape[0]), int(cu_k.shape[0]))
        if total_q == 0 or total_k == 0:
            return None
        return graph_rule(Sequences.of(cu_q, total_q), Sequences.of(cu_k, total_k), left, right)
    starts_q = offsets(cu_seqlens_q, "cu_seqlens_q", total_q, "query", device=device)
    starts_k = offsets(cu_seqlens_k, "cu_seqlens_k", total_k, "key", device=device)
    _same_count(len(starts_q), len(starts_k))
    check_max(starts_q, max_seqlen_q, "max_seqlen_q", "queries")
    check_max(starts_k, max_seqlen_k, "max_seqlen_k", "keys")
    if total_q == 0 or total_k == 0:
        return None
    return packed_rule(starts_q, starts_k, left, right)


def _same_count(count_q: int, count_k: int) -> None:
    if count_q != count_k:
        raise ValueError(
            f"varlen_attention: cu_seqlens_q has {count_q} entries and cu_seqlens_k "
            f"{count_k}; expected the same B + 1. Hint: one entry per sequence and a "
            "leading 0, for queries and keys alike."
        )


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
