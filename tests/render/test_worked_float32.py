"""The weighted sums c_i = Σ_j A_ij·v_j are written for a model's float32 trace too: the check
that C = A·V allows the float32 rounding of each term, not only of the sum."""

from __future__ import annotations

import numpy as np
import torch

import qkv
from qkv.render._html import page_data


def test_a_float32_trace_of_head_size_64_gets_its_weighted_sums() -> None:
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 64, generator=generator) for _ in range(3))  # (B, H, L, D)
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    weights, values = trace["weights"].value, trace["V"].value
    assert weights.dtype == np.float32
    worst = np.abs(weights.astype(np.float64) @ values - trace["context"].value).max()
    assert worst > 1e-7  # float32 rounding: the old absolute check refused it
    (call,) = page_data(trace)["calls"]
    contexts = [
        s for section in call["sections"] for s in section["steps"] if s["name"] == "context"
    ]
    assert [s["weightedSum"] for s in contexts] == [True, True]
    assert "c_t19 = " in qkv.render.text(trace)
