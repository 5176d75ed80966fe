"""Hypothesis strategies for attention cases: shapes, masks, biases, options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st


@dataclass
class Case:
    query: np.ndarray  # (B, H, Lq, D)
    key: np.ndarray  # (B, Hkv, Lk, D)
    value: np.ndarray  # (B, Hkv, Lk, Dv)
    mask: np.ndarray | None  # bool, broadcastable to (B, H, Lq, Lk)
    bias: np.ndarray | None
    is_causal: bool
    alignment: str
    scale: float | None

    @property
    def gqa(self) -> bool:
        return bool(self.query.shape[1] != self.key.shape[1])


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    allow_mask: bool = True,
    allow_bias: bool = True,
    allow_causal: bool = True,
    allow_gqa: bool = True,
) -> Case:
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3])) if allow_gqa else 1
    lq, lk = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    spread = draw(st.sampled_from([0.1, 1.0, 4.0]))
    query = rng.normal(scale=spread, size=(b, hkv * group, lq, d))
    key = rng.normal(scale=spread, size=(b, hkv, lk, d))
    value = rng.normal(size=(b, hkv, lk, dv))
    scores_shape = (b, hkv * group, lq, lk)
    mask = None
    if allow_mask and draw(st.booleans()):
        shape = draw(st.sampled_from([scores_shape, (b, 1, lq, lk), (lq, lk), (lk,)]))
        mask = rng.random(shape) < draw(st.sampled_from([0.5, 0.8, 1.0]))
    bias = None
    if allow_bias and draw(st.booleans()):
        bias = rng.normal(size=draw(st.sampled_from([scores_shape, (lq, lk)])))
    is_causal = allow_causal and mask is None and draw(st.booleans())
    alignment = draw(st.sampled_from(["top-left", "bottom-right"]))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    return Case(query, key, value, mask, bias, is_causal, alignment, scale)


def fully_masked_rows(case: Case) -> np.ndarray:
    """(B, H, Lq) True where a query has no key it may attend."""
    b, h, lq, _ = case.query.shape
    lk = case.key.shape[2]
    allowed = np.ones((b, h, lq, lk), dtype=bool)
    if case.mask is not None:
        allowed &= case.mask
    if case.is_causal:
        offset = lk - lq if case.alignment == "bottom-right" else 0
        allowed &= np.tril(np.ones((lq, lk), dtype=bool), k=offset)
    return np.logical_not(allowed.any(axis=-1))
