"""``flash_attn_func``, ``flash_attn_kvpacked_func`` and ``flash_attn_qkvpacked_func``
against flash-attn's own expectations, on CPU.

Ported from Dao-AILab/flash-attention ``tests/test_flash_attn.py`` (read, not copied):
``test_flash_attn_output`` (q, k, v or kv packed; causal, a random local window, ALiBi
slopes (batch, nheads) × 0.3, softcap; MHA, GQA, MQA; seqlen_q ≠ seqlen_k),
``test_flash_attn_qkvpacked``, ``test_flash_attn_causal`` (more queries than keys: rows with
no key give zeros) and their dropout checks (``S_dmask >= 0`` is the kept pattern, the
dropped fraction within 0.01 of dropout_p, and the output equal to the reference run with
that pattern). The tolerance is derived as flash-attn derives it: the error against the
float64 reference may be at most twice that of the reference computed in the dtype under
test (``attention_ref(upcast=False, reorder_ops=True)``), plus a floor.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from qkv.flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from tests.flash_attn.reference import alibi_bias, attention_ref

FLOOR = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-12}
"""flash-attn adds 1e-5 to its float16 bound; float64 gets the same margin in its units."""


def within(ours: torch.Tensor, truth: torch.Tensor, rounded: torch.Tensor, mult: float = 2) -> None:
    """flash-attn's bound: |ours − truth| ≤ mult · |rounded − truth| + floor."""
    error = (ours.double() - truth.double()).abs().max().item()
    allowed = mult * (rounded.double() - truth.double()).abs().max().item() + FLOOR[ours.dtype]
    assert error <= allowed, f"error {error:.3g} > allowed {allowed:.3g}"


def _call(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> Any:
    if kind == "qkvpacked":
        return flash_attn_qkvpacked_func(torch.stack((q, k, v), dim=2), **options)
    if kind == "kvpacked":
        return flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), **options)
    return flash_attn_func(q, k, v, **options)


OPTIONS = ["plain", "local", "alibi", "softcap"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(113, 203), (128, 117), (1, 239)])
def test_output_and_gradients(
    dtype: torch.dtype, causal: bool, option: str, mha_type: str, seqlen_q: int, seqlen_k: int
) -> None:
    """``test_flash_attn_output``: flash_attn_func, forward and backward."""
    _check_output("func", dtype, causal, option, mha_type, seqlen_q, seqlen_k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision(dtype: torch.dtype, causal: bool) -> None:
    """flash-attn's own dtypes: float16 and bfloat16, under the same bound."""
    _check_output("func", dtype, causal, "alibi", "gqa", 113, 203)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["kvpacked", "qkvpacked"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", OPTIONS)
def test_packed_output_and_gradients(
    dtype: torch.dtype, kind: str, causal: bool, option: str
) -> None:
    """``test_flash_attn_output(kvpacked=True)`` and ``test_flash_attn_qkvpacked``: q, k
    and v packed give the same as apart."""
    if kind == "qkvpacked":
        _check_output(kind, dtype, causal, option, "mha", 97, 97)
    else:
        _check_output(kind, dtype, causal, option, "gqa", 113, 203)


def _check_output(
    kind: str,
    dtype: torch.dtype,
    causal: bool,
    option: str,
    mha_type: str,
    seqlen_q: int,
    seqlen_k: int,
) -> None:
    gen = torch.Generator().manual_seed(seqlen_q * 31 + seqlen_k)
    batch, heads, dim = 2, 6, 32
    kv_heads = {"mha": 6, "gqa": 2, "mqa": 1}[mha_type]
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
        lengths_q, lengths_k = torch.full((batch,), seqlen_q), torch.full((batch,), seqlen_k)
        bias = alibi_bias(slopes, seqlen_q, seqlen_k, lengths_q, lengths_k)
    ref_options = {"causal": causal, "window": window, "softcap": softcap, "bias": bias}
    out = _call(
        kind, q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes
    )
    truth, _, _ = attention_ref(q, k, v, **ref_options)  # type: ignore[arg-type]
    rounded, _, _ = attention_ref(q, k, v, upcast=False, **ref_options)  # type: ignore[arg-type]
    assert out.shape == (batch, seqlen_q, heads, dim) and out.dtype == dtype
    within(out, truth, rounded)

    grad = torch.randn(out.shape, generator=gen, dtype=dtype)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    exact = torch.autograd.grad(truth, (q, k, v), grad)
    pt = torch.autograd.grad(rounded, (q, k, v), grad)
    for g_ours, g_exact, g_pt in zip(ours, exact, pt, strict=True):
        within(g_ours, g_exact, g_pt)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(37, 81), (81, 37)])
def test_probabilities_and_lse_are_exact(
    causal: bool, option: str, seqlen_q: int, seqlen_k: int
) -> None:
    """``return_attn_probs``: exact softmax and natural-log lse; +inf for rows with no key
    (more queries than keys under causal), as flash-attn's kernel writes them."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, seqlen_q, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, seqlen_k, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, seqlen_k, 2, 16, generator=gen, dtype=torch.float64)
    window = (5, 3) if option == "local" else (-1, -1)
    slopes = torch.rand(4, generator=gen) * 0.3 if option == "alibi" else None
    softcap = 2.0 if option == "softcap" else 0.0
    out, lse, probs = flash_attn_func(
        q,
        k,
        v,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=slopes,
        return_attn_probs=True,
    )
    bias = None
    if slopes is not None:
        bias = alibi_bias(
            slopes, seqlen_q, seqlen_k, torch.full((2,), seqlen_q), torch.full((2,), seqlen_k)
        )
    truth, weights, truth_lse = attention_ref(
        q, k, v, causal=causal, window=window, softcap=softcap, bias=bias
    )
    assert probs.shape == (2, 4, seqlen_q, seqlen_k) and lse.shape == (2, 4, seqlen_q)
    torch.testing.assert_close(probs, weights, rtol=0, atol=1e-13)
    torch.testing.assert_close(out, truth, rtol=0, atol=1e-12)
    empty = torch.isinf(truth_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] == math.inf).all())
    if slopes is not None and causal and option == "alibi":
        # flash-attn's causal kernel adds slope · j (the same softmax), so its lse is
        # larger by slope · (i + Lk − Lq)
        shift = slopes.double()[None, :, None] * (torch.arange(seqlen_q) + seqlen_k - seqlen_q)
        truth_lse = truth_lse + shift
    torch.testing.assert_close(lse[~empty], truth_lse[~empty], rtol=0, atol=1e-12)


def test_float32_lse_is_float32() -> None:
    """flash-attn returns its lse in float32."""
    q = torch.randn(1, 4, 2, 8)
    _, lse, probs = flash_attn_func(q, q, q, return_attn_probs=True)
    assert lse.dtype == torch.float32 and probs.dtype == torch.float32


@pytest.mark.parametrize("kind", ["func", "kvpacked", "qkvpacked"])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout(kind: str, causal: bool) -> None:
    """flash-attn's dropout checks: the pattern from S_dmask's sign, the fraction dropped
    within 0.01 of dropout_p, the output and gradients equal to the reference's with it."""
    torch.manual_seed(0)
    p = 0.17
    batch, seqlen, heads, dim = 4, 128, 4, 32
    q, k, v = (
        torch.randn(batch, seqlen, heads, dim, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    out, _, s_dmask = _call(kind, q, k, v, dropout_p=p, causal=causal, return_attn_probs=True)
    keep = s_dmask >= 0
    truth, weights, _ = attention_ref(q, k, v, dropout_p=p, keep=keep, causal=causal)
    torch.testing.assert_close(s_dmask.abs(), weights, rtol=0, atol=1e-13)
    valid = torch.ones_like(keep)
    if causal:
        valid = torch.ones(seqlen, seqlen, dtype=torch.bool).tril().expand_as(keep)
    dropped = 1 - keep[valid].double().mean().item()
    assert abs(dropped - p) <= 0.01
    torch.testing.assert_close(out, truth, rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    for ours, exact in zip(
        torch.autograd.grad(out, (q, k, v), grad),
        torch.autograd.grad(truth, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(ours, exact, rtol=0, atol=1e-11)


def test_dropout_follows_torch_seed() -> None:
    """The same torch seed drops the same weights; another seed drops others."""
    q = torch.randn(1, 32, 2, 16)
    torch.manual_seed(3)
    first = flash_attn_func(q, q, q, dropout_p=0.5)
    torch.manual_seed(3)
    again = flash_attn_func(q, q, q, dropout_p=0.5)
    other = flash_attn_func(q, q, q, dropout_p=0.5)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_softmax_scale_and_deterministic() -> None:
    """``softmax_scale`` replaces 1/√d; ``deterministic`` is accepted (qkv always is)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = flash_attn_func(q, k, v, softmax_scale=0.3, deterministic=True)
    truth, _, _ = attention_ref(q * (0.3 * math.sqrt(8)), k, v)
    torch.testing.assert_close(out, truth, rtol=0, atol=1e-12)


def test_causal_more_queries_than_keys_gives_zero_rows() -> None:
    """flash-attn's docstring: seqlen_q = 5, seqlen_k = 2, causal: rows 0–2 see no key."""
    q, k, v = torch.randn(1, 5, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out[0, :3], torch.zeros(3, 1, 8))
    last = torch.softmax(q[0, 4] @ k[0, :, 0].T / math.sqrt(8), dim=-1) @ v[0, :, 0]  # (1, 8)
    torch.testing.assert_close(out[0, 4], last)
