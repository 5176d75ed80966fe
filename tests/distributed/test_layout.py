"""Layouts in one process: which positions each rank holds, and the errors for bad lengths.

The per-rank positions are read through ``qkv.distributed._layout._positions`` (rank and
size given), the same function :func:`qkv.distributed.positions` and ``shard`` use.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import masks
from qkv.distributed import positions, ring_attention, shard, unshard
from qkv.distributed._layout import _positions


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 8),
    chunks=st.integers(0, 5),
    layout=st.sampled_from(["zigzag", "contiguous", "striped"]),
)
def test_every_position_is_held_by_exactly_one_rank(size: int, chunks: int, layout: str) -> None:
    n = 2 * size * chunks
    held = torch.cat([_positions(n, layout, r, size) for r in range(size)])
    assert sorted(held.tolist()) == list(range(n))
    assert all(len(_positions(n, layout, r, size)) == n // size for r in range(size))


def test_zigzag_rank_holds_chunks_r_and_2p_minus_1_minus_r() -> None:
    # P = 3, N = 12: six chunks of 2
    assert _positions(12, "zigzag", 0, 3).tolist() == [0, 1, 10, 11]
    assert _positions(12, "zigzag", 1, 3).tolist() == [2, 3, 8, 9]
    assert _positions(12, "zigzag", 2, 3).tolist() == [4, 5, 6, 7]
    assert _positions(6, "striped", 1, 3).tolist() == [1, 4]
    assert _positions(6, "contiguous", 1, 3).tolist() == [2, 3]


@pytest.mark.parametrize(
    ("layout", "n", "size"), [("zigzag", 6, 2), ("zigzag", 9, 3), ("contiguous", 7, 2)]
)
def test_length_that_does_not_divide_is_a_clear_error(layout: str, n: int, size: int) -> None:
    with pytest.raises(ValueError, match=r"does not divide .* Hint: pad the sequence"):
        _positions(n, layout, 0, size)


def test_one_process_without_init_holds_everything() -> None:
    x = torch.randn(1, 2, 6, 3)
    assert torch.equal(positions(6, layout="zigzag"), torch.arange(6))
    assert torch.equal(shard(x, layout="zigzag"), x)
    assert torch.equal(unshard(x, layout="striped"), x)
    with pytest.raises(ValueError, match="zigzag' balances"):
        shard(x, layout="diagonal")  # type: ignore[arg-type]


def test_one_process_ring_attention_equals_reference_with_window_and_sinks() -> None:
    import qkv

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    rule = masks.sliding_window(3) & masks.document([0] * 4 + [1] * 6)
    out = ring_attention(q, k, v, mask=rule, sinks=sinks, layout="zigzag")
    ref = qkv.scaled_dot_product_attention(q, k, v, mask=rule, sinks=sinks, backend="reference")
    assert float((out - ref).abs().max()) <= 1e-12


def test_bad_arguments_are_one_line_errors() -> None:
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="strategy must be one of 'ring'"):
        ring_attention(q, q, q, strategy="tree")
    with pytest.raises(TypeError, match=r"mask must be a qkv\.masks\.Mask"):
        ring_attention(q, q, q, mask=torch.ones(4, 4, dtype=torch.bool))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shapes do not fit.*Hint"):
        ring_attention(q, q, torch.zeros(1, 1, 3, 2))
    with pytest.raises(ValueError, match=r"sinks must have shape \(1,\)"):
        ring_attention(q, q, q, sinks=torch.zeros(2))
