"""The packed functions (``flash_attn_varlen_func``, ``..._kvpacked_func``,
``..._qkvpacked_func``) against flash-attn's own expectations, on CPU.

Ported from Dao-AILab/flash-attention ``tests/test_flash_attn.py`` (read, not copied):
``test_flash_attn_varlen_output`` and ``test_flash_attn_varlen_qkvpacked``: a padded batch
with random lengths (``generate_random_padding_mask(mode="random")``) is unpadded into
(total, nheads, headdim) and ``cu_seqlens``; the output, padded back, and dq, dk, dv are
compared with ``attention_ref`` run on the padded batch with its padding masks; causal, a
random local window, ALiBi, softcap, MHA / GQA / MQA, dropout through ``S_dmask``; and
``test_flash_attn_varlen_causal`` (a sequence with more queries than keys; keys and values
also as pages of 256 through a random ``block_table``). Tolerances as
flash-attn derives them (twice the error of the reference in the dtype under test).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from qkv.flash_attn import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from tests.flash_attn.reference import (
    alibi_bias,
    attention_ref,
    cu_seqlens,
    padding_mask,
    random_lengths,
)
from tests.flash_attn.test_functions import within


def _unpad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, ...) → (total, ...): the rows the mask keeps, batch after batch."""
    return x[mask]


def _pad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(total, ...) → (B, L, ...), zeros in the padding."""
    out = x.new_zeros(*mask.shape, *x.shape[1:])
    out[mask] = x
    return out


def _call(
    kind: str, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, mq: int, mk: int, **kw: Any
) -> Any:
    if kind == "qkvpacked":
        return flash_attn_varlen_qkvpacked_func(torch.stack((q, k, v), dim=1), cu_q, mq, **kw)
    if kind == "kvpacked":
        return flash_attn_varlen_kvpacked_func(
            q, torch.stack((k, v), dim=1), cu_q, cu_k, mq, mk, **kw
        )
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)


CASES = [(113, 203, "gqa"), (128, 37, "mqa"), (61, 61, "mha")]
"""(seqlen_q, seqlen_k, mha_type): more keys, more queries (rows with no key under causal),
one length."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", ["plain", "local", "alibi", "softcap"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "mha_type"), CASES)
def test_varlen_output_and_gradients(
    dtype: torch.dtype, causal: bool, option: str, seqlen_q: int, seqlen_k: int, mha_type: str
) -> None:
    """``test_flash_attn_varlen_output``: flash_attn_varlen_func, forward and backward."""
    _check_varlen("func", dtype, causal, option, seqlen_q, seqlen_k, mha_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["kvpacked", "qkvpacked"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", ["plain", "local", "alibi", "softcap"])
def test_varlen_packed_output_and_gradients(
    dtype: torch.dtype, kind: str, causal: bool, option: str
) -> None:
    """``test_flash_attn_varlen_output(kvpacked=True)``, ``test_flash_attn_varlen_qkvpacked``."""
    seqlen_q, seqlen_k, mha_type = CASES[0] if kind == "kvpacked" else CASES[2]
    _check_varlen(kind, dtype, causal, option, seqlen_q, seqlen_k, mha_type)


def _check_varlen(
    kind: str,
    dtype: torch.dtype,
    causal: bool,
    option: str,
    seqlen_q: int,
    seqlen_k: int,
    mha_type: str,
) -> None:
    gen = torch.Generator().manual_seed(seqlen_q + 7 * seqlen_k)
    batch, heads, dim = 4, 6, 32
    kv_heads = {"mha": 6, "gqa": 2, "mqa": 1}[mha_type]
    lengths_q = random_lengths(gen, seqlen_q, batch)
    lengths_k = lengths_q if kind == "qkvpacked" else random_lengths(gen, seqlen_k, batch)
    q_mask, k_mask = padding_mask(lengths_q, seqlen_q), padding_mask(lengths_k, seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen_k, kv_heads, dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, seqlen_k, kv_heads, dim, generator=gen, dtype=dtype, requires_grad=True)
    window = (-1, -1)
    if option == "local":
        left, right = torch.randint(0, seqlen_k, (2,), generator=gen).tolist()
        window = (left, right)
    slopes = torch.rand(batch, heads, generator=gen) * 0.3 if option == "alibi" else None
    softcap = 30.0 if option == "softcap" else 0.0
    bias = None
    if slopes is not None:
        bias = alibi_bias(slopes, seqlen_q, seqlen_k, q_mask.sum(-1), k_mask.sum(-1))
    out_packed = _call(
        kind,
        _unpad(q, q_mask),
        _unpad(k, k_mask),
        _unpad(v, k_mask),
        cu_seqlens(lengths_q),
        cu_seqlens(lengths_k),
        seqlen_q,
        seqlen_k,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=slopes,
    )
    out = _pad(out_packed, q_mask)
    options = {
        "q_mask": q_mask, "k_mask": k_mask, "causal": causal, "window": window,
        "softcap": softcap, "bias": bias,
    }  # fmt: skip
    truth, _, _ = attention_ref(q, k, v, **options)  # type: ignore[arg-type]
    rounded, _, _ = attention_ref(q, k, v, upcast=False, **options)  # type: ignore[arg-type]
    within(out, truth, rounded)
    grad = torch.randn(out.shape, generator=gen, dtype=dtype).masked_fill(
        ~q_mask[..., None, None], 0
    )
    for g_ours, g_exact, g_pt in zip(
        torch.autograd.grad(out, (q, k, v), grad),
        torch.autograd.grad(truth, (q, k, v), grad),
        torch.autograd.grad(rounded, (q, k, v), grad),
        strict=True,
    ):
        within(g_ours, g_exact, g_pt)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_probs_lse_and_dropout(causal: bool) -> None:
    """lse (nheads, total_q) and S_dmask (batch, nheads, max_q, max_k), exact; dropout's
    pattern from the sign of S_dmask, the output equal to the reference's with it."""
    torch.manual_seed(5)
    p = 0.17
    lengths_q, lengths_k = [5, 64, 1, 30], [9, 64, 40, 2]
    q_mask, k_mask = padding_mask(lengths_q, 64), padding_mask(lengths_k, 64)
    q = torch.randn(4, 64, 4, 16, dtype=torch.float64)
    k, v = (torch.randn(4, 64, 2, 16, dtype=torch.float64) for _ in range(2))
    out, lse, s_dmask = flash_attn_varlen_func(
        q[q_mask], k[k_mask], v[k_mask], cu_seqlens(lengths_q), cu_seqlens(lengths_k), 64, 64,
        dropout_p=p, causal=causal, return_attn_probs=True,
    )  # fmt: skip
    assert lse.shape == (4, sum(lengths_q)) and s_dmask.shape == (4, 4, 64, 64)
    keep = s_dmask >= 0
    truth, weights, truth_lse = attention_ref(
        q, k, v, q_mask=q_mask, k_mask=k_mask, dropout_p=p, keep=keep, causal=causal
    )
    torch.testing.assert_close(s_dmask.abs(), weights, rtol=0, atol=1e-13)
    torch.testing.assert_close(_pad(out, q_mask), truth, rtol=0, atol=1e-12)
    packed_lse = truth_lse.permute(0, 2, 1)[q_mask].T  # (H, total_q)
    empty = torch.isinf(packed_lse)
    assert bool((lse[empty] == math.inf).all()) and torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], packed_lse[~empty], rtol=0, atol=1e-12)
    valid = (q_mask[:, None, :, None] & k_mask[:, None, None, :]).expand_as(keep) & (weights > 0)
    assert abs(1 - keep[valid].double().mean().item() - p) <= 0.02


def test_varlen_empty_sequence() -> None:
    """A sequence of no keys gives its queries zeros (and a sequence of no queries nothing)."""
    q = torch.randn(5, 2, 8)
    k = v = torch.randn(4, 2, 8)
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 1, 4], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3)
    assert torch.equal(out[:2], torch.zeros(2, 2, 8))
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[2:].transpose(0, 1), k[1:].transpose(0, 1), v[1:].transpose(0, 1)
    )
    torch.testing.assert_close(out[2:], alone.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("local", [False, True])
def test_varlen_causal(dtype: torch.dtype, paged: bool, swap: bool, local: bool) -> None:
    """``test_flash_attn_varlen_causal``: batch 8, 9 heads, causal, (108, 256) or swapped,
    optionally a window; with ``paged`` k and v are pages of 256 and ``block_table``
    (``_generate_block_kvcache``: 3× the pages needed, in random order)."""
    seqlen_q, seqlen_k = (256, 108) if swap else (108, 256)
    gen = torch.Generator().manual_seed(int(swap) + 2 * int(local) + 4 * int(paged))
    batch, heads, dim = 8, 9, 32
    window = (-1, -1)
    if local:
        left, right = torch.randint(0, seqlen_k, (2,), generator=gen).tolist()
        window = (left, right)
    q = torch.randn(batch, seqlen_q, heads, dim, generator=gen, dtype=dtype)
    lengths_q = random_lengths(gen, seqlen_q, batch)
    lengths_k = random_lengths(gen, seqlen_k, batch)
    q_mask, k_mask = padding_mask(lengths_q, seqlen_q), padding_mask(lengths_k, seqlen_k)
    if paged:
        size = 256
        num_blocks = math.ceil(seqlen_k / size) * batch * 3
        pages_k = torch.randn(num_blocks, size, heads, dim, generator=gen, dtype=dtype)
        pages_v = torch.randn(num_blocks, size, heads, dim, generator=gen, dtype=dtype)
        table = torch.randperm(num_blocks, generator=gen).int().reshape(batch, -1)
        k = pages_k[table.long()].flatten(1, 2)[:, :seqlen_k]
        v = pages_v[table.long()].flatten(1, 2)[:, :seqlen_k]
        keys, values, block_table = pages_k, pages_v, table
    else:
        k = torch.randn(batch, seqlen_k, heads, dim, generator=gen, dtype=dtype)
        v = torch.randn(batch, seqlen_k, heads, dim, generator=gen, dtype=dtype)
        keys, values, block_table = k[k_mask], v[k_mask], None
    out = flash_attn_varlen_func(  # the window as a tensor, as flash-attn's test passes it
        q[q_mask], keys, values, cu_seqlens(lengths_q), cu_seqlens(lengths_k), seqlen_q,
        seqlen_k, 0.0, causal=True, window_size=torch.tensor(window), block_table=block_table,
    )  # fmt: skip
    options: dict[str, Any] = {"q_mask": q_mask, "k_mask": k_mask, "causal": True, "window": window}
    truth, _, _ = attention_ref(q, k, v, **options)
    rounded, _, _ = attention_ref(q, k, v, upcast=False, **options)
    within(_pad(out, q_mask), truth, rounded)
