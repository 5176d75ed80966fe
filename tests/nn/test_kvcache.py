"""qkv.nn.KVCache: decoding through the cache equals the full causal pass; bounded growth."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import masks
from qkv.nn import KVCache, MultiHeadAttention, TransformerBlock


def close(actual: object, expected: object, tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _attention(positional: str | None, num_kv_heads: int = 2) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, positional=positional).eval()


def _decode(
    attn: MultiHeadAttention, x: torch.Tensor, chunks: list[int], cache: KVCache
) -> torch.Tensor:
    outputs, start = [], 0
    for size in chunks:
        outputs.append(attn(x[:, start : start + size], is_causal=True, cache=cache))
        start += size
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("positional", [None, "rope", "rope-interleaved", "alibi"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_token_by_token_equals_full_causal_pass(positional: str | None, num_kv_heads: int) -> None:
    attn = _attention(positional, num_kv_heads)
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        full = attn(x, is_causal=True)
        cache = KVCache(capacity=2)  # small, so that it must grow on the way
        decoded = _decode(attn, x, [1] * 11, cache)
    close(decoded, full)
    assert cache.length == cache.position == 11 and cache.capacity >= 11


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    positional=st.sampled_from([None, "rope", "alibi"]),
    window=st.none() | st.integers(1, 6),
)
def test_chunks_equal_full_pass_with_bottom_right_alignment(
    chunks: list[int], positional: str | None, window: int | None
) -> None:
    attn = _attention(positional)
    length = sum(chunks)
    x = torch.randn(1, length, 16, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        if window is None:
            full = attn(x, is_causal=True)
        else:  # a window of W tokens: each query sees itself and the W - 1 before it
            full = attn(x, mask=masks.sliding_window(window - 1))
        cache = KVCache(max_length=window, capacity=3)
        decoded = _decode(attn, x, chunks, cache)
    close(decoded, full)
    assert cache.position == length
    assert cache.length == (length if window is None else min(window, length))


def test_growth_doubles_and_window_bounds_memory() -> None:
    k = torch.zeros(1, 2, 1, 4)
    cache = KVCache(capacity=1)
    capacities = set()
    with torch.no_grad():
        for _ in range(1000):
            cache.append(k, k)
            capacities.add(cache.capacity)
    # doubling: 1, 2, 4, ..., 1024 - ten reallocations for a thousand tokens, not a thousand
    assert sorted(capacities) == [2**i for i in range(11)]
    window = KVCache(max_length=8)
    with torch.no_grad():
        for _ in range(2000):
            keys, _ = window.append(k, k)
            assert keys.shape[2] <= 9  # the 8 held plus the new one
    assert window.length == 8 and window.capacity == 256 + 8  # never grew
    assert window.keys is not None and window.keys.shape == (1, 2, 8, 4)


def test_long_chunk_grows_at_once_and_reset_forgets() -> None:
    cache = KVCache(capacity=4)
    with torch.no_grad():
        cache.append(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
        keys, _ = cache.append(torch.zeros(1, 1, 50, 2), torch.zeros(1, 1, 50, 2))
    assert keys.shape == (1, 1, 53, 2) and cache.capacity >= 53
    assert keys[0, 0, :3].eq(1).all() and keys[0, 0, 3:].eq(0).all()
    cache.reset()
    assert cache.length == cache.position == 0 and cache.keys is None
    assert repr(KVCache(max_length=4)) == "KVCache(length=0, position=0, max_length=4)"


def test_gradients_through_the_cache_equal_the_full_pass() -> None:
    attn = _attention("rope").double()  # float64: parameter gradients sum many terms
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    x_full, x_cached = x.clone().requires_grad_(), x.clone().requires_grad_()
    attn(x_full, is_causal=True).square().sum().backward()
    grads_full = [p.grad.clone() for p in attn.parameters()]  # type: ignore[union-attr]
    attn.zero_grad()
    _decode(attn, x_cached, [3, 1, 3], KVCache()).square().sum().backward()
    close(x_cached.grad, x_full.grad, 1e-12)
    for p, expected in zip(attn.parameters(), grads_full, strict=True):
        close(p.grad, expected, 1e-12)


def test_transformer_blocks_decode_with_one_cache_per_layer() -> None:
    torch.manual_seed(1)
    blocks = torch.nn.ModuleList(TransformerBlock(16, 4, positional="rope") for _ in range(2))
    blocks.eval()
    x = torch.randn(1, 6, 16)

    def run(h: torch.Tensor, caches: list[KVCache] | None) -> torch.Tensor:
        for i, block in enumerate(blocks):
            h = block(h, is_causal=True, cache=None if caches is None else caches[i])
        return h

    with torch.no_grad():
        full = run(x, None)
        caches = [KVCache() for _ in blocks]
        steps = torch.cat([run(x[:, i : i + 1], caches) for i in range(6)], dim=1)
    close(steps, full)


def test_cache_errors() -> None:
    with pytest.raises(ValueError, match=r"KVCache: max_length must be a positive integer or "
                       r"None, got 0\. Hint: KVCache\(max_length=4096\)"):  # fmt: skip
        KVCache(max_length=0)
    attn, other = _attention(None), _attention(None)
    cache = KVCache()
    x = torch.randn(1, 2, 16)
    with torch.no_grad():
        attn(x, cache=cache)
        with pytest.raises(ValueError, match=r"already holds the keys and values of another "
                           r"attention layer\. Hint: make one cache per layer"):  # fmt: skip
            other(x, cache=cache)
        with pytest.raises(ValueError, match=r"the new key \(2, 2, 2, 4\) does not fit the "
                           r"tokens held \(B, Hkv, D\) = \(1, 2, 4\)"):  # fmt: skip
            attn(torch.randn(2, 2, 16), cache=cache)
        with pytest.raises(ValueError, match=r"cache works with self-attention only"):
            attn(x, torch.randn(1, 3, 16), cache=KVCache())
        with pytest.raises(TypeError, match=r"cache must be a qkv.nn.KVCache, got dict"):
            attn(x, cache={})
        with pytest.raises(ValueError, match=r"key and value must be \(B, Hkv, Lnew, D\)"):
            KVCache().append(torch.zeros(2, 3), torch.zeros(2, 3))
        with pytest.raises(ValueError, match=r"the new key is torch.float64 on cpu but the "
                           r"cache holds torch.float32"):  # fmt: skip
            cache.append(torch.zeros(1, 2, 1, 4, dtype=torch.float64),
                         torch.zeros(1, 2, 1, 4, dtype=torch.float64))  # fmt: skip
    converted = MultiHeadAttention.from_torch(
        torch.nn.MultiheadAttention(16, 2, add_zero_attn=True, batch_first=True)
    )
    with pytest.raises(ValueError, match=r"cache cannot be combined with add_bias_kv or "
                       r"add_zero_attn"):  # fmt: skip
        converted(x, cache=KVCache())
