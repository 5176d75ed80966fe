"""flash-attn's ``flash_attn_with_kvcache``: append to a KV cache in place, then attend.

Each batch row b reads cache row ``cache_batch_idx[b]`` (default b). Its keys are the cache
positions ``cache_leftpad[b]`` (default 0) up to ``cache_seqlens[b]`` plus the new ones, and
causal masks, windows and ALiBi are aligned to the end of that span, as flash-attn does.
With ``block_table`` the cache is paged: rows read and write their pages through it.

A decode step (a few query tokens, causal or not, without ALiBi, softcap or a local window,
no gradient, on the CPU) runs the split-KV kernel (:mod:`qkv.kernels._decode`) on the cache
where it lies; inside a ``qkv.tracing`` block the call runs qkv's attention, which records its
steps, and the call's meta lists the pages each row read (``pages``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qkv.flash_attn._core import (
    Positions,
    attend,
    check_block_table,
    check_dtypes,
    check_heads,
    described,
    fail,
    integers,
    window,
)
from qkv.kernels._decode import decode_attention
from qkv.masks import from_function
from qkv.trace import blocks_open, current_trace

__all__ = ["apply_rotary", "flash_attn_with_kvcache"]

_WHO = "flash_attn_with_kvcache"


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """Rotary embedding of x (B, S, H, D) at ``positions`` (B, S), on its first
    ``2 · cos.shape[1]`` dims, as flash-attn's ``apply_rotary_emb`` (computed in float32, or
    float64 for float64 inputs; the rest of each head passes unchanged).

    ``interleaved``: pairs (0, 1), (2, 3), … (GPT-J); else (i, i + rotary_dim / 2) (GPT-NeoX).

    Example:
        >>> import torch
        >>> x = torch.tensor([[[[1.0, 0.0]]]])                  # (1, 1, 1, 2)
        >>> angle = torch.tensor([[torch.pi / 2]])               # one position, one pair
        >>> apply_rotary(x, angle.cos(), angle.sin(), torch.zeros(1, 1, dtype=torch.long),
        ...              interleaved=True).round(decimals=6)
        tensor([[[[0., 1.]]]])
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = int(cos.shape[1])
    c = cos.to(compute)[positions][:, :, None, :]  # (B, S, 1, rd/2)
    s = sin.to(compute)[positions][:, :, None, :]
    rot, rest = x[..., : 2 * half].to(compute), x[..., 2 * half :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


def _per_row(value: Any, name: str, batch: int, device: Any, default: int) -> torch.Tensor:
    """An int or (batch,) integer tensor as an int64 (batch,) tensor."""
    if value is None:
        return torch.full((batch,), default, dtype=torch.int64, device=device)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=torch.int64, device=device)
    if not integers(value, 1, batch):
        raise fail(
            _WHO,
            f"{name} must be an integer tensor of shape ({batch},), one entry per batch row, "
            f"got {described(value)}. Hint: torch.tensor([...], dtype=torch.int32).",
        )
    return value.to(device=device, dtype=torch.int64)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_with_kvcache``, the paged cache included.

    q is (batch, seqlen_q, nheads, headdim); k_cache and v_cache (batch_cache, seqlen_cache,
    nheads_k, headdim), or with ``block_table`` (batch, max_num_blocks_per_seq) a paged cache
    (num_blocks, page_block_size, nheads_k, headdim): position p of row b is at offset
    p mod page_block_size of page ``block_table[b, p // page_block_size]``.
    Given ``k`` and ``v`` (batch, seqlen_new, nheads_k, headdim), they
    are written into the cache *in place* at ``cache_seqlens`` (rotated first when
    ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2) are given; q is rotated at
    the same positions, or all at ``cache_seqlens`` unless causal or local). Row b then
    attends to cache positions ``cache_leftpad[b]`` … ``cache_seqlens[b] + seqlen_new − 1``
    of cache row ``cache_batch_idx[b]``. ``num_splits`` is accepted and changes nothing.

    Returns:
        out (batch, seqlen_q, nheads, headdim); with ``return_softmax_lse``, also the
        log-sum-exp (batch, nheads, seqlen_q), as :func:`flash_attn_func` returns it.

    Example:
        >>> import torch
        >>> k_cache, v_cache = torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4)
        >>> lengths = torch.tensor([3], dtype=torch.int32)
        >>> q, k, v = (torch.randn(1, 1, 2, 4) for _ in range(3))
        >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
        >>> bool(torch.equal(k_cache[0, 3], k[0, 0]))             # appended at position 3
        True
    """
    del num_splits
    check_dtypes(_WHO, q=q, k_cache=k_cache, v_cache=v_cache)
    if (k is None) != (v is None):
        raise fail(_WHO, "k and v come together: got only one of them. Hint: pass both or neither.")
    if k is not None and v is not None:
        check_dtypes(_WHO, q=q, k=k, v=v)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and x.ndim != 4:
            raise fail(
                _WHO,
                f"{name} must have 4 dims (batch, seqlen, nheads, headdim), got shape "
                f"{tuple(x.shape)}. Hint: a paged cache is (num_blocks, page_block_size, "
                "nheads_k, headdim), with block_table.",
            )
    batch, seqlen_q, heads, dim = (int(n) for n in q.shape)
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != dim:
        raise fail(
            _WHO,
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one "
            f"shape (batch_cache, seqlen_cache, nheads_k, {dim}), q's headdim last.",
        )
    check_heads(_WHO, heads, int(k_cache.shape[2]), "k_cache")
    rows_cache, seqlen_cache, kv_heads = (int(n) for n in k_cache.shape[:3])
    table: torch.Tensor | None = None
    if block_table is not None:  # k_cache is (num_blocks, page_block_size, nheads_k, headdim)
        table = _block_table(block_table, batch, cache_batch_idx, cache_leftpad, q.device)
        seqlen_cache = int(table.shape[1]) * int(k_cache.shape[1])
    new = 0
    if k is not None and v is not None:
        expected = (batch, int(k.shape[1]), kv_heads, dim)
        if tuple(k.shape) != expected or k.shape != v.shape:
            raise fail(
                _WHO,
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch, seqlen_new, "
                f"nheads_k, headdim) = (*, *, {kv_heads}, {dim}) with q's batch {batch}.",
            )
        new = int(k.shape[1])
    device = q.device
    lengths = _per_row(cache_seqlens, "cache_seqlens", batch, device, seqlen_cache - new)
    if cache_seqlens is None and new:
        raise fail(
            _WHO,
            "k and v are appended at cache_seqlens, which is missing. Hint: "
            "cache_seqlens=torch.tensor([...], dtype=torch.int32), the tokens each row holds.",
        )
    rows = _per_row(cache_batch_idx, "cache_batch_idx", batch, device, 0)
    if cache_batch_idx is None and table is None:
        rows = torch.arange(batch, device=device)
        if rows_cache < batch:
            raise fail(
                _WHO,
                f"k_cache has {rows_cache} rows but q has batch {batch}. Hint: "
                "cache_batch_idx picks a cache row for each batch row.",
            )
    leftpad = _per_row(cache_leftpad, "cache_leftpad", batch, device, 0)
    ends = lengths + new
    if table is None:
        _check_ranges(rows, rows_cache, lengths, ends, leftpad, seqlen_cache)
    else:
        _check_pages(table, rows_cache, int(k_cache.shape[1]), lengths, ends)
    left, right = window(_WHO, window_size, causal)
    if k is not None and v is not None:
        if rotary_cos is not None or rotary_sin is not None:
            k, q = _rotate(
                q,
                k,
                rotary_cos,
                rotary_sin,
                lengths,
                causal or left is not None or right is not None,
                rotary_interleaved,
            )
        with torch.no_grad():
            slots = lengths[:, None] + torch.arange(new, device=device)  # (B, new)
            where_rows: Any = rows[:, None]
            if table is not None:  # position p of row b is in page table[b, p // size]
                size = int(k_cache.shape[1])
                where_rows, slots = table.gather(1, slots // size), slots % size
            k_cache[where_rows, slots] = k.detach().to(k_cache.dtype)
            v_cache[where_rows, slots] = v.detach().to(v_cache.dtype)
    if _decodes(q, k_cache, seqlen_q, right, softcap, alibi_slopes):
        out, lse = decode_attention(
            q,
            k_cache,
            v_cache,
            ends=ends.tolist(),
            starts=None if cache_leftpad is None else leftpad.tolist(),
            rows=None if cache_batch_idx is None else rows.tolist(),
            block_table=table,
            scale=_scale(softmax_scale, dim),
            causal=right == 0,
            left=left,
            return_lse=return_softmax_lse,
        )
        if lse is None:
            return out
        return out, torch.where(lse == -math.inf, math.inf, lse)  # flash-attn: +inf, no key
    if table is not None:  # the pages of each row, one after another (unused pages: any)
        pages = table.clamp(0, rows_cache - 1)
        keys, values = k_cache[pages].flatten(1, 2), v_cache[pages].flatten(1, 2)
    elif cache_batch_idx is None and rows_cache == batch:
        keys, values = k_cache, v_cache
    else:
        keys, values = k_cache[rows], v_cache[rows]
    where = _cache_positions(batch, seqlen_q, seqlen_cache, ends, leftpad, left, right)
    result = attend(
        _WHO,
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        where,
        softmax_scale=softmax_scale,
        kernel_causal=(left is None or left >= seqlen_cache) and right == 0,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=0.0,
        want_lse=return_softmax_lse,
        want_probs=False,
    )
    out = result.out.transpose(1, 2).contiguous()
    trace = current_trace() if blocks_open() else None
    if trace is not None and table is not None:  # the pages each row read, in the call's meta
        size = int(k_cache.shape[1])
        used = [row[: -(-e // size)] for row, e in zip(table.tolist(), ends.tolist(), strict=True)]
        trace.amend_last_call({}, pages={"block_size": size, "blocks": used})
    return (out, result.lse) if return_softmax_lse else out


def _decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    seqlen_q: int,
    right: int | None,
    softcap: Any,
    alibi_slopes: Any,
) -> bool:
    """Whether the split-KV kernel runs the call: a decode step it computes exactly (keys
    up to the query's own position or all of them, with or without a window on the left)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad)
    return (
        q.device.type == "cpu"
        and seqlen_q <= 16
        and right in (None, 0)
        and not softcap
        and alibi_slopes is None
        and not grad
        and not blocks_open()
        and not torch.compiler.is_compiling()
    )


def _scale(softmax_scale: Any, dim: int) -> float:
    if isinstance(softmax_scale, bool) or not (
        softmax_scale is None or isinstance(softmax_scale, int | float)
    ):
        raise fail(_WHO, f"softmax_scale must be a number or None, got {softmax_scale!r}.")
    scale = float(dim**-0.5 if softmax_scale is None else softmax_scale)
    if not math.isfinite(scale):
        raise fail(_WHO, f"softmax_scale must be finite, got {softmax_scale!r}.")
    return scale


def _block_table(
    block_table: Any, batch: int, cache_batch_idx: Any, cache_leftpad: Any, device: Any
) -> torch.Tensor:
    """The checked ``block_table`` (batch, max_num_blocks_per_seq) as int64."""
    check_block_table(_WHO, block_table, batch)
    for name, given in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if given is not None:
            raise fail(
                _WHO,
                f"{name} cannot be combined with block_table (neither can flash-attn's). "
                "Hint: a paged cache picks each row's pages through block_table alone.",
            )
    table: torch.Tensor = block_table  # checked above
    return table.to(device=device, dtype=torch.int64)


def _check_pages(
    table: torch.Tensor, num_blocks: int, size: int, lengths: torch.Tensor, ends: torch.Tensor
) -> None:
    """Each row's length fits its block_table row, and the pages it uses exist."""
    capacity = int(table.shape[1]) * size
    rows, lo, e = table.tolist(), lengths.tolist(), ends.tolist()
    for b in range(len(rows)):
        if lo[b] < 0 or e[b] > capacity:
            raise fail(
                _WHO,
                f"cache_seqlens[{b}] = {lo[b]} plus {e[b] - lo[b]} new tokens does not fit "
                f"block_table's {table.shape[1]} pages of {size} ({capacity} positions). Hint: "
                "give the row more pages.",
            )
        used = rows[b][: -(-e[b] // size)]
        bad = [n for n in used if not 0 <= n < num_blocks]
        if bad:
            raise fail(
                _WHO,
                f"block_table[{b}] holds page {bad[0]}, outside the cache's {num_blocks} "
                "pages (k_cache.shape[0]).",
            )


def _check_ranges(
    rows: torch.Tensor,
    rows_cache: int,
    lengths: torch.Tensor,
    ends: torch.Tensor,
    leftpad: torch.Tensor,
    seqlen_cache: int,
) -> None:
    """Cache rows, lengths and left padding inside the cache (one read to the host)."""
    r, lo, e, lp = (t.tolist() for t in (rows, lengths, ends, leftpad))
    for b in range(len(r)):
        if not 0 <= r[b] < rows_cache:
            raise fail(
                _WHO,
                f"cache_batch_idx[{b}] = {r[b]} is outside the cache's {rows_cache} rows.",
            )
        if lo[b] < 0 or e[b] > seqlen_cache:
            raise fail(
                _WHO,
                f"cache_seqlens[{b}] = {lo[b]} plus {e[b] - lo[b]} new tokens does not fit the "
                f"cache's {seqlen_cache} positions. Hint: allocate the cache for the longest "
                "sequence.",
            )
        if not 0 <= lp[b] <= lo[b]:
            raise fail(
                _WHO,
                f"cache_leftpad[{b}] = {lp[b]} must be between 0 and cache_seqlens[{b}] = "
                f"{lo[b]}: the padding is part of the length.",
            )


def _rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: Any,
    sin: Any,
    lengths: torch.Tensor,
    in_order: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k rotated at cache_seqlens + 0, 1, …; q likewise when ``in_order`` (causal or local),
    else all of its rows at cache_seqlens."""
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        raise fail(_WHO, "rotary_cos and rotary_sin come together: got only one of them.")
    half = int(cos.shape[1]) if cos.ndim == 2 else -1
    if cos.shape != sin.shape or half < 1 or 2 * half > q.shape[3]:
        raise fail(
            _WHO,
            f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must be one "
            f"shape (seqlen_ro, rotary_dim / 2) with rotary_dim ≤ headdim {q.shape[3]}.",
        )
    new, seqlen_q = int(k.shape[1]), int(q.shape[1])
    device = q.device
    q_steps = (
        torch.arange(seqlen_q, device=device)
        if in_order
        else torch.zeros(seqlen_q, dtype=torch.int64, device=device)
    )
    k_pos = lengths[:, None] + torch.arange(new, device=device)
    q_pos = lengths[:, None] + q_steps
    last = int(torch.maximum(k_pos.max(), q_pos.max()))
    if last >= cos.shape[0]:
        raise fail(
            _WHO,
            f"rotary_cos has {cos.shape[0]} positions but position {last} is rotated. Hint: "
            "make it as long as the cache.",
        )
    cos, sin = cos.to(device), sin.to(device)
    return (
        apply_rotary(k, cos, sin, k_pos, interleaved),
        apply_rotary(q, cos, sin, q_pos, interleaved),
    )


def _cache_positions(
    batch: int,
    seqlen_q: int,
    seqlen_cache: int,
    ends: torch.Tensor,
    leftpad: torch.Tensor,
    left: int | None,
    right: int | None,
) -> Positions:
    """Row b's keys: cache positions leftpad[b] … ends[b] − 1, aligned to ends[b]."""
    device = ends.device
    j = torch.arange(seqlen_cache, device=device)
    inside = (j >= leftpad[:, None]) & (j < ends[:, None])  # (B, Lk)
    seq_k = torch.where(inside, torch.arange(batch, device=device)[:, None], -1)
    rel_q = (torch.arange(seqlen_q, device=device) - seqlen_q).expand(batch, seqlen_q)
    rel_k = j - ends[:, None]

    def visible(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        keep = seq_k[b, kv] >= 0
        offset_q, offset_k = rel_q[b, qi], rel_k[b, kv]
        if left is not None:
            keep = keep & (offset_k >= offset_q - left)
        if right is not None:
            keep = keep & (offset_k <= offset_q + right)
        return keep

    first, last = leftpad.cpu().numpy(), ends.cpu().numpy()

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any) -> tuple[Any, Any]:
        lo, end = first[b], last[b]  # (B, 1, 1, 1)
        shift = end - seqlen_q  # query i sits at key position i + shift
        some = (k0 < end) & (k1 - 1 >= lo)
        every = (k0 >= lo) & (k1 - 1 < end)
        if left is not None:
            some = some & (k1 - 1 >= q0 + shift - left)
            every = every & (k0 >= q1 - 1 + shift - left)
        if right is not None:
            some = some & (k0 <= q1 - 1 + shift + right)
            every = every & (k1 - 1 <= q0 + shift + right)
        return some, every

    return Positions(
        seq_q=torch.arange(batch, device=device)[:, None].expand(batch, seqlen_q),
        rel_q=rel_q,
        seq_k=seq_k,
        rel_k=rel_k,
        keys_q=(ends - leftpad)[:, None].expand(batch, seqlen_q),
        sequences=batch,
        mask=from_function(visible, "flash_attn kv cache", blocks=blocks),
    )


flash_attn_with_kvcache = torch.compiler.disable(  # type: ignore[no-untyped-call]
    flash_attn_with_kvcache,
    reason="flash_attn_with_kvcache reads cache_seqlens to place the new keys and writes the "
    "cache in place: it runs outside the compiled graph",
)
