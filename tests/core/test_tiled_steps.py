"""The FlashAttention forward and backward tile by tile (``qkv explain --tiled``'s numbers):
pinned by hand on a small case, equal to qkv's tiled kernel on the same tiles (float64), and
equal to the plain softmax for any block size."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention._tiled_steps import tiled_steps


def test_two_tokens_one_key_per_tile_by_hand() -> None:
    # q = k = v = I, scale 1: row 0 scores [1, 0], row 1 scores [0, 1]; tiles of one key.
    steps = tiled_steps(np.eye(2), np.eye(2), np.eye(2), block_size=1, scale=1.0)
    e = math.exp(-1.0)
    row0_first, row0_second, row1_first, row1_second = steps.tiles
    assert row0_first.m_new.tolist() == [1.0] and row0_first.rescale.tolist() == [0.0]
    # row 0, key 1: the maximum does not grow, nothing is rescaled
    assert row0_second.tile_max.tolist() == [0.0] and row0_second.m_new.tolist() == [1.0]
    assert row0_second.rescale.tolist() == [1.0]
    assert row0_second.l_new == pytest.approx([1 + e])
    assert row0_second.o_new[0] == pytest.approx([1.0, e])
    # row 1: key 0 gives m = 0, key 1 raises it to 1: the old terms shrink by e^-1
    assert row1_first.m_new.tolist() == [0.0] and row1_first.o_new[0].tolist() == [1.0, 0.0]
    assert row1_second.rescale == pytest.approx([e])
    assert row1_second.l_new == pytest.approx([e * 1.0 + 1.0])
    assert row1_second.o_new[0] == pytest.approx([e, 1.0])
    total = 1 + e
    assert steps.output == pytest.approx(np.array([[1, e], [e, 1]]) / total)
    assert steps.lse == pytest.approx([1 + math.log(total)] * 2)
    # backward with dO = ones: D = rowsum(O) = 1; dV = column sums of the weights
    assert steps.delta == pytest.approx([1.0, 1.0])
    assert steps.dv == pytest.approx(np.array([[1.0, 1.0], [1.0, 1.0]]))


def test_causal_tiles_are_skipped_full_or_masked_on_the_diagonal() -> None:
    q = np.arange(15, dtype=float).reshape(5, 3) / 10
    steps = tiled_steps(q, q, q, block_size=2, causal=True)
    assert steps.kinds.tolist() == [
        ["masked", "skipped", "skipped"],
        ["full", "masked", "skipped"],
        ["full", "full", "full"],  # the last block is one row: its diagonal tile is full
    ]
    skipped = [t for t in steps.tiles if t.kind == "skipped"]
    assert all((t.o_new == t.o_old).all() and (t.l_new == t.l_old).all() for t in skipped)
    assert all(t.kind != "skipped" for t in steps.backward)


def test_a_fully_masked_row_is_zeros_with_no_nan() -> None:
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((4, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 3))
    allowed = np.ones((4, 4), dtype=bool)
    allowed[1] = False  # query 1 may attend nothing
    allowed[2, :2] = False  # query 2 sees nothing in the first key block, query 3 does
    with np.errstate(all="raise"):  # −∞ − (−∞) would raise here
        steps = tiled_steps(q, k, v, block_size=2, allowed=allowed)
    assert steps.output[1].tolist() == [0.0, 0.0, 0.0]
    assert steps.lse[1] == -math.inf
    first = steps.tiles[0]  # queries 0 and 1 x keys 0 and 1: row 1 masked
    assert first.kind == "masked" and first.m_new[1] == -math.inf and first.rescale[1] == 0.0
    third = steps.tiles[2]  # queries 2 and 3 x keys 0 and 1
    assert third.kind == "masked"
    assert third.m_new[0] == -math.inf and third.rescale[0] == 0.0 and third.l_new[0] == 0.0
    for tile in steps.tiles:
        for array in (tile.rescale, tile.p, tile.l_new, tile.o_new):
            assert not np.isnan(array).any()
    assert not np.isnan(steps.dq).any() and steps.dq[1].tolist() == [0.0, 0.0]
    assert steps.output_difference < 1e-15


CASES = [
    # (Lq, Lk, block, causal, with a mask)
    (3, 3, 2, False, False),
    (5, 5, 2, True, False),
    (7, 5, 3, False, True),
    (6, 9, 4, True, True),
    (4, 4, 1, True, False),
    (5, 3, 8, False, False),
]


@pytest.mark.parametrize(("lq", "lk", "block", "causal", "masked"), CASES)
def test_the_numbers_are_the_tiled_kernels(
    lq: int, lk: int, block: int, causal: bool, masked: bool
) -> None:
    torch = pytest.importorskip("torch")
    from qkv.kernels import tiled_attention

    rng = np.random.default_rng(lq * 100 + lk * 10 + block)
    q, k = rng.standard_normal((lq, 4)), rng.standard_normal((lk, 4))
    v, d_out = rng.standard_normal((lk, 3)), rng.standard_normal((lq, 3))
    allowed = rng.random((lq, lk)) > 0.3 if masked else None
    steps = tiled_steps(q, k, v, block_size=block, causal=causal, allowed=allowed, d_out=d_out)
    tq, tk, tv = (torch.tensor(x)[None, None].requires_grad_() for x in (q, k, v))
    out, lse = tiled_attention(
        tq, tk, tv, mask=torch.tensor(steps.allowed), return_lse=True, block_q=block,
        block_kv=block,
    )  # fmt: skip
    out.backward(torch.tensor(d_out)[None, None])
    assert out.dtype == torch.float64
    np.testing.assert_allclose(steps.output, out[0, 0].detach().numpy(), rtol=0, atol=1e-14)
    kernel_lse = lse[0, 0].detach().numpy()
    assert np.array_equal(np.isneginf(steps.lse), np.isneginf(kernel_lse))
    finite = np.isfinite(kernel_lse)
    np.testing.assert_allclose(steps.lse[finite], kernel_lse[finite], rtol=0, atol=1e-14)
    for mine, theirs in ((steps.dq, tq), (steps.dk, tk), (steps.dv, tv)):
        assert theirs.grad is not None
        np.testing.assert_allclose(mine, theirs.grad[0, 0].numpy(), rtol=0, atol=1e-13)
    # the shown key block: its backward tiles' parts add up to the kernel's dK and dV rows
    for j in range(steps.key_blocks):
        tiles = steps.backward_of(j)
        if not tiles:
            continue
        k0, k1 = tiles[0].cols
        np.testing.assert_allclose(
            sum(t.dk for t in tiles), tk.grad[0, 0, k0:k1].numpy(), rtol=0, atol=1e-13
        )
        np.testing.assert_allclose(
            sum(t.dv for t in tiles), tv.grad[0, 0, k0:k1].numpy(), rtol=0, atol=1e-13
        )


@settings(max_examples=60, deadline=None)
@given(
    lq=st.integers(1, 9),
    lk=st.integers(1, 9),
    block=st.integers(1, 10),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_any_block_size_gives_the_plain_softmax(
    lq: int, lk: int, block: int, causal: bool, seed: int, spread: float
) -> None:
    rng = np.random.default_rng(seed)
    q, k = spread * rng.standard_normal((lq, 3)), spread * rng.standard_normal((lk, 3))
    v = rng.standard_normal((lk, 2))
    steps = tiled_steps(q, k, v, block_size=block, causal=causal)
    # an independent plain softmax, whole rows at once
    scores = q @ k.T / math.sqrt(3)
    if causal:
        scores = np.where(np.tril(np.ones((lq, lk), dtype=bool)), scores, -np.inf)
    top = scores.max(axis=1, keepdims=True)
    weights = np.exp(scores - top)
    weights /= weights.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(steps.output, weights @ v, rtol=1e-12, atol=1e-12)
    lse = top[:, 0] + np.log(np.exp(scores - top).sum(axis=1))
    np.testing.assert_allclose(steps.lse, lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("block", "words"),
    [(0, "at least 1"), (-3, "at least 1"), (2.5, "whole number"), (True, "whole number")],
)
def test_a_bad_block_size_is_refused(block: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        tiled_steps(np.eye(2), np.eye(2), np.eye(2), block_size=block)  # type: ignore[arg-type]


def test_too_many_tiles_are_refused() -> None:
    ones = np.ones((200, 2))
    with pytest.raises(ValueError, match="more than 4096 to show"):
        tiled_steps(ones, ones, ones, block_size=1)
