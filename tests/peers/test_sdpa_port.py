"""PyTorch's own SDPA expectations, ported to qkv (the ones whose semantics qkv shares).

Source: pytorch/pytorch, ``test/test_transformers.py`` (classes ``TestTransformers``,
``TestSDPAFailureModes``, ``TestSDPA``, ``TestSDPACpuOnly``, ``TestSDPACudaOnly`` and the
module-level ``test_causal_variants``). Each test below names the torch test it ports. The
code is written for qkv; torch's MATH backend (or a plain softmax formula) is the oracle, and
every qkv backend that can run the call is held to it.

Deliberate differences (docs/attention.md, "Where qkv differs from torch, and why"), tested
as qkv's own behaviour rather than torch's:

- ``is_causal=True`` together with a mask combines the two (torch raises);
- an empty sequence (Lq = 0 or Lk = 0) raises ValueError (torch returns an empty tensor or
  zeros); an empty batch gives an empty result, as in torch;
- a bottom-right causal mask with Lq > Lk gives zero rows (torch: NaN, its test skips it);
- wrong dtypes or shapes raise TypeError/ValueError naming the argument (torch:
  RuntimeError);
- dropout follows qkv's own pattern (``qkv.masks.dropout_keep``), not torch's generator, so
  the dropout variants of torch's tests are not ported.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import qkv
from tests.support.backends import backend_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST = backend_names(reference=False, auto=True)
ALL = backend_names(auto=True)

# torch/testing/_comparison.py defaults, as test_transformers.py uses them.
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-5, torch.float64: 1e-7}
RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6, torch.float64: 1e-7}


def _math(*args: Any, **kwargs: Any) -> torch.Tensor:
    """torch's MATH backend: the oracle of torch's own tests."""
    with sdpa_kernel(backends=[SDPBackend.MATH]):
        out: torch.Tensor = functional.scaled_dot_product_attention(*args, **kwargs)
    return out


def _qkv(backend: Any, q: Any, k: Any, v: Any, **options: Any) -> torch.Tensor:
    out: torch.Tensor = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **options)
    return out


def _mask_options(mask: torch.Tensor | None) -> dict[str, Any]:
    """torch's attn_mask in qkv's words: boolean → mask (True = may attend), float → bias."""
    if mask is None:
        return {}
    return {"mask": mask} if mask.dtype == torch.bool else {"bias": mask}


def _check(actual: torch.Tensor, expected: torch.Tensor, what: str, scale: float = 1.0) -> None:
    dtype = expected.dtype
    torch.testing.assert_close(
        actual,
        expected,
        atol=ATOL[dtype] * scale,
        rtol=max(RTOL[dtype], 1e-5 if dtype == torch.float32 else 0.0) * scale,
        equal_nan=True,
        msg=what,
    )


# -- TestTransformers.test_scaled_dot_product_attention -----------------------------------
# Inputs of 3 and 4 dimensions, masks of 2, 3 or 4 dimensions, is_causal, float and double,
# against the math reference (dropout_p = 0: see the module docstring).


@pytest.mark.parametrize(
    ("input_dim", "attn_mask_dim", "is_causal"),
    [
        *[(3, None, False), (3, 2, False), (3, 2, True), (3, 3, False), (3, 3, True)],
        *[(4, None, False), (4, 2, False), (4, 2, True), (4, 4, False), (4, 4, True)],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scaled_dot_product_attention(
    input_dim: int, attn_mask_dim: int | None, is_causal: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(input_dim * 10 + (attn_mask_dim or 0))
    n, n_prime, lq, s, e = 5, 2, 4, 3, 6
    lead = (n,) if input_dim == 3 else (n, n_prime)
    query = torch.randn(*lead, lq, e, generator=gen, dtype=dtype)
    key = torch.randn(*lead, s, e, generator=gen, dtype=dtype)
    value = torch.randn(*lead, s, e, generator=gen, dtype=dtype)
    mask = None
    if attn_mask_dim is not None:
        size = (lq, s) if attn_mask_dim == 2 else (*lead, lq, s)
        mask = (
            torch.ones(size, dtype=torch.bool).tril()
            if is_causal
            else torch.randint(0, 2, size, generator=gen, dtype=torch.bool)
        )
    if is_causal:
        # torch: "NB: Don't pass attn_mask here" (is_causal alone) ...
        expected = _math(query, key, value, is_causal=True)
        for backend in ALL:
            _check(_qkv(backend, query, key, value, is_causal=True), expected, backend)
        # ... and it raises for both; qkv combines them (a documented difference).
        with pytest.raises(RuntimeError, match="attn_mask should not be set"):
            _math(query, key, value, attn_mask=mask, is_causal=True)
        both = _qkv("auto", query, key, value, mask=mask, is_causal=True)
        _check(both, expected, "causal & tril mask = causal")
        return
    expected = _math(query, key, value, attn_mask=mask)
    for backend in ALL:
        _check(_qkv(backend, query, key, value, mask=mask), expected, backend)


# -- TestSDPA.test_sdp_math_gradcheck ------------------------------------------------------


@pytest.mark.parametrize("contiguous_inputs", [True, False])
@pytest.mark.parametrize("backend", backend_names())
def test_sdp_math_gradcheck(contiguous_inputs: bool, backend: str) -> None:
    batch_size, seq_len, num_heads, head_dim = 2, 4, 2, 4
    gen = torch.Generator().manual_seed(0)
    packed = torch.randn(batch_size, seq_len, 3 * num_heads * head_dim, generator=gen)
    packed = packed.double().requires_grad_(True)
    parts = packed.chunk(3, dim=-1)
    q, k, v = (x.view(batch_size, -1, num_heads, head_dim).transpose(1, 2) for x in parts)
    if contiguous_inputs:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _qkv(backend, q, k, v)

    assert torch.autograd.gradcheck(attend, (q, k, v))


# -- TestSDPACpuOnly.test_scaled_dot_product_fused_attention_vs_math_cpu ---------------------
# (sizes reduced; the fused kernel's place is taken by each qkv backend)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("train", [True, False])
def test_scaled_dot_product_fused_attention_vs_math_cpu(
    dtype: torch.dtype, causal: bool, train: bool
) -> None:
    atol, rtol = 1e-5, 5e-6
    if dtype is torch.bfloat16:
        atol, rtol = 5e-2, 5e-2
    if dtype is torch.float16:
        atol, rtol = 1e-2, 1e-2
    batch_size, seq_len, n_head, head_dim = 2, 67, 3, 8
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, seq_len, 3 * n_head * head_dim, generator=gen).to(dtype)

    def heads(t: torch.Tensor) -> list[torch.Tensor]:
        return [
            p.view(batch_size, seq_len, n_head, head_dim).transpose(1, 2)
            for p in t.split(n_head * head_dim, dim=2)
        ]

    x_ref = x.detach().float() if dtype in (torch.bfloat16, torch.float16) else x.detach()
    x_ref.requires_grad_(train)
    math_ref = _math(*heads(x_ref), is_causal=causal)
    if train:
        math_ref.sum().backward()
    for backend in FAST:
        x_qkv = x.detach().clone().requires_grad_(train)
        actual = _qkv(backend, *heads(x_qkv), is_causal=causal)
        torch.testing.assert_close(actual, math_ref.to(dtype), atol=atol, rtol=rtol)
        if train:
            actual.sum().backward()
            assert x_qkv.grad is not None and x_ref.grad is not None
            torch.testing.assert_close(x_qkv.grad, x_ref.grad.to(dtype), atol=atol, rtol=rtol)


# -- TestSDPACpuOnly.test_scaled_dot_product_fused_attention_mask_vs_math_cpu ---------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_dim", [2, 4])
@pytest.mark.parametrize("bool_mask", [False, True])
def test_scaled_dot_product_fused_attention_mask_vs_math_cpu(
    dtype: torch.dtype, mask_dim: int, bool_mask: bool
) -> None:
    atol, rtol = 1e-5, 5e-6
    if dtype is torch.bfloat16:
        atol, rtol = 5e-2, 5e-2
    if dtype is torch.float16:
        atol, rtol = 1e-2, 1e-2
    batch_size, q_seq_len, kv_seq_len, n_head, head_dim = 2, 27, 54, 3, 8
    gen = torch.Generator().manual_seed(2)
    shapes = (
        itertools.product([q_seq_len, 1], [kv_seq_len, 1])
        if mask_dim == 2
        else itertools.product([batch_size, 1], [n_head, 1], [q_seq_len, 1], [kv_seq_len, 1])
    )
    for mask_shape in shapes:
        q = torch.randn(batch_size, n_head, q_seq_len, head_dim, generator=gen).to(dtype)
        k = torch.randn(batch_size, n_head, kv_seq_len, head_dim, generator=gen).to(dtype)
        v = torch.randn(batch_size, n_head, kv_seq_len, head_dim, generator=gen).to(dtype)
        if bool_mask:
            attn_mask = torch.randint(0, 2, mask_shape, generator=gen, dtype=torch.bool)
        else:
            attn_mask = torch.randn(mask_shape, generator=gen).to(dtype)
        upcast = dtype in (torch.bfloat16, torch.float16)
        ref_args = [t.float() if upcast else t for t in (q, k, v)]
        ref_mask = attn_mask.float() if upcast and not bool_mask else attn_mask
        math_ref = _math(*ref_args, attn_mask=ref_mask).to(dtype)
        for backend in FAST:
            actual = _qkv(backend, q, k, v, **_mask_options(attn_mask))
            torch.testing.assert_close(
                actual, math_ref, atol=atol, rtol=rtol, msg=f"{backend} {mask_shape}"
            )


# -- TestSDPACpuOnly.test_scaled_dot_product_fused_attention_with_inf ------------------------
# An additive mask of −inf outside a band of 10 keys (pytorch issue 127055).


def test_scaled_dot_product_fused_attention_with_inf() -> None:
    full = torch.full((600, 600), float("-inf"))
    mask = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-10)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 600, 8, generator=gen) for _ in range(3))
    math_ref = _math(q, k, v, attn_mask=mask)
    for backend in FAST:
        _check(_qkv(backend, q, k, v, bias=mask), math_ref, backend, scale=2.0)


# -- TestSDPA.test_scaled_dot_product_attention_math_with_negative_scale ---------------------
# (pytorch issue 105190)


def test_scaled_dot_product_attention_math_with_negative_scale() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 64, 64, generator=gen)
    ref = torch.matmul((torch.matmul(x, x.transpose(-1, -2)) / -0.0001).softmax(dim=-1), x)
    for backend in ALL:
        _check(_qkv(backend, x, x, x, scale=-1.0 / 0.0001), ref, backend, scale=10.0)


# -- TestSDPA.test_scaled_dot_product_attention_fp16_overflow (pytorch issue 160841) and
# -- TestSDPAFailureModes.test_flash_atteention_large_bf16_nan_values -----------------------


@pytest.mark.parametrize(
    ("dtype", "fill", "shape"),
    [(torch.float16, 256.0, (1, 32, 23, 80)), (torch.bfloat16, 133120.0, (1, 1, 1, 64))],
)
def test_large_half_inputs_give_no_nan(
    dtype: torch.dtype, fill: float, shape: tuple[int, ...]
) -> None:
    x = torch.full(shape, fill, dtype=dtype)
    for backend in ALL:
        out = _qkv(backend, x, x, x)
        assert not bool(out.isnan().any()), backend
        assert bool((out == fill).all()), backend  # equal scores: the mean of equal values


# -- TestSDPACudaOnly.test_mem_eff_attention_large_seq_len_uniform_attention ------------------
# (49999 queries there; the expectation does not depend on the size)


@pytest.mark.parametrize("backend", FAST)
def test_large_seq_len_uniform_attention(backend: str) -> None:
    num_queries, num_heads, feature_dim = 999, 2, 16
    query = torch.zeros(1, num_heads, num_queries, feature_dim, requires_grad=True)
    key = torch.zeros(1, num_heads, num_queries, feature_dim, requires_grad=True)
    value = torch.ones(1, num_heads, num_queries, feature_dim, requires_grad=True)
    mask = torch.ones((num_queries, num_queries), dtype=torch.bool)
    output = _qkv(backend, query, key, value, mask=mask)
    output.backward(torch.ones_like(output))
    assert torch.allclose(output, torch.ones_like(output))
    assert query.grad is not None and key.grad is not None and value.grad is not None
    assert torch.allclose(query.grad, torch.zeros_like(query))
    assert torch.allclose(key.grad, torch.zeros_like(key))
    assert torch.allclose(value.grad, torch.ones_like(value), atol=1e-4)


# -- test_causal_variants (CausalVariant.UPPER_LEFT / LOWER_RIGHT, Lq ≠ Lk) ------------------


@pytest.mark.parametrize(
    ("variant", "alignment"),
    [(causal_upper_left, "top-left"), (causal_lower_right, "bottom-right")],
)
@pytest.mark.parametrize(
    "shapes", [(2, 2, 16, 16, 8), (2, 2, 16, 32, 8), (2, 2, 32, 16, 8), (1, 1, 23, 56, 15)]
)
def test_causal_variants(variant: Any, alignment: str, shapes: tuple[int, ...]) -> None:
    bsz, num_heads, seq_len_q, seq_len_kv, head_dim = shapes
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(bsz, num_heads, seq_len_q, head_dim, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(bsz, num_heads, seq_len_kv, head_dim, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    options = {"is_causal": True, "causal_alignment": alignment}
    if alignment == "bottom-right" and seq_len_q > seq_len_kv:
        # torch: "Lower right causal mask will produce NaNs ... when seq_len_q > seq_len_kv"
        # (its test skips); in qkv those first rows see no key and are zero.
        dead = seq_len_q - seq_len_kv
        for backend in ALL:
            out = _qkv(backend, q, k, v, **options)
            assert bool((out[:, :, :dead] == 0).all()), backend
            assert bool(torch.isfinite(out).all()), backend
        return
    expected = _math(q, k, v, attn_mask=variant(seq_len_q, seq_len_kv))
    weight = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    (_math(*leaves, attn_mask=variant(seq_len_q, seq_len_kv)) * weight).sum().backward()
    grads = [t.grad for t in leaves]
    for backend in ALL:
        mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = _qkv(backend, *mine, **options)
        _check(out, expected, backend)
        (out * weight).sum().backward()
        for name, got, want in zip("QKV", (t.grad for t in mine), grads, strict=True):
            assert got is not None and want is not None
            _check(got, want, f"{backend}: d{name}")


# -- TestSDPAFailureModes.test_invalid_inputs_different_datatypes / _1_dimensional_inputs ----
# torch raises RuntimeError; qkv raises TypeError / ValueError naming the argument.


def test_invalid_inputs_different_datatypes() -> None:
    shape = (1, 4, 8, 16)
    query = torch.randn(shape, dtype=torch.float32)
    key = torch.randn(shape, dtype=torch.float16)
    value = torch.randn(shape, dtype=torch.float16)
    with pytest.raises(RuntimeError):
        functional.scaled_dot_product_attention(query, key, value)
    with pytest.raises(TypeError, match="query is float32 but key is float16"):
        qkv.scaled_dot_product_attention(query, key, value)


def test_invalid_inputs_1_dimensional_inputs() -> None:
    query = torch.randn(4, dtype=torch.float16)
    key = torch.randn((1, 4), dtype=torch.float16)
    value = torch.randn((1, 4), dtype=torch.float16)
    with pytest.raises(RuntimeError):
        functional.scaled_dot_product_attention(query, key, value)
    with pytest.raises(ValueError, match="query must have at least 2 dimensions"):
        qkv.scaled_dot_product_attention(query, key, value)


# -- Batch and sequence sizes of 0 (TestSDPAFailureModes.test_invalid_sequence_lengths) -------


@pytest.mark.parametrize("backend", ALL)
def test_empty_batch_like_torch(backend: str) -> None:
    q = torch.randn(0, 2, 5, 8)
    assert _math(q, q, q).shape == _qkv(backend, q, q, q).shape == (0, 2, 5, 8)


def test_empty_sequences_are_refused() -> None:
    q, k = torch.randn(2, 2, 0, 8), torch.randn(2, 2, 3, 8)
    assert _math(q, k, k).shape == (2, 2, 0, 8)  # torch: an empty result; qkv: an error
    with pytest.raises(ValueError, match="query is an empty sequence"):
        qkv.scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="key is an empty sequence"):
        qkv.scaled_dot_product_attention(k, q, q)


# -- Fully masked rows (torch ≥ 2.5 gives them zeros, on MATH and the fused kernels) ---------


@pytest.mark.parametrize("backend", ALL)
def test_fully_masked_rows_are_zero_with_zero_gradients(backend: str) -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randint(0, 2, (2, 1, 5, 5), generator=gen, dtype=torch.bool)
    mask[0, :, 1] = False
    mask[1, :, 3] = False
    weight = torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64)
    theirs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = _math(*theirs, attn_mask=mask)
    (expected * weight).sum().backward()
    assert bool((expected[0, :, 1] == 0).all())
    mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = _qkv(backend, *mine, mask=mask)
    _check(out, expected.detach(), backend)
    (out * weight).sum().backward()
    for name, got, want in zip("QKV", mine, theirs, strict=True):
        assert got.grad is not None and want.grad is not None
        _check(got.grad, want.grad, f"{backend}: d{name}")


# -- enable_gqa: the same as repeating each key/value head ---------------------------------


@pytest.mark.parametrize("backend", ALL)
def test_enable_gqa_equals_repeated_heads(backend: str) -> None:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 8, 9, 16, generator=gen)
    k, v = (torch.randn(2, 2, 11, 16, generator=gen) for _ in range(2))
    expected = _math(q, k, v, enable_gqa=True)
    repeated = _math(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1))
    _check(expected, repeated, "torch")
    _check(_qkv(backend, q, k, v, enable_gqa=True), expected, backend)


# -- More than 4 dimensions: torch documents (N, ..., L, E) -------------------------------


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_more_than_four_dimensions(backend: str) -> None:
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    _check(_qkv(backend, q, k, v, is_causal=True), _math(q, k, v, is_causal=True), backend)


# -- scale ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5])
def test_scale(scale: float) -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 7, 8, generator=gen) for _ in range(3))
    expected = _math(q, k, v, scale=scale)
    for backend in ALL:
        _check(_qkv(backend, q, k, v, scale=scale), expected, backend)


# -- NaN propagation: torch's MATH backend gives NaN to a row whose query holds a NaN ---------
# (torch's fused CPU kernel gives zeros there; qkv follows MATH on every backend)


@pytest.mark.parametrize("backend", ALL)
def test_nan_query_row_is_nan_as_in_math(backend: str) -> None:
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))
    q[0, 0, 1, 3] = math.nan
    _check(_qkv(backend, q, k, v), _math(q, k, v), backend)
