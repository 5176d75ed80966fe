"""The sdpa backend's cheap look on CPU (kernels/_torch_sdpa.flash_forward): torch's flash
kernel run with its log-sum-exp, whose finite log-sum-exps and finite last output row vouch
for the inputs. It must give SDPA's output bit for bit, call clean only what is clean, and
leave every other call to the full check, so that qkv's results do not change."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.attention._plans import PLANS
from qkv.kernels import _torch_sdpa
from qkv.kernels._torch_sdpa import FLASH_LSE_KEYS, TORCH_SDPA, flash_applies, flash_forward
from qkv.masks import Alignment


def _inputs(
    q_len: int, kv_len: int, *, dtype: torch.dtype = torch.float32, seed: int = 0, d_v: int = 16
) -> list[torch.Tensor]:
    """(2, 3, L, 16) query and key, values of ``d_v`` (torch runs its flash kernel for 16 only)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, 3, q_len, 16), (2, 3, kv_len, 16), (2, 3, kv_len, d_v))
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "tokens-first"])
def test_the_flash_output_is_sdpas_bit_for_bit(
    dtype: torch.dtype, causal: bool, layout: str
) -> None:
    q, k, v = _inputs(40, 40 if causal else 33, dtype=dtype)
    if layout == "tokens-first":  # (B, L, H, D) seen as (B, H, L, D), as models hold them
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    found = flash_forward(q, k, v, is_causal=causal, scale=None)
    assert found is not None
    out, clean = found
    want = TORCH_SDPA(q, k, v, is_causal=causal)
    assert clean
    assert torch.equal(out, want)
    assert out.stride() == want.stride()


def test_torch_hides_a_nan_query_row_below_the_key_threshold() -> None:
    """Why FLASH_LSE_KEYS: with fewer keys torch's CPU flash kernel gives a NaN query row
    zeros and a log-sum-exp of 0, so the log-sum-exp cannot vouch; from it on, NaN."""
    flash = torch._scaled_dot_product_flash_attention_for_cpu
    for kv_len, hidden in ((FLASH_LSE_KEYS - 1, True), (FLASH_LSE_KEYS, False), (100, False)):
        q, k, v = _inputs(4, kv_len)
        q[0, 1, 2, 5] = math.nan
        _, lse = flash(q, k, v, 0.0, False)
        assert bool(torch.isfinite(lse[0, 1, 2])) is hidden, kv_len
    q, k, v = _inputs(4, FLASH_LSE_KEYS - 1)
    assert not flash_applies(q, k, v, is_causal=False)


def test_no_look_where_the_last_row_does_not_see_every_key_or_a_gradient_follows() -> None:
    q, k, v = _inputs(20, 40)
    assert flash_applies(q, k, v, is_causal=False)
    assert not flash_applies(q, k, v, is_causal=True)  # top-left: keys 20.. are masked
    q.requires_grad_()
    assert not flash_applies(q, k, v, is_causal=False)
    with torch.no_grad():
        assert flash_applies(q, k, v, is_causal=False)


def test_a_masked_out_nan_value_is_not_called_clean() -> None:
    """Causal: torch's kernel lets the NaN of a future value reach earlier rows of its
    block; the last row weighs it, so the look sends the call to the full check."""
    q, k, v = _inputs(40, 40)
    v[1, 2, 30, 3] = math.nan
    found = flash_forward(q, k, v, is_causal=True, scale=None)
    assert found is not None and not found[1]
    out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not bool(out[1, 2, :30].isnan().any())  # rows before 30 never see it
    assert bool(out[1, 2, 30:, 3].isnan().all())


_POISON = st.sampled_from([math.nan, math.inf, -math.inf])


@settings(max_examples=60, deadline=None)
@given(
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    causal=st.booleans(),
    alignment=st.sampled_from(["top-left", "bottom-right"]),
    d_v=st.sampled_from([8, 16]),
    poison=st.lists(st.tuples(st.sampled_from("qkv"), st.integers(0, 10**6), _POISON), max_size=3),
)
def test_planned_calls_with_the_look_equal_the_full_check(
    q_len: int,
    kv_len: int,
    causal: bool,
    alignment: Alignment,
    d_v: int,
    poison: list[tuple[str, int, float]],
) -> None:
    """Every planned call, NaN and ±inf anywhere or nowhere: bit for bit (NaN in the same
    places) what qkv gave with the full check alone; a clean bottom-right call run in two
    parts, to rounding."""
    q, k, v = _inputs(q_len, kv_len, seed=q_len * 41 + kv_len, d_v=d_v)
    tensors = {"q": q, "k": k, "v": v}
    for name, where, value in poison:
        flat = tensors[name].view(-1)
        flat[where % flat.numel()] = value

    def run() -> torch.Tensor:
        PLANS.clear()
        first = qkv.scaled_dot_product_attention(
            q, k, v, is_causal=causal, causal_alignment=alignment
        )
        again = qkv.scaled_dot_product_attention(
            q, k, v, is_causal=causal, causal_alignment=alignment
        )  # planned
        torch.testing.assert_close(first, again, rtol=0, atol=0, equal_nan=True)
        planned: torch.Tensor = again
        return planned

    looked = run()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_torch_sdpa, "flash_applies", lambda *a, **k: False)
        patch.setattr(_torch_sdpa, "flash_causal_flag", lambda *a, **k: None)
        checked = run()
    split = causal and alignment == "bottom-right" and FLASH_LSE_KEYS <= q_len <= kv_len - 16
    exact = 0.0 if poison or not split else 1e-6  # two parts merged: not SDPA's bits
    torch.testing.assert_close(looked, checked, rtol=exact, atol=exact, equal_nan=True)
    if not poison:
        want = qkv.scaled_dot_product_attention(
            q.double(),
            k.double(),
            v.double(),
            is_causal=causal,
            causal_alignment=alignment,
            backend="reference",
        )
        np.testing.assert_allclose(looked.double().numpy(), want.numpy(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bottom_right_queries_after_a_prefix_run_the_flash_kernel_in_two_parts(
    dtype: torch.dtype,
) -> None:
    """Lq queries that are the last of Lk keys (a chunk of a prefill after a cache, a
    patching sweep that starts at a later position): the keys every query sees, then the last
    Lq causal, merged by their log-sum-exps, with no (Lq, Lk) mask. Equal to the float64
    reference; a NaN anywhere is not called clean and goes to the full check."""
    q, k, v = _inputs(24, 64, dtype=dtype)
    flag = _torch_sdpa.flash_causal_flag(q, k, v, is_causal=True, alignment="bottom-right")
    assert flag == _torch_sdpa.BOTTOM_RIGHT
    found = flash_forward(q, k, v, is_causal=flag, scale=None)
    assert found is not None and found[1]
    want = qkv.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, causal_alignment="bottom-right",
        backend="reference",
    )  # fmt: skip
    tolerance = 2e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(found[0].double(), want, rtol=tolerance, atol=tolerance)
    PLANS.clear()
    out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom-right")
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    for name, where in (("v", (0, 1, 10, 2)), ("k", (1, 0, 50, 0))):  # a seen key, a causal one
        poisoned = {"k": k.clone(), "v": v.clone()}
        poisoned[name][where] = math.nan
        again = flash_forward(q, poisoned["k"], poisoned["v"], is_causal=flag, scale=None)
        assert again is not None and not again[1]
    few = q[..., :8, :]  # under FLASH_LSE_KEYS queries: the dense mask, as before
    assert (
        _torch_sdpa.flash_causal_flag(few, k, v, is_causal=True, alignment="bottom-right") is None
    )
