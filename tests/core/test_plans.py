"""Plain calls repeated with one signature skip the checks and dispatch (attention/_plans.py):
what a user sees must not change. The second call of a signature gives the reference's
numbers on its own values (NaN and ±inf included), a different option or gradient flag is
a different signature, and a bad call still gets its one-line error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qkv
from qkv.attention import reference_attention
from qkv.attention._plans import PLAN_LIMIT, PLANS


@pytest.fixture(autouse=True)
def _no_plans() -> None:
    PLANS.clear()


def _qkv(seed: int, length: int = 64, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, length, 16, generator=gen, dtype=dtype) for _ in range(3)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> np.ndarray:
    out = reference_attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), is_causal=causal
    )
    return np.asarray(out)


@pytest.mark.parametrize("causal", [False, True])
def test_a_repeated_signature_computes_each_calls_own_numbers(causal: bool) -> None:
    for seed in range(3):
        q, k, v = _qkv(seed)
        out = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal)
        np.testing.assert_allclose(out.numpy(), _reference(q, k, v, causal), rtol=1e-10, atol=1e-12)
    assert len(PLANS) == 1  # one signature, planned on its first call


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["query row", "every key", "a value"])
def test_nan_after_a_planned_call_is_still_the_references(causal: bool, where: str) -> None:
    q, k, v = _qkv(0, dtype=torch.float32)
    qkv.scaled_dot_product_attention(q, k, v, is_causal=causal)  # plans the signature
    q, k, v = (x.clone() for x in _qkv(1, dtype=torch.float32))
    if where == "query row":
        q[1, 2, 5, 3] = math.nan
    elif where == "every key":
        k[0, 1, :, 0] = math.nan
    else:
        v[0, 3, 40, 7] = math.nan
    out = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want = _reference(q, k, v, causal)
    np.testing.assert_array_equal(np.isnan(out.numpy()), np.isnan(want))
    live = ~np.isnan(want)
    np.testing.assert_allclose(out.numpy()[live], want[live], rtol=2e-5, atol=2e-6)


def test_zero_values_rows_are_right_on_a_planned_call() -> None:
    """A row of zeros is lawful (zero values): the quick look at the output hands it to
    the full check, which trusts torch's result."""
    q, k, v = _qkv(0)
    qkv.scaled_dot_product_attention(q, k, v)
    v = torch.zeros_like(v)
    out = qkv.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, torch.zeros_like(out))


def test_options_and_gradient_flags_make_their_own_signature() -> None:
    q, k, v = _qkv(0)
    qkv.scaled_dot_product_attention(q, k, v)
    qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    qkv.scaled_dot_product_attention(q, k, v, scale=0.5)
    qkv.scaled_dot_product_attention(q.requires_grad_(), k, v)
    with torch.no_grad():
        qkv.scaled_dot_product_attention(q, k, v)
    assert len(PLANS) == 5
    out = qkv.scaled_dot_product_attention(q, k, v, scale=0.5)
    want = reference_attention(q.detach().numpy(), k.numpy(), v.numpy(), scale=0.5)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-10)


def test_gradients_through_a_planned_call_match_the_reference() -> None:
    q, k, v = _qkv(2)
    qkv.scaled_dot_product_attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    q, k, v = (x.requires_grad_() for x in _qkv(3))
    grads = torch.autograd.grad(qkv.scaled_dot_product_attention(q, k, v).sum(), (q, k, v))
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    scores = ref[0] @ ref[1].transpose(-1, -2) / 4.0
    want = torch.autograd.grad((scores.softmax(-1) @ ref[2]).sum(), ref)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_no_plan_for_calls_that_carry_arrays_or_a_trace() -> None:
    q, k, v = _qkv(0)
    qkv.scaled_dot_product_attention(q, k, v, mask=torch.ones(64, 64, dtype=torch.bool))
    qkv.scaled_dot_product_attention(q, k, v, backend="tiled")  # tiled ran: nothing kept
    with qkv.tracing():
        qkv.scaled_dot_product_attention(q, k, v)
    qkv.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy())
    assert len(PLANS) == 0


def test_a_bad_call_still_gets_its_error_after_a_good_one() -> None:
    q, k, v = _qkv(0)
    qkv.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="query has 4 heads but key and value have 2"):
        qkv.scaled_dot_product_attention(q, k[:, :2], v[:, :2])


def test_plans_are_bounded() -> None:
    for length in range(2, PLAN_LIMIT + 12):
        x = torch.zeros(1, 1, length, 4)
        qkv.scaled_dot_product_attention(x, x, x)
    assert len(PLANS) == PLAN_LIMIT
