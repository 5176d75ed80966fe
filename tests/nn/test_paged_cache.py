"""``qkv.nn.PagedKVCache``: blocks allocated as sequences grow, freed as they end, and
``MultiHeadAttention`` decoding batches of sequences of different lengths exactly.

The oracle is each sequence's own full causal pass (float64, no cache), as vLLM's paged
attention tests compare against attention over each sequence's contiguous keys.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.nn import KVCache, MultiHeadAttention, PagedKVCache


def _layer(positional: str | None = "rope") -> MultiHeadAttention:
    torch.manual_seed(0)
    return (
        MultiHeadAttention(32, num_heads=4, num_kv_heads=2, positional=positional).double().eval()
    )


def _prefill_each(
    attn: MultiHeadAttention, cache: PagedKVCache, xs: list[torch.Tensor], prompts: list[int]
) -> list[int]:
    seqs = []
    with torch.no_grad():
        for x, n in zip(xs, prompts, strict=True):
            seqs.append(cache.add_sequence())
            attn(x[:, :n], is_causal=True, cache=cache.use([seqs[-1]]))
    return seqs


@pytest.mark.parametrize("positional", ["rope", "alibi", None])
def test_batched_decoding_of_different_lengths_is_exact(positional: str | None) -> None:
    """Prompts of 5, 9 and 2 tokens, prefilled one by one, then decoded together for four
    steps: each row equals its own sequence's full causal pass (RoPE at each row's own
    positions; ALiBi runs the gathered path, the others the split-KV kernel)."""
    attn = _layer(positional)
    prompts, steps = [5, 9, 2], 4
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, n + steps, 32, generator=gen, dtype=torch.float64) for n in prompts]
    with torch.no_grad():
        full = [attn(x, is_causal=True) for x in xs]
    cache = PagedKVCache(20, 4, 2, 8, dtype=torch.float64)
    seqs = _prefill_each(attn, cache, xs, prompts)
    cache.use(seqs)
    with torch.no_grad():
        for step in range(steps):
            x = torch.cat([x[:, n + step : n + step + 1] for x, n in zip(xs, prompts, strict=True)])
            out = attn(x, is_causal=True, cache=cache)
            for b, n in enumerate(prompts):
                torch.testing.assert_close(out[b, 0], full[b][0, n + step], rtol=0, atol=1e-12)
    assert cache.lengths == [n + steps for n in prompts]


def test_a_chunk_of_tokens_per_row_and_weights_take_the_gathered_path() -> None:
    """Two new tokens per row with need_weights: the keys are gathered and aligned to each
    row's end; outputs equal the full pass and each row's weights sum to 1 over its own
    keys only (none on the front padding)."""
    attn = _layer()
    prompts = [3, 7]
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(1, n + 2, 32, generator=gen, dtype=torch.float64) for n in prompts]
    with torch.no_grad():
        full = [attn(x, is_causal=True) for x in xs]
        cache = PagedKVCache(8, 4, 2, 8, dtype=torch.float64)
        cache.use(_prefill_each(attn, cache, xs, prompts))
        x = torch.cat([x[:, n:] for x, n in zip(xs, prompts, strict=True)])
        out, weights = attn(x, is_causal=True, cache=cache, need_weights=True)
    for b, n in enumerate(prompts):
        torch.testing.assert_close(out[b], full[b][0, n:], rtol=0, atol=1e-12)
    assert weights.shape == (2, 4, 2, 9)
    assert float(weights[0, :, :, : 9 - 5].abs().max()) == 0.0  # row 0 holds 5 of 9
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 2, dtype=torch.float64))


def test_paged_decoding_equals_kvcache_decoding() -> None:
    """One batch of equal lengths: the paged cache and KVCache give the same outputs."""
    attn = _layer()
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    paged, plain = PagedKVCache(16, 4, 2, 8, dtype=torch.float64), KVCache()
    with torch.no_grad():
        a = [attn(x[:, :8], is_causal=True, cache=paged)]  # B new sequences on first use
        b = [attn(x[:, :8], is_causal=True, cache=plain)]
        for i in range(8, 12):
            a.append(attn(x[:, i : i + 1], is_causal=True, cache=paged))
            b.append(attn(x[:, i : i + 1], is_causal=True, cache=plain))
    for got, want in zip(a, b, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert paged.sequences == [0, 1] and paged.position == plain.position == 12


def test_blocks_are_taken_as_sequences_grow_and_reused_after_free() -> None:
    cache = PagedKVCache(6, 4, 1, 2)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.use([a, b]).write(torch.zeros(2, 1, 5, 2), torch.zeros(2, 1, 5, 2))
    assert cache.block_table().tolist() == [[0, 1], [2, 3]] and cache.free_blocks == 2
    cache.use([a]).write(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))  # 8 tokens: 2 blocks
    assert cache.free_blocks == 2 and cache.length(a) == 8
    cache.write(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))  # 9: a third block
    assert cache.block_table([a]).tolist() == [[0, 1, 4]] and cache.free_blocks == 1
    cache.free(b)
    assert cache.free_blocks == 3 and cache.sequences == [a]
    c = cache.add_sequence()
    cache.use([c]).write(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))
    assert cache.block_table().tolist() == [[2, 3]]  # b's blocks, reused
    cache.reset()
    assert cache.free_blocks == 6 and cache.sequences == []


def test_pool_running_out_is_one_line_and_changes_nothing() -> None:
    cache = PagedKVCache(3, 4, 1, 2)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.use([a, b]).write(torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2))
    with pytest.raises(ValueError, match=r"ran out of blocks: 4 more asked for 10 new tokens, 1 "
                       r"of 3 left\. Hint: free finished sequences") as info:  # fmt: skip
        cache.write(torch.zeros(2, 1, 5, 2), torch.zeros(2, 1, 5, 2))
    assert "\n" not in str(info.value)
    assert cache.lengths == [4, 4] and cache.free_blocks == 1  # all or nothing


def test_the_module_path_records_the_blocks_read_in_the_trace() -> None:
    attn = _layer()
    cache = PagedKVCache(8, 4, 2, 8, dtype=torch.float64)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        attn(x[:, :5], is_causal=True, cache=cache)
        with qkv.tracing(model=attn) as trace:
            traced = attn(x[:, 5:], is_causal=True, cache=cache)
        cache.free(0)
        cache.free(1)
        full = attn(x, is_causal=True)
    torch.testing.assert_close(traced[:, 0], full[:, 5], rtol=0, atol=1e-12)
    pages = trace.calls[-1].meta["pages"]
    assert pages == {
        "block_size": 4,
        "sequences": [0, 1],
        "lengths": [6, 6],
        "blocks": [[0, 1], [2, 3]],
    }


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: PagedKVCache(0, 4, 1, 2),
            ValueError,
            r"num_blocks must be a positive integer, got 0",
        ),
        (
            lambda: PagedKVCache(2, 4, 1, 2, dtype=torch.int32),
            TypeError,
            r"dtype must be a floating",
        ),
        (lambda: PagedKVCache(2, 4, 1, 2).use([7]), ValueError, r"7 is not a live sequence"),
        (lambda: PagedKVCache(2, 4, 1, 2).free(0), ValueError, r"0 is not a live sequence"),
    ],
)
def test_bad_arguments_are_one_line(make: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        make()  # type: ignore[operator]
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)


def test_new_keys_that_do_not_fit_the_pool_are_named() -> None:
    cache = PagedKVCache(4, 4, 2, 8)
    with pytest.raises(ValueError, match=r"new key \(1, 3, 1, 8\) must be .*\(2, 8\)"):
        cache.write(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
    with pytest.raises(ValueError, match=r"torch.float64 on cpu but the pool holds torch.float32"):
        cache.write(torch.zeros(1, 2, 1, 8, dtype=torch.float64), torch.zeros(1, 2, 1, 8))
    cache.use([cache.add_sequence()])
    with pytest.raises(ValueError, match=r"2 batch rows but the cache continues 1 sequences"):
        cache.write(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))
    with pytest.raises(ValueError, match=r"require grad.*torch.no_grad\(\)"):
        cache.write(torch.zeros(1, 2, 1, 8, requires_grad=True), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match=r"each sequence may fill one batch row"):
        cache.use([0, 0])


def test_one_cache_per_layer() -> None:
    first, second = _layer(), _layer()
    cache = PagedKVCache(4, 4, 2, 8, dtype=torch.float64)
    x = torch.randn(1, 2, 32, dtype=torch.float64)
    with torch.no_grad():
        first(x, is_causal=True, cache=cache)
        with pytest.raises(ValueError, match=r"this PagedKVCache already holds .* another"):
            second(x, is_causal=True, cache=cache)
