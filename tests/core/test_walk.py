"""The walk of the query through the public call stays short (issue 36; the counts are in
docs/architecture.md, "How one call flows"): checked once, planned once, then computed,
with ``_array`` looked at once. The walk is counted by ``tests/support/walk.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv.attention._plans import PLANS
from tests.support.walk import walk

torch.manual_seed(0)
Q, K, V = (torch.randn(1, 4, 256, 32) for _ in range(3))
QG = Q.clone().requires_grad_()
N = np.random.default_rng(0).normal(size=(2, 16, 8))

CASES: dict[str, tuple[Callable[[], Any], Any, int, int]] = {
    # name: (the call, its query, most stops, most returns)
    "a plain call, first time": (lambda: qkv.scaled_dot_product_attention(Q, K, V), Q, 25, 8),
    "causal with a gradient": (
        lambda: qkv.scaled_dot_product_attention(QG, K, V, is_causal=True),
        QG,
        25,
        8,
    ),
    "a mask rule (tiled)": (
        lambda: qkv.scaled_dot_product_attention(Q, K, V, mask=qkv.masks.sliding_window(32)),
        Q,
        29,
        12,
    ),
    "NumPy (reference)": (
        lambda: qkv.scaled_dot_product_attention(N, N.copy(), N.copy()),
        N,
        14,
        2,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_walk_of_the_query_is_short_and_one_way(name: str) -> None:
    run, query, most_stops, most_returns = CASES[name]
    PLANS.clear()
    found = walk(run, query)
    assert len(found.stops) <= most_stops, str(found)
    assert found.returns <= most_returns, str(found)
    assert found.entries("_array.py") == 1, str(found)  # inputs looked at once
    modules = [m for m, _ in found.stops]
    first_plan = modules.index("attention/_plans.py", 2)  # after plain_signature
    assert "attention/_checks.py" not in modules[first_plan:], str(found)  # no check after it
    assert "attention/_options.py" not in modules[first_plan:], str(found)


def test_a_kept_plan_goes_straight_to_the_kernel() -> None:
    PLANS.clear()
    qkv.scaled_dot_product_attention(Q, K, V)
    found = walk(lambda: qkv.scaled_dot_product_attention(Q, K, V), Q)
    assert len(found.stops) <= 7 and found.returns == 0, str(found)
    assert "attention/_options.py" not in {m for m, _ in found.stops}  # no check again


def test_the_walk_counts_what_it_says() -> None:
    """A stop per function that receives the query, a view of it or the call holding it;
    a return per module entered again; nothing inside the kernel."""
    PLANS.clear()
    found = walk(lambda: qkv.scaled_dot_product_attention(Q, K, V, backend="tiled"), Q)
    assert found.stops[0] == ("attention/_dispatch.py", "scaled_dot_product_attention")
    assert found.stops[-1][0].startswith("kernels/")
    assert not any(m.startswith("kernels/_forward") for m, _ in found.stops)  # the kernel's own
    view = found.modules
    assert found.returns == sum(m in view[:i] and view[i - 1] != m for i, m in enumerate(view))
