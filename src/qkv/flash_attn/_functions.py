"""flash-attn 2's attention functions, with its signatures, layouts and semantics, on qkv.

Padded batches are (batch, seqlen, nheads, headdim); packed sequences are (total, nheads,
headdim) with ``cu_seqlens``. Causal masks, windows and ALiBi are aligned to the
bottom-right corner when a sequence has more keys than queries, as in flash-attn.
Gradients flow to q, k and v through qkv's kernels (``deterministic`` is accepted: qkv's
backward pass always is).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any, NamedTuple

import torch

from qkv.attention._packed import check_max, check_offsets_tensor, offsets, packed_rule
from qkv.attention._packed_graph import Sequences, graph_rule, traced_offsets
from qkv.flash_attn._core import (
    Positions,
    Result,
    attend,
    check_block_table,
    check_dtypes,
    check_heads,
    fail,
    window,
)
from qkv.masks import Mask, sliding_window

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


class Options(NamedTuple):
    """The options every public function takes, as flash-attn names them."""

    dropout_p: float
    softmax_scale: float | None
    causal: bool
    window_size: Any
    softcap: float
    alibi_slopes: Any
    return_attn_probs: bool


def _check_shapes(
    who: str, qkv: tuple[torch.Tensor, ...], names: tuple[str, str, str], *, padded: bool
) -> None:
    """q, k and v padded (batch, seqlen, nheads, headdim) or packed (total, nheads, headdim),
    k and v of one shape, with q's headdim (and, padded, q's batch)."""
    if padded:
        layout = "(batch, seqlen, nheads, headdim)"
        hint = "packed (total, nheads, headdim) sequences go to flash_attn_varlen_func"
    else:
        layout = "(total, nheads, headdim), the sequences concatenated"
        hint = "a padded batch goes to flash_attn_func"
    for name, x in zip(names, qkv, strict=True):
        if x.ndim != (4 if padded else 3):
            raise fail(who, f"{name} must be {layout}, got shape {tuple(x.shape)}. Hint: {hint}.")
    q, k, v = qkv
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or (padded and k.shape[0] != q.shape[0]):
        shapes = f"{names[0]} {tuple(q.shape)}, {names[1]} {tuple(k.shape)} and {names[2]}"
        fit = "q's batch and headdim" if padded else "q's headdim"
        raise fail(
            who,
            f"{shapes} {tuple(v.shape)} do not fit: expected k and v of one shape, with {fit}.",
        )


def _batch_positions(
    batch: int, lq: int, lk: int, left: int | None, right: int | None, device: Any
) -> Positions:
    """Every sequence of a padded batch has Lq queries and Lk keys."""
    rows = torch.arange(batch, device=device)[:, None]
    mask: Mask | None = None
    if left is not None or right is not None:
        far = lq + lk  # as good as no limit
        mask = sliding_window(
            far if left is None else left, far if right is None else right, alignment="bottom-right"
        )
    return Positions(
        seq_q=rows.expand(batch, lq),
        rel_q=(torch.arange(lq, device=device) - lq).expand(batch, lq),
        seq_k=rows.expand(batch, lk),
        rel_k=(torch.arange(lk, device=device) - lk).expand(batch, lk),
        keys_q=torch.full((batch, lq), lk, device=device),
        sequences=batch,
        mask=mask,
    )


def _kernel_causal(left: int | None, right: int | None, keys: int) -> bool:
    """Whether flash-attn's kernel takes its causal path (``is_causal`` after it drops a
    left window that covers every key)."""
    return (left is None or left >= keys) and right == 0


def _batched(
    who: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    names: tuple[str, str, str],
    options: Options,
) -> Any:
    """The padded-batch functions: q (B, Lq, H, D), k and v (B, Lk, Hkv, D)."""
    check_dtypes(who, **{names[0]: q, names[1]: k, names[2]: v})
    _check_shapes(who, (q, k, v), names, padded=True)
    check_heads(who, int(q.shape[2]), int(k.shape[2]), names[1])
    batch, lq, lk = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
    left, right = window(who, options.window_size, options.causal)
    where = _batch_positions(batch, lq, lk, left, right, q.device)
    causal = _kernel_causal(left, right, lk)
    result = _attend(
        who, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), where, options, causal
    )
    out = result.out.transpose(1, 2).contiguous()
    if options.return_attn_probs:
        return out, result.lse, result.probs
    return out


def _attend(
    who: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: Positions,
    options: Options,
    kernel_causal: bool,
) -> Result:
    """:func:`attend` with a public function's options: q (B, H, Lq, D), k and v
    (B, Hkv, Lk, D)."""
    return attend(
        who,
        q,
        k,
        v,
        where,
        softmax_scale=options.softmax_scale,
        kernel_causal=kernel_causal,
        softcap=options.softcap,
        alibi_slopes=options.alibi_slopes,
        dropout_p=options.dropout_p,
        want_lse=options.return_attn_probs,
        want_probs=options.return_attn_probs,
    )


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim), nheads_k dividing nheads (GQA/MQA).

    ``causal`` and ``window_size=(left, right)`` are aligned to the bottom-right corner:
    query i sees keys i + Lk − Lq − left … i + Lk − Lq + right (−1: no limit), and a row
    with no key gets zeros. ``softcap`` > 0 caps the scaled scores, cap · tanh(s / cap),
    before ``alibi_slopes`` ((nheads,) or (batch, nheads)) add −slope · |i + Lk − Lq − j|.

    Returns:
        out (batch, seqlen_q, nheads, headdim); with ``return_attn_probs``,
        ``(out, softmax_lse, S_dmask)``: the natural log-sum-exp of each row's scores,
        (batch, nheads, seqlen_q), float32 (float64 for float64 inputs), +inf for a row with
        no key; and the exact probabilities (batch, nheads, seqlen_q, seqlen_k), negative
        where dropout dropped them. flash-attn's own are approximate and padded.

    Example:
        >>> import torch
        >>> from qkv.flash_attn import flash_attn_func
        >>> q, k, v = (torch.randn(2, 5, 4, 8) for _ in range(3))
        >>> out = flash_attn_func(q, k, v, causal=True)
        >>> tuple(out.shape)
        (2, 5, 4, 8)
        >>> expected = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        >>> bool(torch.allclose(out, expected.transpose(1, 2), atol=1e-6))
        True
    """
    del deterministic  # qkv's backward pass is deterministic
    options = Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    return _batched("flash_attn_func", q, k, v, ("q", "k", "v"), options)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv`` (batch, seqlen, 3, nheads,
    headdim); otherwise :func:`flash_attn_func`.

    Example:
        >>> import torch
        >>> qkv = torch.randn(2, 5, 3, 4, 8)
        >>> out = flash_attn_qkvpacked_func(qkv, causal=True)
        >>> bool(torch.equal(out, flash_attn_func(*qkv.unbind(2), causal=True)))
        True
    """
    del deterministic
    who = "flash_attn_qkvpacked_func"
    if not isinstance(qkv, torch.Tensor) or qkv.ndim != 5 or qkv.shape[2] != 3:
        raise fail(who, f"qkv must be (batch, seqlen, 3, nheads, headdim), got {_shape(qkv)}.")
    q, k, v = qkv.unbind(2)
    options = Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    return _batched(who, q, k, v, ("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"), options)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_kvpacked_func``: q (batch, seqlen_q, nheads, headdim), ``kv``
    (batch, seqlen_k, 2, nheads_k, headdim); otherwise :func:`flash_attn_func`.

    Example:
        >>> import torch
        >>> q, kv = torch.randn(1, 3, 4, 8), torch.randn(1, 6, 2, 2, 8)
        >>> tuple(flash_attn_kvpacked_func(q, kv, causal=True).shape)
        (1, 3, 4, 8)
    """
    del deterministic
    who = "flash_attn_kvpacked_func"
    if not isinstance(kv, torch.Tensor) or kv.ndim != 5 or kv.shape[2] != 2:
        raise fail(who, f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {_shape(kv)}.")
    k, v = kv.unbind(2)
    options = Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    return _batched(who, q, k, v, ("q", "kv[:, :, 0]", "kv[:, :, 1]"), options)


def _shape(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__


def _varlen_positions(
    starts_q: list[int], starts_k: list[int], left: int | None, right: int | None, device: Any
) -> Positions:
    """Packed sequences: one batch row, the sequences one after another."""
    lengths_q = torch.tensor([b - a for a, b in pairwise(starts_q)], device=device)
    lengths_k = torch.tensor([b - a for a, b in pairwise(starts_k)], device=device)
    ids_q = torch.repeat_interleave(torch.arange(len(lengths_q), device=device), lengths_q)
    ids_k = torch.repeat_interleave(torch.arange(len(lengths_k), device=device), lengths_k)
    ends_q = torch.tensor(starts_q[1:], device=device)
    ends_k = torch.tensor(starts_k[1:], device=device)
    return Positions(
        seq_q=ids_q[None],
        rel_q=(torch.arange(len(ids_q), device=device) - ends_q[ids_q])[None],
        seq_k=ids_k[None],
        rel_k=(torch.arange(len(ids_k), device=device) - ends_k[ids_k])[None],
        keys_q=lengths_k[ids_q][None],
        sequences=len(starts_q) - 1,
        mask=packed_rule(starts_q, starts_k, left, right),
    )


def _varlen(
    who: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    names: tuple[str, str, str],
    cu: tuple[Any, Any],
    maxima: tuple[int, int],
    options: Options,
    block_table: Any = None,
) -> Any:
    """The packed functions: q (total_q, H, D), k and v (total_k, Hkv, D); ``cu`` and
    ``maxima``: cu_seqlens and max_seqlen of the queries and the keys."""
    if block_table is not None and torch.compiler.is_compiling():
        return _paged_outside_graph(who, q, k, v, names, cu, maxima, options, block_table)
    check_dtypes(who, **{names[0]: q, names[1]: k, names[2]: v})
    if block_table is not None:
        k, v = _gather_pages(who, k, v, block_table, cu[1])
    _check_shapes(who, (q, k, v), names, padded=False)
    check_heads(who, int(q.shape[1]), int(k.shape[1]), names[1])
    left, right = window(who, options.window_size, options.causal)
    if torch.compiler.is_compiling():
        where, unpack = _traced_positions(who, q, k, names, cu, maxima, left, right)
    else:
        where, unpack = _read_positions(who, q, k, names, cu, maxima, left, right)
    causal = _kernel_causal(left, right, maxima[1])
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, total, D)
    result = _attend(who, q, k, v, where, options, causal)
    out = result.out[0].transpose(0, 1).contiguous()
    if not options.return_attn_probs:
        return out
    assert result.lse is not None and result.probs is not None
    return out, result.lse[0], unpack(result.probs[0])


Unpack = Callable[[torch.Tensor], torch.Tensor]
"""The packed probabilities (H, total_q, total_k) as (batch, H, max_seqlen_q, max_seqlen_k)."""


def _read_positions(
    who: str,
    q: torch.Tensor,
    k: torch.Tensor,
    names: tuple[str, str, str],
    cu: tuple[Any, Any],
    maxima: tuple[Any, Any],
    left: int | None,
    right: int | None,
) -> tuple[Positions, Unpack]:
    """The offsets read to the host and checked, as the packed positions."""
    starts_q = offsets(cu[0], "cu_seqlens_q", int(q.shape[0]), names[0], who, q.device)
    starts_k = offsets(cu[1], "cu_seqlens_k", int(k.shape[0]), names[1], who, q.device)
    _same_count(who, len(starts_q), len(starts_k))
    check_max(starts_q, maxima[0], "max_seqlen_q", "queries", who)
    check_max(starts_k, maxima[1], "max_seqlen_k", "keys", who)
    where = _varlen_positions(starts_q, starts_k, left, right, q.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return _unpack(packed, starts_q, starts_k, maxima[0], maxima[1])

    return where, unpack


def _traced_positions(
    who: str,
    q: torch.Tensor,
    k: torch.Tensor,
    names: tuple[str, str, str],
    cu: tuple[Any, Any],
    maxima: tuple[Any, Any],
    left: int | None,
    right: int | None,
) -> tuple[Positions, Unpack]:
    """The packed positions as tensor operations on the offsets, whose values the graph
    checks when it runs (what torch.compile traces: nothing is read)."""
    total_q, total_k = int(q.shape[0]), int(k.shape[0])
    cu_q = traced_offsets(
        cu[0], "cu_seqlens_q", total_q, names[0], who, q.device,
        ("max_seqlen_q", maxima[0], "queries"),
    )  # fmt: skip
    cu_k = traced_offsets(
        cu[1], "cu_seqlens_k", total_k, names[1], who, q.device,
        ("max_seqlen_k", maxima[1], "keys"),
    )  # fmt: skip
    _same_count(who, int(cu_q.shape[0]), int(cu_k.shape[0]))
    seq_q, seq_k = Sequences.of(cu_q, total_q), Sequences.of(cu_k, total_k)
    where = Positions(
        seq_q=seq_q.ids[None],
        rel_q=seq_q.place("bottom-right")[None],
        seq_k=seq_k.ids[None],
        rel_k=seq_k.place("bottom-right")[None],
        keys_q=seq_k.lengths[seq_q.ids][None],
        sequences=int(cu_q.shape[0]) - 1,
        mask=graph_rule(seq_q, seq_k, left, right),
    )
    batch = int(cu_q.shape[0]) - 1

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """Each packed pair of one sequence to its place in (batch, H, max_q, max_k): the
        other pairs add 0 at places in range, so no value decides a shape."""
        heads = int(packed.shape[0])
        out = packed.new_zeros(batch, maxima[0], maxima[1], heads)
        same = (seq_q.ids[:, None] == seq_k.ids[None, :])[..., None]  # (total_q, total_k, 1)
        rows = (torch.arange(total_q, device=q.device) - seq_q.first)[:, None]
        cols = (torch.arange(total_k, device=q.device) - seq_k.first)[None, :]
        index = (
            seq_q.ids[:, None].expand(total_q, total_k),
            rows.clamp(max=maxima[0] - 1).expand(total_q, total_k),
            cols.clamp(max=maxima[1] - 1).expand(total_q, total_k),
        )
        pairs = torch.where(same, packed.permute(1, 2, 0), 0)  # (total_q, total_k, H)
        return out.index_put(index, pairs, accumulate=True).permute(0, 3, 1, 2)

    return where, unpack


def _same_count(who: str, count_q: int, count_k: int) -> None:
    if count_q != count_k:
        raise fail(
            who,
            f"cu_seqlens_q has {count_q} entries and cu_seqlens_k {count_k}; expected the "
            "same batch_size + 1. Hint: a leading 0, then one running total per sequence, "
            "for queries and keys alike.",
        )


_paged_outside_graph: Callable[..., Any] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _varlen,
    reason="flash_attn_varlen_func with block_table runs outside the compiled graph: how "
    "many keys it gathers from the pages is cu_seqlens_k's last value, which a graph cannot "
    "read while it is traced",
)
"""The paged varlen call, eagerly (a graph break; ``fullgraph=True`` raises with its reason)."""


def _gather_pages(
    who: str, k: torch.Tensor, v: torch.Tensor, block_table: Any, cu_seqlens_k: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged k and v (num_blocks, page_block_size, nheads_k, headdim) as packed (total_k,
    nheads_k, headdim): sequence s's key p is in page ``block_table[s, p // size]``."""
    if k.ndim != 4 or k.shape != v.shape:
        raise fail(
            who,
            f"with block_table, k and v must be pages of one shape (num_blocks, "
            f"page_block_size, nheads_k, headdim), got {tuple(k.shape)} and {tuple(v.shape)}.",
        )
    if isinstance(cu_seqlens_k, torch.Tensor):
        check_offsets_tensor(cu_seqlens_k, "cu_seqlens_k", who, k.device)
    ends = torch.as_tensor(cu_seqlens_k).flatten()
    total = int(ends[-1]) if ends.numel() else 0
    starts = offsets(cu_seqlens_k, "cu_seqlens_k", total, "the pages", who)
    batch = len(starts) - 1
    check_block_table(who, block_table, batch)
    num_blocks, size = int(k.shape[0]), int(k.shape[1])
    table = block_table.tolist()
    picked: list[int] = []
    for s, (a, b) in enumerate(pairwise(starts)):
        used = table[s][: -(-(b - a) // size)]
        if (b - a) > len(table[s]) * size:
            raise fail(
                who,
                f"sequence {s} has {b - a} keys but block_table holds {len(table[s])} pages "
                f"of {size} for it.",
            )
        bad = [n for n in used if not 0 <= n < num_blocks]
        if bad:
            raise fail(
                who,
                f"block_table[{s}] holds page {bad[0]}, outside k's {num_blocks} pages.",
            )
        picked += [page * size + p for page in used for p in range(size)][: b - a]
    index = torch.tensor(picked, dtype=torch.int64, device=k.device)
    return k.flatten(0, 1)[index], v.flatten(0, 1)[index]


def _unpack(
    packed: torch.Tensor, starts_q: list[int], starts_k: list[int], max_q: int, max_k: int
) -> torch.Tensor:
    """The packed probabilities (H, total_q, total_k) as (batch, H, max_q, max_k)."""
    out = packed.new_zeros(len(starts_q) - 1, packed.shape[0], max_q, max_k)
    for s, ((q0, q1), (k0, k1)) in enumerate(
        zip(pairwise(starts_q), pairwise(starts_k), strict=True)
    ):
        out[s, :, : q1 - q0, : k1 - k0] = packed[:, q0:q1, k0:k1]
    return out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Any:
    """flash-attn's ``flash_attn_varlen_func``: sequences packed with no padding.

    q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); sequence s holds
    rows ``cu_seqlens_q[s]`` to ``cu_seqlens_q[s + 1]`` of q (``cu_seqlens_k`` for k and v),
    and attends only to itself, with causal, window and ALiBi aligned to its own
    bottom-right corner. The other arguments are those of :func:`flash_attn_func`.
    With ``block_table`` (batch, max_num_blocks_per_seq), k and v are pages (num_blocks,
    page_block_size, nheads_k, headdim): key p of sequence s is in page
    ``block_table[s, p // page_block_size]``.

    Returns:
        out (total_q, nheads, headdim); with ``return_attn_probs``, ``(out, softmax_lse,
        S_dmask)``: softmax_lse (nheads, total_q) and the exact probabilities (batch, nheads,
        max_seqlen_q, max_seqlen_k), zero beyond each sequence.

    Example:
        >>> import torch
        >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)   # sequences of 3 and 5 tokens
        >>> q = k = v = torch.randn(8, 2, 16)
        >>> out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
        >>> alone = flash_attn_func(q[None, 3:], k[None, 3:], v[None, 3:], causal=True)
        >>> bool(torch.allclose(out[3:], alone[0], atol=1e-6))
        True
    """
    del deterministic
    options = Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    cu, most = (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)
    return _varlen(
        "flash_attn_varlen_func", q, k, v, ("q", "k", "v"), cu, most, options, block_table
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` (total, 3, nheads,
    headdim), one ``cu_seqlens`` for queries and keys; otherwise
    :func:`flash_attn_varlen_func`.

    Example:
        >>> import torch
        >>> cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        >>> tuple(flash_attn_varlen_qkvpacked_func(torch.randn(6, 3, 2, 8), cu, 4).shape)
        (6, 2, 8)
    """
    del deterministic
    who = "flash_attn_varlen_qkvpacked_func"
    if not isinstance(qkv, torch.Tensor) or qkv.ndim != 4 or qkv.shape[1] != 3:
        raise fail(who, f"qkv must be (total, 3, nheads, headdim), got {_shape(qkv)}.")
    q, k, v = qkv.unbind(1)
    options = Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    cu, most = (cu_seqlens, cu_seqlens), (max_seqlen, max_seqlen)
    return _varlen(who, q, k, v, ("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"), cu, most, options)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q (total_q, nheads, headdim), ``kv``
    (total_k, 2, nheads_k, headdim); otherwise :func:`flash_attn_varlen_func`.

    Example:
        >>> import torch
        >>> cu_q, cu_k = torch.tensor([0, 1, 3]), torch.tensor([0, 4, 9])
        >>> out = flash_attn_varlen_kvpacked_func(
        ...     torch.randn(3, 2, 8), torch.randn(9, 2, 1, 8), cu_q, cu_k, 2, 5)
        >>> tuple(out.shape)
        (3, 2, 8)
    """
    del deterministic
    who = "flash_attn_varlen_kvpacked_func"
    if not isinstance(kv, torch.Tensor) or kv.ndim != 4 or kv.shape[1] != 2:
        raise fail(who, f"kv must be (total_k, 2, nheads_k, headdim), got {_shape(kv)}.")
    k, v = kv.unbind(1)
    options = Options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    cu, most = (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)
    return _varlen(who, q, k, v, ("q", "kv[:, 0]", "kv[:, 1]"), cu, most, options)
