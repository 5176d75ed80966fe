"""The scale fact names 1/√d_k when a caller passes it explicitly, as Hugging Face models do
(``scaling=module.scaling``), and keeps "a custom scale" for any other value (Gemma2's
``query_pre_attn_scalar``)."""

from __future__ import annotations

import numpy as np

import qkv
from qkv import render


def _scale_line(scale: float) -> str:
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 1, 3, 64)) for _ in range(3))
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, scale=scale)
    lines = [line for line in render.text(trace).splitlines() if "scale" in line]
    return " ".join(lines)


def test_an_explicit_one_over_sqrt_dk_is_named_as_such() -> None:
    assert "1/√d_k = 1/√64 = 0.1250" in _scale_line(0.125)
    assert "1/√d_k" in _scale_line(float(np.float32(64**-0.5)))


def test_another_scale_stays_custom() -> None:
    line = _scale_line(0.1)
    assert "custom scale" in line and "1/√d_k = " not in line
