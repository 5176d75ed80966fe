"""The new mask and score rules: dense forms against loops, block structure against the dense
mask, score modifiers against their formulas, the dropout pattern."""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.torch as torch_xp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import masks, positional
from tests.support.mask_cases import case_of


def loop(lq: int, lk: int, allowed: Any) -> np.ndarray:
    return np.array([[bool(allowed(i, j)) for j in range(lk)] for i in range(lq)])


def test_document_mask_is_same_document_only() -> None:
    ids = [0, 0, 1, 1, 1, 2]
    got = masks.document(ids).dense(6, 6)[0, 0]
    assert np.array_equal(got, loop(6, 6, lambda i, j: ids[i] == ids[j]))
    per_batch = masks.document([[0, 1, 1], [0, 0, 0]]).dense(3, 3, batch=2)
    assert per_batch[0, 0, 0].tolist() == [True, False, False] and per_batch[1].all()
    cross = masks.document([0, 1], [0, 0, 1, 1, 1]).dense(2, 5)[0, 0]
    assert cross.astype(int).tolist() == [[1, 1, 0, 0, 0], [0, 0, 1, 1, 1]]


def test_prefix_lm_sees_the_prefix_and_is_causal_after_it() -> None:
    got = masks.prefix_lm(3).dense(5, 5)[0, 0]
    assert np.array_equal(got, loop(5, 5, lambda i, j: j < 3 or j <= i))
    per_batch = masks.prefix_lm([1, 4]).dense(4, 4, batch=2)
    assert np.array_equal(per_batch[0, 0], loop(4, 4, lambda i, j: j < 1 or j <= i))
    assert per_batch[1].all()
    assert repr(masks.prefix_lm(3)) == "prefix_lm(3, alignment='top-left')"


def test_dense_rules_in_torch_on_any_device_namespace() -> None:
    dense = masks.document(torch.tensor([0, 0, 1])).dense(3, 3, xp=torch_xp)
    assert isinstance(dense, torch.Tensor) and dense[0, 0].sum().item() == 5


def test_alibi_equals_positional_alibi_bias() -> None:
    heads, lq, lk = 4, 3, 7
    b = np.zeros((1, 1, 1, 1), dtype=int)
    h = np.arange(heads).reshape(1, heads, 1, 1)
    q = np.arange(lq).reshape(1, 1, lq, 1)
    kv = np.arange(lk).reshape(1, 1, 1, lk)
    scores = np.zeros((1, heads, lq, lk))
    got = masks.alibi(heads)(scores, b, h, q, kv, lq, lk, np)
    np.testing.assert_allclose(got[0], positional.alibi_bias(heads, lq, lk), atol=1e-15)
    top_left = masks.alibi(heads, alignment="top-left")(scores, b, h, q, kv, lq, lk, np)
    np.testing.assert_allclose(top_left[0], positional.alibi_bias(heads, lq, lk, offset=0))


def test_softcap_and_chaining() -> None:
    x = np.array([-100.0, -1.0, 0.0, 2.0, 100.0])
    capped = masks.softcap(5.0)(x, 0, 0, 0, 0, 1, 1, np)
    np.testing.assert_allclose(capped, 5.0 * np.tanh(x / 5.0))
    assert np.abs(capped).max() <= 5.0
    chained = masks.alibi([1.0], alignment="top-left").then(masks.softcap(5.0))
    q, kv = np.array([[3]]), np.array([[0]])
    assert chained(np.array([[0.0]]), 0, 0, q, kv, 4, 4, np)[0, 0] == pytest.approx(
        5.0 * math.tanh(-3.0 / 5.0)
    )
    with pytest.raises(TypeError, match=r"ScoreMod.then expects another ScoreMod"):
        masks.softcap(1.0).then(lambda s: s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: masks.softcap(0.0), r"softcap: cap must be a positive finite number"),
        (lambda: masks.alibi([]), r"alibi: slopes must be finite numbers"),
        (lambda: masks.document([[[0]]]), r"segment_ids must be integers of shape \(L,\)"),
        (lambda: masks.document([0, 1], [[0, 1]]), r"must both be \(L,\) or both \(B, L\)"),
        (lambda: masks.prefix_lm(-1), r"prefix must be ≥ 0"),
        (lambda: masks.prefix_lm([1.5]), r"prefix must be a non-empty 1-D sequence"),
        (lambda: masks.document([0, 1]).dense(3, 3), r"segment_ids has 2 positions but"),
    ],
)
def test_bad_rules_say_what_is_wrong(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def _rules(b: int, lq: int, lk: int) -> st.SearchStrategy[masks.Mask]:
    """Every rule of the registry (tests/support/mask_cases.py), and their combinations."""
    base = st.one_of(
        *(
            st.builds(lambda rng, case=case: case(rng, b, lq, lk), st.randoms())
            for case in (case_of(name) for name in masks.RULES)
        )
    )
    return st.recursive(
        base,
        lambda inner: st.one_of(
            st.builds(lambda x, y: x & y, inner, inner),
            st.builds(lambda x, y: x | y, inner, inner),
            st.builds(lambda x: ~x, inner),
        ),
        max_leaves=3,
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_block_structure_agrees_with_the_dense_mask(data: st.DataObject) -> None:
    b, h = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    lq, lk = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    rule = data.draw(_rules(b, lq, lk))
    bq, bk = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 7))
    dense = rule.dense(lq, lk, batch=b, heads=h)
    kinds = np.broadcast_to(
        rule.blocks(lq, lk, bq, bk, batch=b, heads=h), (b, h, -(-lq // bq), -(-lk // bk))
    )
    for i in range(kinds.shape[2]):
        for j in range(kinds.shape[3]):
            block = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            for bi in range(b):
                for hi in range(h):
                    kind = kinds[bi, hi, i, j]
                    if kind == masks.EMPTY:
                        assert not block[bi, hi].any(), (rule, i, j)
                    elif kind == masks.FULL:
                        assert block[bi, hi].all(), (rule, i, j)


def test_built_in_block_structure_is_tight_where_it_can_be() -> None:
    kinds = masks.causal().blocks(8, 8, 2, 2)[0, 0]
    assert kinds.tolist() == [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
    window = masks.sliding_window(3).blocks(12, 12, 4, 4)[0, 0]
    assert window.tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    docs = masks.document([0] * 4 + [1] * 4).blocks(8, 8, 4, 4)[0, 0]
    assert docs.tolist() == [[2, 0], [0, 2]]
    padding = masks.key_padding([3, 8]).blocks(4, 8, 4, 4, batch=2)
    assert padding[:, 0].tolist() == [[[1, 0]], [[2, 2]]]
    unknown = masks.from_function(lambda b, h, q, kv: q >= kv).blocks(4, 4, 2, 2)
    assert (unknown == masks.PARTIAL).all()


@settings(max_examples=20, deadline=None)
@given(st.floats(0.3, 0.7), st.integers(0, 2**62))
def test_the_dropout_pattern_keeps_one_minus_p(p: float, seed: int) -> None:
    keep = masks.dropout_keep(p, seed).dense(64, 64, batch=2, heads=2)
    assert abs(keep.mean() - (1 - p)) < 0.03
    again = masks.dropout_keep(p, seed).dense(64, 64, batch=2, heads=2, xp=torch_xp)
    assert np.array_equal(keep, again.numpy())  # NumPy and PyTorch draw the same pattern
    rows = keep.reshape(-1, 64)
    assert len({r.tobytes() for r in rows}) == len(rows)  # rows are not copies of each other


def test_draw_seed_from_every_kind_of_generator() -> None:
    assert masks.draw_seed(12, torch_inputs=False) == 12
    rng = np.random.default_rng(0)
    first, second = (masks.draw_seed(rng, torch_inputs=False) for _ in range(2))
    assert first != second  # the generator advances
    gen = torch.Generator().manual_seed(3)
    assert masks.draw_seed(gen, torch_inputs=True) == masks.draw_seed(
        torch.Generator().manual_seed(3), torch_inputs=True
    )
    with pytest.raises(TypeError, match=r"generator must be an int seed"):
        masks.draw_seed("seed", torch_inputs=False)
