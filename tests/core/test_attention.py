"""The reference algorithm: hand-checked numbers, the numerics policy, namespaces and dtypes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import masks

# Seed 000, "I love statistics".
X = np.array([[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]])
W_Q = np.array([[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]])
W_K = np.array([[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]])
W_V = np.array([[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]])
LOVE = 1


def test_seed_000_numbers_for_love() -> None:
    """The correct numbers (not the seed's printed ones), checked by hand."""
    trace = qkv.Trace()
    context, weights = qkv.self_attention(X, W_Q, W_K, W_V, return_weights=True, trace=trace)
    assert trace["Q"].value[LOVE] == pytest.approx([0.50, 0.80])
    assert trace["K"].value == pytest.approx(np.array([[0.76, 0.92], [0.90, 1.02], [0.87, 1.13]]))
    assert trace["V"].value == pytest.approx(np.array([[0.48, 0.73], [0.60, 0.92], [0.53, 0.80]]))
    assert trace["scores"].value[LOVE] == pytest.approx([1.116, 1.266, 1.339])
    assert trace["scaled"].value[LOVE] == pytest.approx(np.array([1.116, 1.266, 1.339]) / 2**0.5)
    assert weights[LOVE].round(4) == pytest.approx([0.3046, 0.3387, 0.3567])
    assert context[LOVE].round(4) == pytest.approx([0.5385, 0.8193])


def test_seed_000_without_scaling() -> None:
    scores = np.array([1.116, 1.266, 1.339])
    expected = np.exp(scores) / np.exp(scores).sum()
    _, weights = qkv.self_attention(X, W_Q, W_K, W_V, scale=1.0, return_weights=True)
    assert weights[LOVE] == pytest.approx(expected, abs=1e-12)


def test_two_keys_give_one_and_e() -> None:
    """q·k = 0 and √2, scaled by 1/√2: weights [1, e] / (1 + e)."""
    q = np.array([[0.0, math.sqrt(2)]])
    k = np.array([[0.0, 0.0], [0.0, 1.0]])
    _, weights = qkv.scaled_dot_product_attention(q, k, k, return_weights=True)
    assert weights[0] == pytest.approx(np.array([1.0, math.e]) / (1 + math.e), abs=1e-15)


def test_context_is_weighted_sum_of_values() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(4, 3)), rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    context, weights = qkv.scaled_dot_product_attention(q, k, v, return_weights=True)
    for i in range(4):
        assert context[i] == pytest.approx(sum(weights[i, j] * v[j] for j in range(5)))


def test_custom_scale_multiplies_scores() -> None:
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    _, weights = qkv.scaled_dot_product_attention(q, k, v, scale=0.3, return_weights=True)
    assert weights == pytest.approx(qkv.softmax(0.3 * q @ k.T), abs=1e-15)


# -- numerics policy ---------------------------------------------------------------------------


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_fully_masked_row_gives_zeros_not_nan(lib: str) -> None:
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    mask = np.ones((3, 5), dtype=bool)
    mask[1] = False
    args: list[Any] = [q, k, v, mask]
    if lib == "torch":
        args = [torch.from_numpy(a) for a in args]
    context, weights = qkv.scaled_dot_product_attention(
        *args[:3], mask=args[3], return_weights=True
    )
    context, weights = np.asarray(context), np.asarray(weights)
    assert np.isfinite(context).all() and np.isfinite(weights).all()
    assert (weights[1] == 0).all() and (context[1] == 0).all()
    assert weights[[0, 2]].sum(axis=-1) == pytest.approx([1.0, 1.0])


def test_softmax_subtracts_row_max() -> None:
    scores = np.array([[1000.0, 1000.0 + math.log(3)], [-1000.0, -1000.0]])
    assert qkv.softmax(scores) == pytest.approx(np.array([[0.25, 0.75], [0.5, 0.5]]))


def test_nan_and_inf_in_padding_never_reach_the_output() -> None:
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 2))
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[0, 3:], v_bad[0, 3:] = np.nan, np.inf  # padding of the first sequence
    v_bad[1, 4] = -np.inf
    lengths = masks.key_padding([3, 4])
    expected = qkv.scaled_dot_product_attention(q, k, v, mask=lengths)
    got = qkv.scaled_dot_product_attention(q, k_bad, v_bad, mask=lengths)
    assert np.isfinite(got).all()
    assert got == pytest.approx(expected, abs=1e-15)


def test_nan_in_a_future_value_reaches_only_the_queries_that_see_it() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 3))
    v = x.copy()
    v[2, 0] = np.nan
    context = qkv.scaled_dot_product_attention(x, x, v, is_causal=True)
    assert np.isfinite(context[:2]).all()  # queries 0 and 1 cannot see key 2
    assert np.isnan(context[2:, 0]).all() and np.isfinite(context[2:, 1]).all()


def test_inf_value_that_is_attended_gives_inf() -> None:
    v = np.array([[1.0], [np.inf]])
    context = qkv.scaled_dot_product_attention(np.ones((1, 1)), np.ones((2, 1)), v)
    assert context[0, 0] == np.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 32, generator=gen).to(dtype) for _ in range(3))
    out = qkv.scaled_dot_product_attention(q, k, v, backend="reference")
    assert out.dtype == dtype
    reference = qkv.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), backend="reference"
    )
    assert torch.equal(out, reference.to(dtype))  # the same float32 math, rounded once


def test_keeps_namespace_dtype_and_device() -> None:
    q = torch.randn(1, 2, 3, 4, dtype=torch.float32)
    out, weights = qkv.scaled_dot_product_attention(q, q, q, return_weights=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert out.device == q.device and weights.shape == (1, 2, 3, 3)
    out_np = qkv.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy())
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32


def test_lists_are_accepted_as_float64() -> None:
    out = qkv.scaled_dot_product_attention([[1.0, 0.0]], [[1.0, 0.0]], [[2.0, 3.0]])
    assert out.dtype == np.float64 and out.tolist() == [[2.0, 3.0]]


def test_mask_and_causal_combine() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 2))
    keep = np.array([True, False, True, True])
    _, weights = qkv.scaled_dot_product_attention(
        x, x, x, mask=keep, is_causal=True, return_weights=True
    )
    allowed = np.tril(np.ones((4, 4), dtype=bool)) & keep
    assert (weights[~allowed] == 0).all() and (weights[allowed] > 0).all()


def test_bias_is_added_to_scaled_scores() -> None:
    rng = np.random.default_rng(6)
    q, k, v = rng.normal(size=(3, 2)), rng.normal(size=(4, 2)), rng.normal(size=(4, 2))
    bias = rng.normal(size=(3, 4))
    _, weights = qkv.scaled_dot_product_attention(q, k, v, bias=bias, return_weights=True)
    assert weights == pytest.approx(qkv.softmax(q @ k.T / math.sqrt(2) + bias), abs=1e-15)


# -- dropout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_dropout_is_seeded_and_unbiased(lib: str) -> None:
    rng = np.random.default_rng(7)
    q, k, v = rng.normal(size=(64, 8)), rng.normal(size=(64, 8)), np.ones((64, 1))
    args: tuple[Any, ...] = (q, k, v)
    if lib == "torch":
        args = tuple(torch.from_numpy(a) for a in args)
    first = qkv.scaled_dot_product_attention(*args, dropout_p=0.25, generator=11)
    again = qkv.scaled_dot_product_attention(*args, dropout_p=0.25, generator=11)
    assert np.array_equal(np.asarray(first), np.asarray(again))
    trace = qkv.Trace()
    qkv.scaled_dot_product_attention(*args, dropout_p=0.25, generator=12, trace=trace)
    dropped = trace["dropout"].value
    assert 0.2 < (dropped == 0).mean() < 0.3
    kept = dropped[dropped > 0] / trace["weights"].value[dropped > 0]
    assert kept == pytest.approx(np.full(kept.shape, 1 / 0.75))
    assert np.asarray(first).mean() == pytest.approx(1.0, abs=0.05)  # E[context] unchanged


# -- multi-head --------------------------------------------------------------------------------


def _manual_multi_head(x, W_q, W_k, W_v, W_o, heads, kv_heads):
    d, dv = W_q.shape[1] // heads, W_v.shape[1] // kv_heads
    q, k, v = x @ W_q, x @ W_k, x @ W_v
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        qh, kh, vh = (
            q[:, h * d : (h + 1) * d],
            k[:, g * d : (g + 1) * d],
            v[:, g * dv : (g + 1) * dv],
        )
        outs.append(qkv.softmax(qh @ kh.T / math.sqrt(d)) @ vh)
    return np.concatenate(outs, axis=-1) @ W_o


@pytest.mark.parametrize(("heads", "kv_heads"), [(1, 1), (2, 2), (4, 2), (4, 1)])
def test_multi_head_equals_a_loop_over_heads(heads: int, kv_heads: int) -> None:
    rng = np.random.default_rng(8)
    x = rng.normal(size=(5, 6))
    W_q = rng.normal(size=(6, 4 * heads))
    W_k, W_v = rng.normal(size=(6, 4 * kv_heads)), rng.normal(size=(6, 3 * kv_heads))
    W_o = rng.normal(size=(3 * heads, 6))
    out = qkv.multi_head_attention(x, W_q, W_k, W_v, W_o, num_heads=heads, num_kv_heads=kv_heads)
    expected = _manual_multi_head(x, W_q, W_k, W_v, W_o, heads, kv_heads)
    assert out == pytest.approx(expected, abs=1e-12)


def test_cross_attention_takes_keys_and_values_from_context() -> None:
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 7, 5))
    W_q, W_k, W_v = rng.normal(size=(4, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    out, weights = qkv.multi_head_attention(
        x, W_q, W_k, W_v, num_heads=2, context=y, return_weights=True
    )
    assert out.shape == (2, 3, 4) and weights.shape == (2, 2, 3, 7)
    # The oracle, written out without qkv: head h owns columns 2h, 2h + 1 of each projection;
    # its queries come from x, its keys and values from y; its context fills its columns.
    d = 2
    for b in range(2):
        for h in range(2):
            cols = slice(h * d, (h + 1) * d)
            q, k, v = (x[b] @ W_q)[:, cols], (y[b] @ W_k)[:, cols], (y[b] @ W_v)[:, cols]
            scores = q @ k.T / np.sqrt(d)  # (3, 7): every query against every context key
            a = np.exp(scores - scores.max(axis=1, keepdims=True))
            a /= a.sum(axis=1, keepdims=True)
            assert weights[b, h] == pytest.approx(a, abs=1e-12)
            assert out[b, :, cols] == pytest.approx(a @ v, abs=1e-12)


def test_projection_biases() -> None:
    rng = np.random.default_rng(10)
    x, W = rng.normal(size=(3, 4)), rng.normal(size=(4, 4))
    b = rng.normal(size=4)
    out = qkv.multi_head_attention(x, W, W, W, W, b_q=b, b_k=b, b_v=b, b_o=b)
    p = x @ W + b
    assert out == pytest.approx(qkv.scaled_dot_product_attention(p, p, p) @ W + b)


def test_split_and_merge_heads_are_inverse() -> None:
    x = np.arange(2 * 3 * 8, dtype=float).reshape(2, 3, 8)
    split = qkv.split_heads(np, x, 4)
    assert split.shape == (2, 4, 3, 2)
    assert split[0, 1, 2].tolist() == x[0, 2, 2:4].tolist()  # head 1 = columns 2..3
    assert np.array_equal(qkv.merge_heads(np, split), x)


def test_bias_may_be_a_list() -> None:
    _, weights = qkv.scaled_dot_product_attention(
        np.zeros((1, 2)),
        np.zeros((2, 2)),
        np.ones((2, 2)),
        bias=[[0.0, np.log(3)]],
        return_weights=True,
    )
    assert weights[0] == pytest.approx([0.25, 0.75])
