"""Masks: True = may attend, built-in rules against explicit loops, composition, converters."""

from __future__ import annotations

import array_api_compat.torch as torch_xp
import numpy as np
import pytest
import torch

import qkv
from qkv import masks


def loop(lq: int, lk: int, allowed: object) -> np.ndarray:
    return np.array([[bool(allowed(i, j)) for j in range(lk)] for i in range(lq)])  # type: ignore[operator]


@pytest.mark.parametrize(("lq", "lk"), [(4, 4), (2, 5), (5, 2), (1, 6)])
def test_causal_alignments(lq: int, lk: int) -> None:
    top_left = masks.causal("top-left").dense(lq, lk)[0, 0]
    bottom_right = masks.causal("bottom-right").dense(lq, lk)[0, 0]
    assert np.array_equal(top_left, loop(lq, lk, lambda i, j: j <= i))
    assert np.array_equal(bottom_right, loop(lq, lk, lambda i, j: j <= i + lk - lq))


@pytest.mark.parametrize(("before", "after"), [(0, 0), (2, 0), (1, 1), (3, 2)])
def test_sliding_window(before: int, after: int) -> None:
    got = masks.sliding_window(before, after).dense(6, 6)[0, 0]
    assert np.array_equal(got, loop(6, 6, lambda i, j: i - before <= j <= i + after))


def test_sliding_window_bottom_right() -> None:
    got = masks.sliding_window(1, alignment="bottom-right").dense(2, 5)[0, 0]
    assert np.array_equal(got, loop(2, 5, lambda i, j: i + 3 - 1 <= j <= i + 3))


def test_key_padding_per_batch_element() -> None:
    got = masks.key_padding([2, 4, 0]).dense(3, 4, batch=3, heads=2)
    assert got.shape == (3, 2, 3, 4)
    for b, length in enumerate([2, 4, 0]):
        assert (got[b, :, :, :length]).all() and not got[b, :, :, length:].any()


def test_composition_and_repr() -> None:
    causal, window, pad = masks.causal(), masks.sliding_window(1), masks.key_padding([3])
    both = causal & pad
    either = window | pad
    assert repr(both) == "causal('top-left') & key_padding([3])"
    assert repr((causal & pad) | window) == (
        "(causal('top-left') & key_padding([3])) | sliding_window(1, 0, alignment='top-left')"
    )
    assert repr(~causal) == "~causal('top-left')"
    dense = {m: m.dense(4, 4)[0, 0] for m in (causal, window, pad)}
    assert np.array_equal(both.dense(4, 4)[0, 0], dense[causal] & dense[pad])
    assert np.array_equal(either.dense(4, 4)[0, 0], dense[window] | dense[pad])
    assert np.array_equal((~causal).dense(4, 4)[0, 0], ~dense[causal])
    assert masks.full().dense(2, 3).all()


def test_from_function_sees_batch_and_head() -> None:
    rule = masks.from_function(lambda b, h, q, kv: (kv + h + b) % 2 == 0, "parity")
    dense = rule.dense(2, 4, batch=2, heads=2)
    for b in range(2):
        for h in range(2):
            expected = loop(2, 4, lambda i, j, h=h, b=b: (j + h + b) % 2 == 0)
            assert np.array_equal(dense[b, h], expected)


def test_mask_rules_in_attention_see_batch_and_head_axes() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 3, 4, 5)) for _ in range(3))
    rule = masks.from_function(lambda b, h, qi, kv: kv <= qi + h - b)
    dense = rule.dense(4, 4, batch=2, heads=3)
    expected = qkv.scaled_dot_product_attention(q, k, v, mask=dense)
    got = qkv.scaled_dot_product_attention(q, k, v, mask=rule)
    np.testing.assert_array_equal(got, expected)


def test_dense_in_torch_namespace() -> None:
    dense = masks.causal().dense(3, 3, xp=torch_xp)
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bool
    assert dense[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_converters_round_trip() -> None:
    ignore = np.array([[False, True, False]])
    attend = masks.from_ignore(ignore)
    assert attend.tolist() == [[True, False, True]]
    additive = masks.to_additive(attend)
    assert additive.tolist() == [[0.0, -np.inf, 0.0]]
    assert np.array_equal(masks.from_additive(additive), attend)
    assert masks.from_additive(np.array([-3.0, -np.inf, np.inf])).tolist() == [True, False, True]
    t = masks.to_additive(torch.tensor([True, False]))
    assert t.dtype == torch.float32 and t.tolist() == [0.0, -float("inf")]


def test_additive_mask_equals_boolean_mask_in_attention() -> None:
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(3, 2)), rng.normal(size=(4, 2)), rng.normal(size=(4, 2))
    allowed = rng.random((3, 4)) < 0.7
    allowed[:, 0] = True
    by_mask = qkv.scaled_dot_product_attention(q, k, v, mask=allowed)
    by_bias = qkv.scaled_dot_product_attention(q, k, v, bias=masks.to_additive(allowed))
    np.testing.assert_allclose(by_bias, by_mask, atol=1e-15)
