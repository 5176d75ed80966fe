"""``flash_attn_with_kvcache`` against flash-attn's own expectations, on CPU.

Ported from Dao-AILab/flash-attention ``tests/test_flash_attn.py::test_flash_attn_kvcache``
(read, not copied): a cache with random ``cache_seqlens``, new k and v appended in place
(or none), rotary embeddings on a fraction of the head (interleaved or GPT-NeoX), left
padding (``cache_leftpad``), ``cache_batch_idx`` into a larger cache, causal, a random local
window, ALiBi slopes (batch, nheads) × 0.3, MHA / GQA / MQA. The cache must hold exactly
the rotated new keys and the new values afterwards, and the output must be within
``mult`` × the error of the reference computed in the dtype under test (3, or 5 with
ALiBi, as there) of the float64 reference. The paged cases read and write a cache of pages
of 256 through a random ``block_table`` (``_generate_block_kvcache``), and
``test_flash_attn_kvcache_paged_block_table_bounds`` is ported too.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qkv.flash_attn import flash_attn_with_kvcache
from tests.flash_attn.reference import alibi_bias, attention_ref
from tests.flash_attn.test_functions import within


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, interleaved: bool,
    *, same_position: bool = False,
) -> torch.Tensor:  # fmt: skip
    """flash-attn's ``apply_rotary_emb_torch`` at positions start[b] + s (or start[b] for
    every s), on the first 2 · cos.shape[1] dims of x (B, S, H, D)."""
    dim = 2 * cos.shape[1]
    steps = torch.zeros(x.shape[1], dtype=torch.long) if same_position else torch.arange(x.shape[1])
    positions = start.long()[:, None] + steps  # (B, S)
    repeat = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: t.repeat(1, 2))
    c, s = repeat(cos)[positions][:, :, None], repeat(sin)[positions][:, :, None]
    head = x[..., :dim]
    return torch.cat((head * c + _rotate_half(head, interleaved) * s, x[..., dim:]), dim=-1)


def _cases() -> list[tuple[bool, bool, float, bool, bool, bool, int]]:
    """(causal, new_kv, rotary_fraction, interleaved, leftpad, batch_idx, index): the
    product flash-attn draws, rotary only with new keys, as there; the cases without left
    padding and batch indices also run on a paged cache (index ≥ 1000)."""
    rotary = [(0.0, False), (0.5, False), (1.0, True)]
    cases: list[tuple[bool, bool, float, bool, bool, bool, int]] = []
    for causal, new_kv, (fraction, interleaved), leftpad, batch_idx in itertools.product(
        [False, True], [False, True], rotary, [False, True], [False, True]
    ):
        if fraction > 0 and not new_kv:
            continue
        cases.append((causal, new_kv, fraction, interleaved, leftpad, batch_idx, len(cases)))
    paged = [(*case[:6], 1000 + case[6]) for case in cases if not case[4] and not case[5]]
    return cases + paged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("causal", "new_kv", "rotary_fraction", "interleaved", "has_leftpad", "has_batch_idx", "index"),
    _cases(),
)
def test_kvcache(
    dtype: torch.dtype,
    causal: bool,
    new_kv: bool,
    rotary_fraction: float,
    interleaved: bool,
    has_leftpad: bool,
    has_batch_idx: bool,
    index: int,
) -> None:
    paged = index >= 1000
    index %= 1000
    # the rest of flash-attn's grid, cycled through the cases
    local = index % 3 == 1
    alibi = index % 4 == 2
    mha_type = ["mha", "gqa", "mqa"][index % 3]
    seqlen_q, seqlen_k = [(1, 128), (3, 200), (64, 100), (1, 339)][index % 4]
    dim = [32, 59, 64][index % 3]
    seqlen_new = seqlen_q if index % 2 else max(1, seqlen_q // 2)
    gen = torch.Generator().manual_seed(index)
    batch, heads = 2, 6
    rows_cache = batch * 2 if has_batch_idx else batch
    kv_heads = {"mha": 6, "gqa": 3, "mqa": 1}[mha_type]
    rotary_dim = math.floor(int(rotary_fraction * dim) / 16) * 16
    window = tuple(torch.randint(0, seqlen_k, (2,), generator=gen).tolist()) if local else (-1, -1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = randn(batch, seqlen_q, heads, dim)
    k = randn(batch, seqlen_new, kv_heads, dim) if new_kv else None
    v = randn(batch, seqlen_new, kv_heads, dim) if new_kv else None
    k_cache, v_cache = (
        randn(rows_cache, seqlen_k, kv_heads, dim),
        randn(rows_cache, seqlen_k, kv_heads, dim),
    )
    k_cache_before, v_cache_before = k_cache.clone(), v_cache.clone()
    block_table = None
    if paged:  # flash-attn's _generate_block_kvcache: pages of 256, 3× as many as needed
        size = 256
        num_blocks = math.ceil(seqlen_k / size) * batch * 3
        pages_k, pages_v = (
            randn(num_blocks, size, kv_heads, dim),
            randn(num_blocks, size, kv_heads, dim),
        )
        block_table = torch.randperm(num_blocks, generator=gen).int().reshape(batch, -1)
        k_cache = pages_k[block_table.long()].flatten(1, 2)[:, :seqlen_k].clone()
        v_cache = pages_v[block_table.long()].flatten(1, 2)[:, :seqlen_k].clone()
        k_cache_before, v_cache_before = k_cache.clone(), v_cache.clone()
    if new_kv:
        room = seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new
        high = seqlen_k - room + 1
    else:
        high = seqlen_k + 1
    lengths = torch.randint(0 if new_kv else 1, high, (batch,), generator=gen, dtype=torch.int32)
    leftpad = None
    if has_leftpad:
        leftpad = torch.tensor(
            [
                int(torch.randint(0, n, (1,), generator=gen)) if n > 0 else 0
                for n in lengths.tolist()
            ],
            dtype=torch.int32,
        )
    arange = torch.arange(seqlen_k)[None, :]
    key_mask = arange < lengths[:, None] + (seqlen_new if new_kv else 0)
    if leftpad is not None:
        key_mask &= arange >= leftpad[:, None]
    batch_idx = torch.randperm(rows_cache, generator=gen)[:batch].int() if has_batch_idx else None
    slopes = torch.rand(batch, heads, generator=gen) * 0.3 if alibi else None
    bias = None
    if slopes is not None:
        bias = alibi_bias(
            slopes, seqlen_q, seqlen_k, torch.full((batch,), seqlen_q), key_mask.sum(-1), leftpad
        )
    cos = sin = None
    q_ro, k_ro = q, k
    if rotary_dim > 0:
        assert k is not None
        angle = (
            torch.rand(seqlen_k, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
        )
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        q_ro = rotary_ref(q, cos, sin, lengths, interleaved, same_position=not (causal or local))
        k_ro = rotary_ref(k, cos, sin, lengths, interleaved)
    rows = torch.arange(batch) if batch_idx is None else batch_idx.long()
    k_ref, v_ref = k_cache[rows].clone(), v_cache[rows].clone()
    if new_kv:
        assert k_ro is not None and v is not None
        update = (arange >= lengths[:, None]) & (arange < lengths[:, None] + seqlen_new)
        k_ref[update] = k_ro.flatten(0, 1)
        v_ref[update] = v.flatten(0, 1)

    out = flash_attn_with_kvcache(
        q, pages_k if paged else k_cache, pages_v if paged else v_cache, k, v,
        rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, cache_batch_idx=batch_idx,
        cache_leftpad=leftpad, block_table=block_table, causal=causal, window_size=window,
        rotary_interleaved=interleaved, alibi_slopes=slopes,
    )  # fmt: skip
    if paged:  # the cache as the rows see it, read back from the pages
        assert block_table is not None
        k_cache = pages_k[block_table.long()].flatten(1, 2)[:, :seqlen_k]
        v_cache = pages_v[block_table.long()].flatten(1, 2)[:, :seqlen_k]

    options = {
        "k_mask": key_mask, "bias": bias, "causal": causal, "window": window,
        "key_leftpad": leftpad,
    }  # fmt: skip
    truth, _, _ = attention_ref(q_ro, k_ref, v_ref, **options)  # type: ignore[arg-type]
    rounded, _, _ = attention_ref(q_ro, k_ref, v_ref, upcast=False, **options)  # type: ignore[arg-type]
    within(out, truth, rounded, mult=5 if alibi else 3)
    if new_kv:
        torch.testing.assert_close(
            k_cache[rows],
            k_ref,
            rtol=1e-3 if dtype == torch.float32 else 1e-12,
            atol=1e-5 if dtype == torch.float32 else 1e-12,
        )
        assert torch.equal(v_cache[rows], v_ref)
    else:
        assert torch.equal(k_cache, k_cache_before) and torch.equal(v_cache, v_cache_before)
    others = torch.ones(rows_cache, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(k_cache[others], k_cache_before[others])


@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_lse_and_int_seqlens(causal: bool) -> None:
    """``return_softmax_lse`` (batch, nheads, seqlen_q), exact; an int ``cache_seqlens``
    stands for every row."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (
        torch.randn(2, 40, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2)
    )
    k, v = (torch.randn(2, 3, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=20, causal=causal, return_softmax_lse=True
    )
    truth, _, truth_lse = attention_ref(q, k_cache[:, :23], v_cache[:, :23], causal=causal)
    torch.testing.assert_close(out, truth, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, truth_lse, rtol=0, atol=1e-12)
    assert torch.equal(k_cache[:, 20:23], k)


def test_kvcache_decoding_loop_equals_full_attention() -> None:
    """Appending one token at a time gives, step by step, the causal attention of the whole
    sequence (what a generate loop relies on)."""
    gen = torch.Generator().manual_seed(1)
    steps, heads, dim = 12, 4, 16
    q, k, v = (
        torch.randn(1, steps, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3)
    )
    k_cache, v_cache = (
        torch.zeros(1, steps, heads, dim, dtype=torch.float64),
        torch.zeros(1, steps, heads, dim, dtype=torch.float64),
    )
    outs = [
        flash_attn_with_kvcache(
            q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1],
            cache_seqlens=torch.tensor([t], dtype=torch.int32), causal=True,
        )
        for t in range(steps)
    ]  # fmt: skip
    truth, _, _ = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), truth, rtol=0, atol=1e-12)


@pytest.mark.parametrize("append", [False, True])
def test_kvcache_paged_block_table_bounds(append: bool) -> None:
    """flash-attn's ``test_flash_attn_kvcache_paged_block_table_bounds``: a length beyond
    block_table's pages is an error naming block_table; exactly at capacity is not."""
    size = 256
    pages_k, pages_v = torch.randn(4, size, 1, 64), torch.randn(4, size, 1, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.randn(1, 1, 1, 64)
    new = (torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)) if append else (None, None)
    lengths = torch.full((1,), size if append else size + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table") as caught:
        flash_attn_with_kvcache(
            q, pages_k, pages_v, new[0], new[1], cache_seqlens=lengths, block_table=table
        )
    assert "\n" not in str(caught.value)
    full = torch.full((1,), size, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=full, block_table=table)
    truth, _, _ = attention_ref(q, pages_k[:1], pages_v[:1])
    torch.testing.assert_close(out, truth.float())


def test_kvcache_page_outside_the_cache_is_named() -> None:
    pages = torch.zeros(2, 4, 1, 8)
    table = torch.tensor([[1, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[0\] holds page 5, outside the cache's 2"):
        flash_attn_with_kvcache(
            torch.zeros(1, 1, 1, 8), pages, pages, cache_seqlens=6, block_table=table
        )
