"""qkv.positional: RoPE pinned against independent numbers, its properties, sinusoidal, ALiBi."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qkv import positional
from qkv.positional import alibi_bias, alibi_slopes, apply_rope, rope_angles, sinusoidal

X = np.array([[1.0, 2.0, 3.0, 4.0]])  # one token, D = 4: θ = (1, 1/100) with base 10000


def test_rope_half_split_pinned_by_hand() -> None:
    # position 1, half split: pairs (x0, x2) turn by 1 rad, (x1, x3) by 0.01 rad
    #   x0' = 1·cos 1 − 3·sin 1 = 0.5403023 − 2.5244129 = −1.9841106
    #   x1' = 2·cos .01 − 4·sin .01 = 1.9999000 − 0.0399993 = 1.9599007
    #   x2' = 3·cos 1 + 1·sin 1 = 1.6209069 + 0.8414710 = 2.4623779
    #   x3' = 4·cos .01 + 2·sin .01 = 3.9998000 + 0.0199997 = 4.0197997
    expected = [-1.9841106485555495, 1.959900667496664, 2.4623779024123156, 4.019799668334994]
    np.testing.assert_allclose(apply_rope(X, offset=1)[0], expected, rtol=0, atol=1e-15)
    # position 3: the angles are 3 and 0.03
    expected_3 = [-1.413352520780047, 1.8791180666879925, -2.828857481741469, 4.058191135400942]
    np.testing.assert_allclose(apply_rope(X, offset=3)[0], expected_3, rtol=0, atol=1e-15)


def test_rope_interleaved_pinned_by_hand() -> None:
    # interleaved: pairs (x0, x1) turn by 1 rad, (x2, x3) by 0.01 rad
    #   x0' = 1·cos 1 − 2·sin 1 = −1.1426397,  x1' = 2·cos 1 + 1·sin 1 = 1.9220756
    #   x2' = 3·cos .01 − 4·sin .01 = 2.9598507, x3' = 4·cos .01 + 3·sin .01 = 4.0297995
    expected = [-1.1426396637476532, 1.922075596544176, 2.9598506679133294, 4.029799501669161]
    got = apply_rope(X, offset=1, layout="interleaved")[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)


def _rope_complex(x: np.ndarray, positions: np.ndarray, layout: str, base: float) -> np.ndarray:
    """RoPE as complex multiplication: each pair is a complex number times e^(i·p·θ_k)."""
    d = x.shape[-1]
    theta = np.array([base ** (-2 * k / d) for k in range(d // 2)])
    turn = np.exp(1j * positions[:, None] * theta)  # (L, D/2)
    if layout == "half":
        z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * turn
        return np.concatenate([z.real, z.imag], axis=-1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float64, st.tuples(st.integers(1, 5), st.sampled_from([2, 4, 8])),
                 elements=st.floats(-10, 10)),
    offset=st.integers(0, 5000),
    layout=st.sampled_from(["half", "interleaved"]),
    base=st.sampled_from([10000.0, 500000.0, 10.0]),
)  # fmt: skip
def test_rope_equals_complex_number_formulation(
    x: np.ndarray, offset: int, layout: str, base: float
) -> None:
    positions = np.arange(offset, offset + x.shape[0])
    expected = _rope_complex(x, positions, layout, base)
    got = apply_rope(x, offset=offset, base=base, layout=layout)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(  # a rotation keeps each vector's length
        np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12, atol=1e-9
    )


@settings(max_examples=60, deadline=None)
@given(
    q=hnp.arrays(np.float64, 8, elements=st.floats(-3, 3)),
    k=hnp.arrays(np.float64, 8, elements=st.floats(-3, 3)),
    m=st.integers(0, 2000),
    n=st.integers(0, 2000),
    shift=st.integers(0, 2000),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_rope_scores_depend_only_on_relative_position(
    q: np.ndarray, k: np.ndarray, m: int, n: int, shift: int, layout: str
) -> None:
    def score(m: int, n: int) -> float:
        rq = apply_rope(q[None], positions=[m], layout=layout)  # type: ignore[arg-type]
        rk = apply_rope(k[None], positions=[n], layout=layout)  # type: ignore[arg-type]
        return float(rq[0] @ rk[0])

    assert math.isclose(score(m, n), score(m + shift, n + shift), rel_tol=1e-9, abs_tol=1e-9)


def test_rope_position_zero_is_identity_and_torch_matches_numpy() -> None:
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 6))  # (B, H, L, D)
    np.testing.assert_array_equal(apply_rope(x[..., :1, :]), x[..., :1, :])
    for layout in ("half", "interleaved"):
        expected = apply_rope(x, offset=7, layout=layout)
        got = apply_rope(torch.from_numpy(x), offset=7, layout=layout)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-14, atol=1e-14)
        positions = np.arange(7, 12)
        np.testing.assert_array_equal(apply_rope(x, positions, layout=layout), expected)
    half = apply_rope(torch.from_numpy(x).to(torch.bfloat16), offset=2)
    assert half.dtype == torch.bfloat16
    per_batch = np.array([[[0, 1, 2, 3, 4]], [[10, 11, 12, 13, 14]]])  # (B, 1, L)
    np.testing.assert_allclose(apply_rope(x, per_batch)[1], apply_rope(x[1], offset=10))


def test_rope_angles() -> None:
    np.testing.assert_allclose(rope_angles([2], 4, base=100.0), [[2.0, 0.2]])
    assert rope_angles(torch.arange(3), 6).shape == (3, 3)


def test_sinusoidal_pinned_values() -> None:
    table = sinusoidal(3, 4)
    # PE[p, 2i] = sin(p / 10000^(2i/4)), PE[p, 2i+1] = cos(...): frequencies 1 and 1/100
    np.testing.assert_allclose(table[2], [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)])
    np.testing.assert_allclose(sinusoidal(1, 4, offset=2)[0], table[2])
    assert sinusoidal(4, 5).shape == (4, 5)
    np.testing.assert_allclose(sinusoidal(4, 5)[:, :4], sinusoidal(4, 6)[:, :4])
    t = sinusoidal(3, 4, xp=torch, dtype=torch.float32)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32


def test_alibi_slopes_are_the_standard_geometric_ones() -> None:
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(1) == [2.0**-8]
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    expected_12 = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)]
    np.testing.assert_allclose(alibi_slopes(12), expected_12, rtol=1e-15)
    assert alibi_slopes(5) == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2]  # 4 heads, then 8 heads[0]


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    bias = alibi_bias(2, 3, 5)  # the 3 queries are the last 3 of 5 positions
    assert bias.shape == (2, 3, 5)
    # head 0 has slope 2^-4, head 1 has 2^-8; query 0 sits at position 2, query 2 at 4
    np.testing.assert_allclose(bias[0, 0], [-2 / 16, -1 / 16, 0.0, -1 / 16, -2 / 16])
    np.testing.assert_allclose(bias[1, 2], [-4 / 256, -3 / 256, -2 / 256, -1 / 256, 0.0])
    # on the causal part it is the paper's m·(j − i)
    i, j = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    causal = j <= i
    np.testing.assert_allclose(alibi_bias(1, 4)[0][causal], (2.0**-8 * (j - i))[causal])
    t = alibi_bias(4, 2, 3, xp=torch, offset=0)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    np.testing.assert_allclose(t.numpy(), alibi_bias(4, 2, 3, offset=0), rtol=1e-6)


def test_resolve_names() -> None:
    assert positional.resolve("rope") == positional.RoPE()
    assert positional.resolve("alibi") == positional.ALiBi()
    assert positional.resolve(None) is None


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: apply_rope(np.ones((2, 3))), ValueError,
         r"RoPE needs an even head dim D ≥ 2 .* got 3\. Hint: choose head_dim"),
        (lambda: apply_rope(np.ones((2, 4)), layout="pairs"), ValueError,  # type: ignore[arg-type]
         r"layout must be 'half' or 'interleaved', got 'pairs'"),
        (lambda: apply_rope(np.ones(4)), ValueError,
         r"x must have at least 2 dimensions \(\.\.\., L, D\); got shape \(4,\)"),
        (lambda: apply_rope(np.ones((2, 4), dtype=np.int64)), TypeError,
         r"x must have a floating-point dtype, got int64"),
        (lambda: apply_rope(np.ones((2, 4)), [0, 1, 2]), ValueError,
         r"positions must give one position per token \(length 2 on its last axis\), got "
         r"shape \(3,\)"),
        (lambda: apply_rope(np.ones((2, 4)), [0.5, 1.0]), TypeError,
         r"positions must be integers, got float64"),
        (lambda: apply_rope(np.ones((2, 4)), offset=-1), ValueError,
         r"offset must be an integer ≥ 0, got -1"),
        (lambda: apply_rope(np.ones((2, 4)), base=1.0), ValueError,
         r"base must be a number > 1, got 1\.0"),
        (lambda: alibi_slopes(0), ValueError, r"num_heads must be a positive integer, got 0"),
        (lambda: alibi_bias(2, 0), ValueError, r"alibi_bias: q_len must be a positive integer"),
        (lambda: alibi_bias(2, 3, slopes=[1.0]), ValueError,
         r"slopes must have one value per head \(2\), got 1"),
        (lambda: sinusoidal(3, 0), ValueError, r"sinusoidal: dim must be an integer ≥ 1, got 0"),
        (lambda: positional.RoPE(layout="x"), ValueError,  # type: ignore[arg-type]
         r"RoPE layout must be 'half' or 'interleaved', got 'x'"),
        (lambda: positional.resolve("rotary"), ValueError,
         r"positional must be None, one of 'rope', 'rope-interleaved', 'alibi'"),
    ],
)  # fmt: skip
def test_errors(call: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()  # type: ignore[operator]
