"""The block plan and the masks of partial blocks are kept per (mask object, shape): a model
calls the kernel with the same mask in every layer, and must never get another mask's plan."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import numpy as np
import pytest
import torch

import qkv
from qkv.kernels import _blockwise, plan_blocks, tiled_attention
from qkv.masks import EMPTY, Mask, causal, from_function, key_padding, sliding_window, with_causal


def _plan(rule: object, length: int = 512) -> object:
    return plan_blocks(rule, batch=1, heads=2, q_len=length, kv_len=length)  # type: ignore[arg-type]


def test_the_same_mask_and_shape_reuse_one_plan_whose_arrays_are_read_only() -> None:
    rule = sliding_window(63)
    first, again = _plan(rule), _plan(rule)
    assert first is again
    with pytest.raises(ValueError, match="read-only"):
        first.kinds[0, 0, 0] = EMPTY  # type: ignore[attr-defined]
    assert _plan(rule, 256) is not first  # another shape: another plan


def test_a_new_mask_never_gets_a_dead_masks_plan() -> None:
    # Many short-lived masks, some of whose ids Python reuses: each plan must be its own.
    seen: set[int] = set()
    reused = 0
    for width in range(1, 40):
        rule = sliding_window(width)
        reused += id(rule) in seen
        seen.add(id(rule))
        plan = _plan(rule)
        fresh = rule.blocks(512, 512, plan.block_q, plan.block_kv)  # type: ignore[attr-defined]
        expected = np.where(fresh.min(axis=1) == fresh.max(axis=1), fresh.min(axis=1), 1)
        assert np.array_equal(plan.kinds != EMPTY, expected != EMPTY)  # type: ignore[attr-defined]
        dead = weakref.ref(rule)
        del rule
        if dead() is not None:  # a full collection (seconds in a busy worker) only if needed
            gc.collect()
        assert dead() is None
    assert reused > 0  # the case this test is about happened: a new mask had a dead one's id


def test_results_are_the_same_with_a_kept_plan() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=generator, dtype=torch.float64) for _ in "qkv")
    rule = causal()
    first = tiled_attention(q, k, v, mask=rule)
    second = tiled_attention(q, k, v, mask=rule)  # the plan now comes from the cache
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(first, second)
    torch.testing.assert_close(second, reference, rtol=0, atol=1e-12)


def _counting_rule(calls: list[int]) -> Mask:
    def rule(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (q - kv) % 5 != 1  # every block partial: the rule runs on each one

    return from_function(rule, "counted")


def test_a_partial_blocks_mask_is_evaluated_once_for_the_same_mask_and_shape() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    calls: list[int] = []
    rule = _counting_rule(calls)
    first = tiled_attention(q, k, v, mask=rule)
    evaluated = len(calls)
    assert evaluated > 0
    second = tiled_attention(q, k, v, mask=rule)
    assert len(calls) == evaluated  # kept: no evaluation on the second call
    assert torch.equal(first, second)
    reference = qkv.scaled_dot_product_attention(q, k, v, mask=rule, backend="reference")
    torch.testing.assert_close(second, reference, rtol=0, atol=1e-12)


def test_a_boolean_array_given_with_the_call_is_read_on_every_call() -> None:
    # The same shape and the same causal rule, two different arrays: nothing kept may leak.
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    for _ in range(2):
        allowed = torch.rand(1, 1, 200, 200, generator=generator) > 0.5
        fast = tiled_attention(q, k, v, mask=allowed, is_causal=True)
        exact = qkv.scaled_dot_product_attention(
            q, k, v, mask=allowed, is_causal=True, backend="reference"
        )
        torch.testing.assert_close(fast, exact, rtol=0, atol=1e-12)


def test_kept_masks_stay_within_their_budget_and_the_results_do_not_change() -> None:
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    small = _blockwise._KeptMasks(budget=64 << 10)
    with mock.patch.object(_blockwise, "_kept_masks", small):
        rule = _counting_rule([])
        outs = [tiled_attention(q, k, v, mask=rule) for _ in range(3)]
        assert small._bytes <= 64 << 10
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_is_causal_gives_the_same_rule_object_on_every_call() -> None:
    # The kept plan and masks depend on it: a new causal rule per call would never match.
    padding = key_padding([5, 9])
    assert with_causal(None, True) is with_causal(None, True)
    assert with_causal(None, True, "bottom-right") is not with_causal(None, True)
    assert with_causal(padding, True) is with_causal(padding, True)
    assert repr(with_causal(padding, True)) == "key_padding([5, 9]) & causal('top-left')"
    assert with_causal(padding, False) is padding
