"""Split-KV decoding (``qkv.kernels._decode``) and ``flash_attn_with_kvcache`` decoding with
a paged cache, against a float64 reference written here; and a Hugging Face model's generate
loop run through ``flash_attn_with_kvcache`` on :class:`qkv.nn.PagedKVCache`.

Expectations ported (read, not copied) from Dao-AILab/flash-attention
``tests/test_flash_attn.py::test_flash_attn_kvcache`` (paged cache from a random
``block_table``, ``cache_seqlens`` per row, causal bottom-right, GQA/MQA, new keys written in
place; float32 within a few times the float32 reference's own error of the float64
reference) and from its ``test_flash_attn_splitkv`` (the output does not depend on how the
keys are split: ``num_splits``). float64 inputs must agree with the reference to 1e-12.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import qkv
from qkv.flash_attn import flash_attn_with_kvcache
from qkv.kernels import set_thread_mode
from qkv.kernels._decode import decode_attention, partition_keys, runs_of_pages, segments
from qkv.nn import PagedKVCache


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: list[int],
    ends: list[int],
    causal: bool,
    scale: float | None = None,
    left: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64, row by row: q (B, Lq, H, D), k/v (B, S, Hkv, D);
    row b sees positions starts[b] ≤ j < ends[b] (and j ≤ ends[b] − Lq + i if causal,
    j ≥ ends[b] − Lq + i − left with a window).
    Returns out (B, Lq, H, Dv) and the natural log-sum-exp (B, H, Lq), −inf without keys."""
    batch, lq, heads, dim = q.shape
    group = heads // k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(batch, lq, heads, v.shape[3], dtype=torch.float64)
    lse = torch.full((batch, heads, lq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        keys = k[b].double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, S, D)
        values = v[b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[b].double().transpose(0, 1) @ keys.transpose(1, 2) * scale  # (H, Lq, S)
        j, i = torch.arange(k.shape[1]), torch.arange(lq)[:, None]
        seen = (j >= starts[b]) & (j < ends[b])
        if causal:
            seen = seen & (j <= ends[b] - lq + i)
        if left is not None:
            seen = seen & (j >= ends[b] - lq + i - left)
        scores = scores.masked_fill(~seen, -math.inf)
        lse[b] = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse[b][..., None]).nan_to_num(0.0)
        out[b] = (weights @ values).transpose(0, 1)
    return out, lse


def _inputs(
    gen: torch.Generator, dtype: torch.dtype, batch: int, lq: int, heads: int, kv_heads: int,
    size: int, dim: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    q = torch.randn(batch, lq, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, size, kv_heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, size, kv_heads, dim, generator=gen, dtype=dtype)
    return q, k, v


CASES = [  # (Lq, H, Hkv, causal)
    (1, 4, 4, True),  # MHA, one token
    (1, 6, 2, False),  # GQA
    (3, 6, 1, True),  # MQA, a few tokens, causal within them
    (2, 4, 2, False),
]


@pytest.mark.parametrize(("lq", "heads", "kv_heads", "causal"), CASES)
@pytest.mark.parametrize("partition", [16, 64, None])
def test_split_kv_float64_is_exact(
    lq: int, heads: int, kv_heads: int, causal: bool, partition: int | None
) -> None:
    gen = torch.Generator().manual_seed(lq * 100 + heads + kv_heads)
    q, k, v = _inputs(gen, torch.float64, 3, lq, heads, kv_heads, 300)
    starts, ends = [0, 7, 0], [300, 131, lq]  # a full row, a left-padded one, a short one
    out, lse = decode_attention(
        q, k, v, starts=starts, ends=ends, causal=causal, partition=partition, return_lse=True
    )
    want, want_lse = reference(q, k, v, starts, ends, causal)
    assert out.dtype == torch.float64 and out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert lse is not None
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_split_kv_paged_float64_is_exact_and_pages_past_the_end_never_count() -> None:
    gen = torch.Generator().manual_seed(1)
    q, _, _ = _inputs(gen, torch.float64, 3, 1, 6, 2, 1)
    size, blocks = 16, 40
    pages_k = torch.randn(blocks, size, 2, 16, generator=gen, dtype=torch.float64)
    pages_v = torch.randn(blocks, size, 2, 16, generator=gen, dtype=torch.float64)
    table = torch.randperm(blocks, generator=gen)[:36].view(3, 12)
    ends = [190, 17, 1]
    # pages past each row's end hold NaN (stale, or never written): none may reach the output
    for b, end in enumerate(ends):
        for page in table[b, -(-end // size) :].tolist():
            pages_k[page], pages_v[page] = math.nan, math.nan
    out, _ = decode_attention(q, pages_k, pages_v, ends=ends, block_table=table, partition=32)
    k, v = pages_k[table].flatten(1, 2), pages_v[table].flatten(1, 2)
    want, _ = reference(q, k.nan_to_num(), v.nan_to_num(), [0, 0, 0], ends, False)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_split_kv_float32_within_the_float32_reference_error() -> None:
    """flash-attn's rule: the error against the float64 reference at most a few times that
    of the same reference computed in float32."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = _inputs(gen, torch.float32, 2, 1, 8, 2, 2048, dim=64)
    ends = [2048, 1500]
    out, _ = decode_attention(q, k, v, ends=ends, partition=256)
    exact, _ = reference(q, k, v, [0, 0], ends, True)
    group = 4
    same = torch.stack(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1].transpose(1, 2),
                k[b : b + 1, : ends[b]].repeat_interleave(group, 2).transpose(1, 2),
                v[b : b + 1, : ends[b]].repeat_interleave(group, 2).transpose(1, 2),
            )[0].transpose(0, 1)
            for b in range(2)
        ]
    )
    base = (same.double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 3 * base + 1e-6


def test_split_kv_row_without_keys_gives_zero_and_lse_minus_inf() -> None:
    q, k, v = _inputs(torch.Generator().manual_seed(3), torch.float64, 2, 1, 2, 2, 50)
    out, lse = decode_attention(q, k, v, ends=[0, 50], return_lse=True)
    assert lse is not None
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(torch.all(lse[0] == -math.inf))
    want, _ = reference(q, k, v, [0, 0], [0, 50], False)
    torch.testing.assert_close(out[1], want[1], rtol=0, atol=1e-12)


def test_split_kv_same_bits_in_every_thread_mode_and_partition_plan() -> None:
    """flash-attn's splitkv test: the split does not change the result (here: to the bit
    across thread modes, and within float64 rounding across partition sizes)."""
    q, k, v = _inputs(torch.Generator().manual_seed(4), torch.float64, 2, 1, 4, 2, 1000)
    results = {}
    for mode in ("torch", "pool"):
        previous = set_thread_mode(mode)
        try:
            results[mode], _ = decode_attention(q, k, v, ends=[1000, 333], partition=64)
        finally:
            set_thread_mode(previous)
    assert torch.equal(results["torch"], results["pool"])
    other, _ = decode_attention(q, k, v, ends=[1000, 333], partition=512)
    torch.testing.assert_close(other, results["torch"], rtol=0, atol=1e-13)


def test_partition_keys_fits_pages_and_memory() -> None:
    keys = partition_keys(8, 128, 4)
    assert keys * 2 * 8 * 128 * 4 <= 16 << 20 < 2 * keys * 2 * 8 * 128 * 4  # about 16 MiB
    assert partition_keys(8, 128, 4, block=96) % 96 == 0
    assert partition_keys(64, 256, 8) == 64 == partition_keys(128, 256, 8)  # never below 64


def test_segments_cover_each_row_and_nothing_else() -> None:
    plan = segments([0, 5, 3], [10, 7, 3], 4)
    assert [(s.row, s.lo, s.hi) for s in plan] == [(0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 5, 7)]
    pieces = runs_of_pages(segments([0, 2], [12, 9], 8), [[3, 4, 9], [0, 2, 3]], 4)
    assert [(s.row, s.lo, s.hi) for s in pieces] == [
        (0, 0, 8), (0, 8, 12), (1, 2, 4), (1, 4, 8), (1, 8, 9)
    ]  # fmt: skip


def test_split_kv_big_pages_out_of_order_are_read_in_place_and_exact() -> None:
    """Pages of 256 KiB of K and V: each run of consecutive pages is one view, no gather."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 4, 128, generator=gen, dtype=torch.float64)
    pages_k = torch.randn(9, 64, 2, 128, generator=gen, dtype=torch.float64)
    pages_v = torch.randn(9, 64, 2, 128, generator=gen, dtype=torch.float64)
    table = torch.tensor([[5, 6, 0, 8], [1, 2, 3, 4]])
    out, lse = decode_attention(
        q, pages_k, pages_v, ends=[230, 256], block_table=table, return_lse=True
    )
    k, v = pages_k[table].flatten(1, 2), pages_v[table].flatten(1, 2)
    want, want_lse = reference(q, k, v, [0, 0], [230, 256], False)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert lse is not None
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


# -- flash_attn_with_kvcache on a paged cache ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kvcache_paged_decoding_loop_of_different_lengths(dtype: torch.dtype) -> None:
    """Three sequences of different lengths decode together through flash_attn_with_kvcache
    and a PagedKVCache's arguments; each step equals the float64 reference over its own
    sequence, and the pool holds exactly the keys written."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, size = 6, 2, 16, 8
    prompts = [11, 3, 20]
    cache = PagedKVCache(16, size, kv_heads, dim, dtype=dtype)
    total = [max(prompts) + 4 for _ in prompts]
    keys = [torch.randn(1, n, kv_heads, dim, generator=gen, dtype=dtype) for n in total]
    values = [torch.randn(1, n, kv_heads, dim, generator=gen, dtype=dtype) for n in total]
    queries = [torch.randn(1, n, heads, dim, generator=gen, dtype=dtype) for n in total]
    seqs = []
    for s, n in enumerate(prompts):  # prefill each prompt alone (its own block table)
        seqs.append(cache.add_sequence())
        cache.use([seqs[-1]])
        out = flash_attn_with_kvcache(
            queries[s][:, :n], k=keys[s][:, :n], v=values[s][:, :n], causal=True,
            **cache.kvcache_args(n),
        )  # fmt: skip
        want, _ = reference(queries[s][:, :n], keys[s], values[s], [0], [n], True)
        torch.testing.assert_close(out.double(), want, **_tolerance(dtype))
    cache.use(seqs)
    for step in range(4):
        at = [n + step for n in prompts]
        q = torch.cat([queries[s][:, i : i + 1] for s, i in enumerate(at)])
        k = torch.cat([keys[s][:, i : i + 1] for s, i in enumerate(at)])
        v = torch.cat([values[s][:, i : i + 1] for s, i in enumerate(at)])
        args = cache.kvcache_args(1)
        out, lse = flash_attn_with_kvcache(
            q, k=k, v=v, causal=True, return_softmax_lse=True, **args
        )
        for s, i in enumerate(at):
            want, want_lse = reference(q[s : s + 1], keys[s], values[s], [0], [i + 1], True)
            torch.testing.assert_close(out[s : s + 1].double(), want, **_tolerance(dtype))
            torch.testing.assert_close(lse[s : s + 1].double(), want_lse, **_tolerance(dtype))
    assert cache.lengths == [n + 4 for n in prompts]
    for s, seq in enumerate(seqs):  # the pool holds each sequence's keys, page by page
        table = cache.block_table([seq])[0].long()
        held = cache.k_cache[table].flatten(0, 1)[: cache.length(seq)]
        assert torch.equal(held, keys[s][0, : cache.length(seq)])


def _tolerance(dtype: torch.dtype) -> dict[str, Any]:
    return {"rtol": 0, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 2e-6}


def test_kvcache_decode_path_equals_the_general_path_and_traces_pages() -> None:
    """Outside a trace the split-KV kernel runs; inside one, qkv's attention records the
    steps: the two agree, and the call's meta lists the pages each row read."""
    gen = torch.Generator().manual_seed(6)
    k_cache = torch.randn(12, 4, 2, 8, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(12, 4, 2, 8, generator=gen, dtype=torch.float64)
    table = torch.tensor([[3, 7, 1], [0, 11, 5]], dtype=torch.int32)
    lengths = torch.tensor([9, 4], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 8, generator=gen, dtype=torch.float64)
    fast = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True
    )
    with qkv.tracing() as trace:
        traced = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True
        )
    torch.testing.assert_close(fast, traced, rtol=0, atol=1e-12)
    assert trace.calls[-1].meta["pages"] == {"block_size": 4, "blocks": [[3, 7, 1], [0]]}
    assert "weights" in trace


# -- a Hugging Face model's generate loop on a paged cache ---------------------------------


def test_hf_generate_through_flash_attn_with_kvcache_on_paged_caches() -> None:
    """A tiny Llama (GQA, RoPE) generates greedily with an attention function that writes
    each layer's new keys into a PagedKVCache and attends through flash_attn_with_kvcache
    (prefill and every decode step); its tokens equal those of its own SDPA generate."""
    import transformers

    from tests.support.hf_models import VOCAB

    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    caches = [PagedKVCache(16, 4, 2, 8) for _ in range(2)]
    reads: list[int] = []

    def paged_attention(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **_: Any,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        new = int(query.shape[2])  # HF's own cache appended them last: (B, Hkv, Lk, D)
        cache = caches[module.layer_idx]
        out = flash_attn_with_kvcache(
            query.transpose(1, 2),
            k=key[:, :, -new:].transpose(1, 2),
            v=value[:, :, -new:].transpose(1, 2),
            softmax_scale=scaling,
            causal=True,
            **cache.kvcache_args(new),
        )
        reads.append(new)
        return out, None

    transformers.AttentionInterface.register("qkv_paged_test", paged_attention)
    prompt = torch.tensor([[VOCAB[w] for w in ["the", "quick", "brown", "fox", "jumps"]]] * 2)
    prompt[1, 2] = VOCAB["dog"]  # two different prompts of one length
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        model.set_attn_implementation("qkv_paged_test")
        for cache in caches:
            cache.use([cache.add_sequence(), cache.add_sequence()])
        got = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(got, expected)
    assert reads[:2] == [5, 5] and set(reads[2:]) == {1}  # prefill, then one token a step
    assert caches[0].lengths == [5 + 7, 5 + 7]  # the last token is never fed back
