"""Decode-time weights (issue 14, item 5): ``KVCache(track_weights=True)`` keeps, per held token,
the sum of the attention weights it received - the signal of heavy-hitter KV-cache eviction
(H2O: Zhang et al. 2023, "Heavy-Hitter Oracle"; SnapKV: Li et al. 2024). Decoding through the
cache must give, for every held token, the column sum of the full pass's weights (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import masks
from qkv.nn import KVCache, MultiHeadAttention


def _attention(num_kv_heads: int, dtype: torch.dtype = torch.float32) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads).to(dtype).eval()


def _full_mass(attn: MultiHeadAttention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, H, L): the column sums of the full pass's weights, in float64."""
    exact = copy.deepcopy(attn).to(torch.float64)
    x64 = x.to(torch.float64)
    with torch.no_grad():
        if window is None:
            _, weights = exact(x64, is_causal=True, need_weights=True)
        else:
            _, weights = exact(x64, mask=masks.sliding_window(window - 1), need_weights=True)
    mass: torch.Tensor = weights.sum(dim=2)
    return mass


def _decode_mass(
    attn: MultiHeadAttention, x: torch.Tensor, chunks: list[int], cache: KVCache
) -> torch.Tensor:
    start = 0
    for size in chunks:  # the module adds each call's weights to a cache that tracks them
        attn(x[:, start : start + size], is_causal=True, cache=cache)
        start += size
    mass = cache.attention_mass
    assert mass is not None
    return mass


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=7),
    window=st.none() | st.integers(1, 6),
    num_kv_heads=st.sampled_from([4, 2, 1]),
    capacity=st.integers(1, 4),
)
def test_mass_equals_column_sums_of_the_full_pass(
    chunks: list[int], window: int | None, num_kv_heads: int, capacity: int
) -> None:
    """Prefill and decode in chunks, through growth, slides and a window: each held token's
    mass is the sum of the weights every query row gave it in the full pass."""
    attn = _attention(num_kv_heads)
    length = sum(chunks)
    x = torch.randn(2, length, 16, generator=torch.Generator().manual_seed(length))
    cache = KVCache(max_length=window, capacity=capacity, track_weights=True)
    with torch.no_grad():
        mass = _decode_mass(attn, x, chunks, cache)
    expected = _full_mass(attn, x, window)[:, :, length - cache.length :]
    assert mass.shape == (2, 4, cache.length)  # (B, H, L): per query head under GQA
    torch.testing.assert_close(mass.to(torch.float64), expected, atol=1e-5, rtol=1e-5)


def test_mass_is_kept_under_autograd_and_float64() -> None:
    """With gradients on the cache concatenates; the mass follows it and carries no gradient."""
    attn = _attention(2, torch.float64)
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    cache = KVCache(track_weights=True)
    mass = _decode_mass(attn, x, [3, 1, 1, 2], cache)
    assert mass.dtype == torch.float64 and not mass.requires_grad
    torch.testing.assert_close(mass, _full_mass(attn, x, None), atol=1e-12, rtol=1e-12)


def test_one_token_against_a_long_cache_is_linear() -> None:
    """A decoding step against 32k cached keys: weights (B, H, 1, N) and a mass of N per head;
    the mass of the step's row sums to 1 per head (no N x N anywhere: it would be 4 GiB)."""
    n = 32768
    cache = KVCache(track_weights=True)
    keys = torch.randn(1, 2, n, 8)
    with torch.no_grad():
        held, values = cache.append(keys, keys)
        q = torch.randn(1, 2, 1, 8)
        import qkv

        _, weights = qkv.scaled_dot_product_attention(
            q, held, values, is_causal=True, causal_alignment="bottom-right", return_weights=True
        )
    assert weights.shape == (1, 2, 1, n)
    cache.accumulate(weights)
    mass = cache.attention_mass
    assert mass is not None and mass.shape == (1, 2, n)
    torch.testing.assert_close(mass.sum(dim=-1), torch.ones(1, 2))


def test_reset_forgets_the_mass_and_repr_says_it_tracks() -> None:
    attn = _attention(4)
    cache = KVCache(track_weights=True)
    with torch.no_grad():
        _decode_mass(attn, torch.randn(1, 3, 16), [3], cache)
        cache.reset()
        assert cache.attention_mass is None
        mass = _decode_mass(attn, torch.randn(1, 2, 16), [1, 1], cache)
    assert mass.shape == (1, 4, 2)
    torch.testing.assert_close(mass.sum(dim=-1), torch.full((1, 4), 2.0))
    assert repr(cache) == "KVCache(length=2, position=2, track_weights=True)"


def test_untracked_cache_has_no_mass_and_refuses_weights() -> None:
    cache = KVCache()
    k = torch.zeros(1, 1, 2, 4)
    cache.append(k, k)
    assert cache.attention_mass is None
    with pytest.raises(ValueError, match=r"does not track weights.*Hint: .*track_weights=True"):
        cache.accumulate(torch.ones(1, 1, 1, 2))


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((1, 1, 1, 3), r"\(1, H, Lq, 2\).*got \(1, 1, 1, 3\)"), ((2, 1, 1, 2), r"got \(2, 1, 1, 2\)")],
)
def test_weights_that_do_not_fit_the_last_append_are_refused(
    shape: tuple[int, ...], expected: str
) -> None:
    cache = KVCache(track_weights=True)
    with pytest.raises(ValueError, match=r"nothing was appended yet.*Hint"):
        cache.accumulate(torch.ones(1, 1, 1, 2))
    k = torch.zeros(1, 1, 2, 4)
    cache.append(k, k)
    with pytest.raises(ValueError, match=expected + r".*Hint"):
        cache.accumulate(torch.ones(shape))
    with pytest.raises(TypeError, match=r"track_weights must be True or False.*Hint"):
        KVCache(track_weights="yes")  # type: ignore[arg-type]
