"""The block plan is kept per (mask object, shape): a model calls the kernel with the same
mask in every layer, and must never get another mask's plan."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from qkv.kernels import plan_blocks, tiled_attention
from qkv.masks import EMPTY, causal, sliding_window


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
    for width in range(1, 40):
        rule = sliding_window(width)
        plan = _plan(rule)
        fresh = rule.blocks(512, 512, plan.block_q, plan.block_kv)  # type: ignore[attr-defined]
        expected = np.where(fresh.min(axis=1) == fresh.max(axis=1), fresh.min(axis=1), 1)
        assert np.array_equal(plan.kinds != EMPTY, expected != EMPTY)  # type: ignore[attr-defined]
        del rule
        gc.collect()


def test_results_are_the_same_with_a_kept_plan() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=generator, dtype=torch.float64) for _ in "qkv")
    rule = causal()
    first = tiled_attention(q, k, v, mask=rule)
    second = tiled_attention(q, k, v, mask=rule)  # the plan now comes from the cache
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(first, second)
    torch.testing.assert_close(second, reference, rtol=0, atol=1e-12)
