"""Small traces shared by the rendering tests."""

from __future__ import annotations

import numpy as np

import qkv


def two_layers() -> qkv.Trace:
    """Weights (2 heads, 3 × 3) recorded for two layers, "blocks.0.attn" and "blocks.1.attn"."""
    rng = np.random.default_rng(0)
    trace = qkv.Trace(tokens=["a", "b", "c"])
    for layer in ("blocks.0.attn", "blocks.1.attn"):
        weights = rng.dirichlet(np.ones(3), size=(2, 3))
        trace.record(
            "weights", weights, formula="A", description="", axes=("head", "query", "key"),
            layer=layer,
        )  # fmt: skip
    return trace
