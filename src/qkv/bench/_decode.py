"""The ``decode`` section of ``qkv bench``: decoding with a KV cache, and packed prefill.

Three cases, each with ratios to its own reference peer, measured in one run:

- ``kv-cache`` (reference ``recompute``): one step with :class:`qkv.nn.KVCache` against
  recomputing causal attention over every token;
- ``gqa`` (reference ``cache-read``): one decode step (one query token, GQA with 32 query
  and 8 key/value heads of 128, float32) over a cache of N tokens. ``cache-read`` sums the
  same K and V once (the memory floor); ``split-kv`` is ``qkv.flash_attn
  .flash_attn_with_kvcache`` on a contiguous cache (B, N, Hkv, D), ``split-kv-paged`` the
  same on pages of 256 in a shuffled ``block_table``; ``sdpa`` is torch's SDPA with
  ``enable_gqa`` on the contiguous cache (B, Hkv, N, D); ``flex-compiled-paged`` torch's
  compiled ``flex_attention`` on the same pages, through torch's ``PagedAttention`` block
  mask (its layout (1, Hkv, pages·256, D), the same page table);
- ``packed`` (reference ``sdpa-loop``): causal prefill of 8 documents of different lengths
  (N tokens in all, 8 heads of 64) through ``flash_attn_varlen_func`` against the hand-written
  fallback (SDPA once per document, as sglang's) and SDPA on the batch padded to the longest.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from qkv.attention import scaled_dot_product_attention
from qkv.bench._measure import (
    causal_share,
    compiled_flex,
    forward_flops,
    inputs,
    medians,
    ratios,
    timed,
)
from qkv.bench._results import Row, Settings, Table
from qkv.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from qkv.kernels._compiled_forward import REPEATS
from qkv.kernels._native import library, why_not
from qkv.nn import KVCache

__all__ = [
    "DECODE_HEADS",
    "decode_section",
    "flex_paged",
    "gqa_cache",
    "gqa_rows",
    "packed_documents",
    "packed_rows",
]

DECODE_HEADS = (32, 8, 128)  # query heads, key/value heads, head dim: a Llama-like GQA layer
PAGE = 256


def gqa_cache(length: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """One decode step's inputs: q (1, 1, H, D), the cache (1, N, Hkv, D) contiguous and
    as pages (N / 256, 256, Hkv, D) under a shuffled block table (1, N / 256)."""
    heads, kv_heads, dim = DECODE_HEADS
    gen = torch.Generator().manual_seed(seed)
    pages = -(-length // PAGE)
    k = torch.randn(1, pages * PAGE, kv_heads, dim, generator=gen)
    v = torch.randn(1, pages * PAGE, kv_heads, dim, generator=gen)
    table = torch.randperm(pages, generator=gen).view(1, pages).int()
    k_pages, v_pages = (
        torch.empty(pages, PAGE, kv_heads, dim),
        torch.empty(pages, PAGE, kv_heads, dim),
    )
    k_pages[table[0].long()] = k.view(pages, PAGE, kv_heads, dim)
    v_pages[table[0].long()] = v.view(pages, PAGE, kv_heads, dim)
    return {
        "q": torch.randn(1, 1, heads, dim, generator=gen),
        "k": k[:, :length].contiguous(),
        "v": v[:, :length].contiguous(),
        "k_pages": k_pages,
        "v_pages": v_pages,
        "table": table,
        "lengths": torch.tensor([length], dtype=torch.int32),
    }


def flex_paged(case: dict[str, torch.Tensor], length: int) -> Callable[[], Any]:
    """Compiled ``flex_attention`` decoding over ``case``'s pages (torch's ``PagedAttention``:
    a logical block mask of the sequence's length turned into one over physical pages)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    pages_k, pages_v, table = case["k_pages"], case["v_pages"], case["table"].long()
    count, _, kv_heads, dim = pages_k.shape
    paged = PagedAttention(int(count), PAGE, 1, device="cpu")
    paged.reserve(torch.tensor(0), torch.tensor(int(table.shape[1]) * PAGE))
    paged.page_table[0, : table.shape[1]] = table[0]
    paged.physical_to_logical[0] = -1
    paged.physical_to_logical[0, table[0]] = torch.arange(int(table.shape[1]))
    k = pages_k.permute(2, 0, 1, 3).reshape(1, kv_heads, -1, dim)  # its layout, made once
    v = pages_v.permute(2, 0, 1, 3).reshape(1, kv_heads, -1, dim)
    lengths = case["lengths"].long()

    def inside(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lengths[b]

    logical = create_block_mask(
        inside, 1, None, 1, int(table.shape[1]) * PAGE, device="cpu", BLOCK_SIZE=PAGE
    )
    physical = paged.convert_logical_block_mask(logical)
    flex = compiled_flex()
    q = case["q"].transpose(1, 2)  # (1, H, 1, D)
    return lambda: flex(q, k, v, block_mask=physical, enable_gqa=True)


def packed_documents(total: int, *, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """8 document lengths summing to ``total`` (from a quarter to twice the mean), and
    q, k, v packed as (total, 3, 8, 64)."""
    gen = torch.Generator().manual_seed(seed)
    shares = torch.rand(8, generator=gen) * 1.75 + 0.25
    lengths = [max(1, int(total * s / shares.sum())) for s in shares]
    lengths[-1] += total - sum(lengths)
    return lengths, torch.randn(total, 3, 8, 64, generator=gen)


def packed_rows(total: int, repeats: int) -> list[Row]:
    lengths, qkv_packed = packed_documents(total)
    q, k, v = qkv_packed.unbind(1)  # (T, 8, 64) each
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(lengths)
    starts = cu[:-1].tolist()
    padded = torch.zeros(3, len(lengths), 8, longest, 64)
    keep = torch.zeros(len(lengths), 1, longest, longest, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        padded[:, i, :, :n] = qkv_packed[s : s + n].permute(1, 2, 0, 3)
        keep[i, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    keep[:, 0] |= torch.eye(longest, dtype=torch.bool)  # padding rows see themselves: no NaN
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def one(x: torch.Tensor, s: int, n: int) -> torch.Tensor:  # (1, 8, n, 64)
        return x[s : s + n].transpose(0, 1)[None]

    def loop() -> Any:  # the hand-written fallback: one SDPA call per document
        outs = [
            sdpa(one(q, s, n), one(k, s, n), one(v, s, n), is_causal=True)
            for s, n in zip(starts, lengths, strict=True)
        ]
        return torch.cat([o[0].transpose(0, 1) for o in outs])

    def varlen() -> Any:
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)

    runs = {
        "sdpa-loop": loop,
        "sdpa-padded": lambda: sdpa(padded[0], padded[1], padded[2], attn_mask=keep),
        "qkv-varlen": varlen,
    }
    with torch.no_grad():
        for _ in range(REPEATS + 1):  # auto compiles a rule from its third call: not timed
            varlen()
        found = medians(runs, repeats)
    flops = sum(forward_flops(n, n, causal_share(n)) for n in lengths)
    rows = [Row("packed", total, name, found[name], flops) for name in runs]
    for row in rows:
        row.spread = found.spreads[row.peer]
    return rows


def gqa_rows(length: int, repeats: int, *, flex: bool) -> list[Row]:
    case = gqa_cache(length)
    q, k, v, lengths = case["q"], case["k"], case["v"], case["lengths"]
    k_heads, v_heads = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    q_heads = q.transpose(1, 2)
    runs: dict[str, Callable[[], Any]] = {
        "cache-read": lambda: (k.sum(), v.sum()),
        "split-kv": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths),
        "split-kv-paged": lambda: flash_attn_with_kvcache(
            q, case["k_pages"], case["v_pages"], cache_seqlens=lengths, block_table=case["table"]
        ),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q_heads, k_heads, v_heads, enable_gqa=True
        ),
    }
    compile_seconds, failure = None, "not in a --quick run (it compiles for a minute)"
    if flex:
        try:
            compiled = flex_paged(case, length)
            compile_seconds = timed(compiled)
            runs["flex-compiled-paged"] = compiled
        except Exception as error:  # a peer that does not run is a row's note
            failure = f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"
    with torch.no_grad():
        found = medians(runs, max(repeats, 7))
    heads, _, dim = DECODE_HEADS
    flops = 4.0 * heads * length * dim
    rows = []
    names = list(runs) + ([] if "flex-compiled-paged" in runs else ["flex-compiled-paged"])
    for name in names:
        seconds = found.get(name)
        row = Row("gqa", length, name, seconds, flops if name != "cache-read" else 0.0)
        row.spread = found.spreads.get(name)
        if name == "flex-compiled-paged":
            row.compile_seconds = compile_seconds
            row.note = "" if seconds is not None else failure
        elif name.startswith("split-kv") and library("_decode") is None:
            row.note = f"PyTorch's path, no C kernel: {why_not('_decode')[:50]}"
        rows.append(row)
    return rows


def decode_section(settings: Settings, tick: Callable[[], None]) -> Table:
    """One decoding step with a KV cache against recomputing causal attention; a GQA decode
    step against reading the cache, SDPA and compiled Flex on pages; packed prefill."""
    length = settings.decode_length
    q, k, v = inputs(length + 1)
    cache = KVCache()
    with torch.no_grad():
        cache.append(k[:, :, :length], v[:, :, :length])

    def step() -> Any:
        with torch.no_grad():
            keys, values = cache.append(k[:, :, length:], v[:, :, length:])
            return scaled_dot_product_attention(
                q[:, :, length:], keys, values, is_causal=True, causal_alignment="bottom-right"
            )

    def recompute() -> Any:
        with torch.no_grad():
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    step_times = [timed(step) for _ in range(max(settings.repeats, 5) + 1)][1:]
    full = medians({"recompute": recompute}, min(settings.repeats, 2))["recompute"]
    table = Table(
        "decode",
        f"One decoding step, KV cache of {length} tokens; packed prefill",
        "recompute, cache-read, sdpa-loop",
        note=(
            f"kv-cache: append one token to a qkv.nn.KVCache and attend; recompute: causal "
            f"attention over all {length + 1} tokens (qkv auto). gqa: one token, 32 query "
            "and 8 key/value heads of 128; cache-read: a sum over the same K and V; "
            "split-kv(-paged): flash_attn_with_kvcache, contiguous (on pages of 256); "
            "sdpa: torch SDPA enable_gqa; flex-compiled-paged: compiled flex_attention on "
            "the same pages (torch's PagedAttention). packed: 8 causal documents, "
            "flash_attn_varlen_func against one SDPA per document and padded SDPA. ratio: "
            "time / the case's first peer."
        ),
    )
    table.rows.append(
        Row(
            "kv-cache",
            length,
            "recompute",
            full,
            forward_flops(length + 1, length + 1, causal_share(length + 1)),
        )
    )
    table.rows.append(
        Row(
            "kv-cache",
            length,
            "decode",
            statistics.median(step_times),
            forward_flops(1, length + 1),
        )
    )
    table.rows.extend(gqa_rows(length, settings.repeats, flex=not settings.quick))
    table.rows.extend(packed_rows(min(length, 8192), settings.repeats))
    for reference in ("recompute", "cache-read", "sdpa-loop"):
        ratios(table.rows, reference)
    tick()
    return table
