"""Every message for bad input: names the argument, what was expected, what came, and a hint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import masks

sdpa = qkv.scaled_dot_product_attention


def a(*shape: int, dtype: Any = np.float64) -> np.ndarray:
    return np.ones(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (a(3), a(3, 2), a(3, 2)),
            {},
            ValueError,
            r"query must have at least 2 dimensions.*\(3,\)",
        ),
        ((a(3, 2), a(3, 4), a(3, 4)), {}, ValueError, r"same last dimension d_k.*d_k = 2.*has 4"),
        ((a(3, 0), a(3, 0), a(3, 1)), {}, ValueError, r"d_k = 0"),
        ((a(3, 2), a(4, 2), a(5, 2)), {}, ValueError, r"key and value must have the same length"),
        ((a(0, 2), a(4, 2), a(4, 2)), {}, ValueError, r"query is an empty sequence \(Lq = 0"),
        ((a(3, 2), a(0, 2), a(0, 2)), {}, ValueError, r"key is an empty sequence \(Lk = 0"),
        ((a(1, 3, 2), a(3, 2), a(3, 2)), {}, ValueError, r"key must have as many dimensions"),
        ((a(1, 4, 3, 2), a(1, 2, 3, 2), a(1, 2, 3, 2)), {}, ValueError, r"enable_gqa=True"),
        (
            (a(1, 3, 3, 2), a(1, 2, 3, 2), a(1, 2, 3, 2)),
            {"enable_gqa": True},
            ValueError,
            r"Hq divisible by Hkv.*Hq = 3.*Hkv = 2",
        ),
        ((a(2, 3, 2), a(3, 3, 2), a(3, 3, 2)), {}, ValueError, r"same batch dimensions"),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"mask": a(3, 5, dtype=bool)},
            ValueError,
            r"mask must broadcast to the scores' shape \(Lq, Lk\) = \(3, 4\); got \(3, 5\)",
        ),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"mask": a(3, 4)},
            TypeError,
            r"mask must be boolean \(True = may attend\), got float64.*from_additive",
        ),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"mask": a(3, 4, dtype=np.int64)},
            TypeError,
            r"got int64.*astype\(bool\)",
        ),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"mask": [[True]]},
            TypeError,
            r"mask must be a boolean array",
        ),
        ((a(3, 2), a(4, 2), a(4, 2)), {"bias": a(2, 4)}, ValueError, r"bias must broadcast"),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"bias": a(3, 4, dtype=bool)},
            TypeError,
            r"bias must have a floating-point dtype, got bool",
        ),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"scale": "big"},
            TypeError,
            r"scale must be a finite number",
        ),
        ((a(3, 2), a(4, 2), a(4, 2)), {"scale": float("nan")}, TypeError, r"scale must be"),
        ((a(3, 2), a(4, 2), a(4, 2)), {"dropout_p": 1.0}, ValueError, r"dropout_p must be"),
        (
            (a(3, 2), a(4, 2), a(4, 2)),
            {"is_causal": True, "causal_alignment": "left"},
            ValueError,
            r"causal_alignment must be 'top-left' or 'bottom-right', got 'left'",
        ),
        (
            (a(3, 2, dtype=np.int64), a(4, 2), a(4, 2)),
            {},
            TypeError,
            r"query must have a floating-point dtype, got int64",
        ),
        (
            (a(3, 2), a(4, 2, dtype=np.float32), a(4, 2)),
            {},
            TypeError,
            r"query is float64 but key is float32",
        ),
        (
            ("abc", a(4, 2), a(4, 2)),
            {},
            TypeError,
            r"query must be a NumPy array or a PyTorch tensor",
        ),
        (([[1.0], [1.0, 2.0]], a(4, 2), a(4, 2)), {}, ValueError, r"rectangular array"),
    ],
)
def test_sdpa_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        sdpa(*args, **kwargs)


def test_mixed_namespaces() -> None:
    with pytest.raises(
        TypeError, match=r"query is a PyTorch tensor but key is a NumPy array.*mixed"
    ):
        sdpa(torch.ones(3, 2, dtype=torch.float64), a(4, 2), a(4, 2))
    t = torch.ones(3, 2, dtype=torch.float64)
    with pytest.raises(
        TypeError, match=r"query is a PyTorch tensor but mask is a NumPy array.*mixed"
    ):
        sdpa(t, t, t, mask=np.ones((3, 3), dtype=bool))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(3, 4), a(4, 4), a(4, 4)),
            r"W_q must have d_model = 4 rows.*got \(3, 4\).*transpose",
        ),
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(4, 6), a(4, 6), a(4, 6), num_heads=4),
            r"num_heads = 4 must divide the columns of W_q \(6\).*valid head counts: \[1, 2, 3, 6",
        ),
        (
            lambda: qkv.multi_head_attention(
                a(3, 4), a(4, 6), a(4, 6), a(4, 6), num_heads=3, num_kv_heads=2
            ),
            r"grouped-query attention needs Hq divisible by Hkv",
        ),
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(4, 4), a(4, 4), a(4, 4), num_heads=0),
            r"num_heads must be a positive integer, got 0",
        ),
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(4, 4), a(4, 2), a(4, 2)),
            r"the heads of W_q and W_k must have the same d_k",
        ),
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(4, 4), a(4, 4), a(4, 4), a(3, 4)),
            r"W_o must have num_heads · d_v = 1 · 4 = 4 rows",
        ),
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(4, 4), a(4, 4), a(4, 4), b_q=a(3)),
            r"b_q must be a vector of 4 numbers",
        ),
        (
            lambda: qkv.multi_head_attention(a(3, 4), a(4, 4, 1), a(4, 4), a(4, 4)),
            r"W_q must be a matrix",
        ),
        (
            lambda: qkv.multi_head_attention(a(0, 4), a(4, 4), a(4, 4), a(4, 4)),
            r"x is an empty sequence",
        ),
        (
            lambda: qkv.multi_head_attention(
                a(2, 3, 4), a(4, 4), a(4, 4), a(4, 4), context=a(3, 3, 4)
            ),
            r"context must have the batch dimensions of x",
        ),
        (lambda: qkv.multi_head_attention(a(3, 4), a(4, 0), a(4, 0), a(4, 0)), r"d_k = 0"),
    ],
)
def test_multi_head_errors(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: masks.causal("diagonal"), ValueError, r"causal_alignment must be"),  # type: ignore[arg-type]
        (lambda: masks.sliding_window(-1), ValueError, r"before must be an integer ≥ 0, got -1"),
        (lambda: masks.key_padding([1.5]), ValueError, r"lengths must be a non-empty 1-D"),
        (lambda: masks.key_padding([-1]), ValueError, r"lengths must be ≥ 0"),
        (lambda: masks.causal() & np.ones(3, dtype=bool), TypeError, r"combines with & only"),
        (lambda: masks.from_ignore(np.zeros(3)), TypeError, r"from_ignore expects a boolean mask"),
        (lambda: masks.to_additive(np.zeros(3)), TypeError, r"to_additive expects a boolean"),
        (
            lambda: masks.key_padding([1, 2]).dense(2, 2, batch=3),
            ValueError,
            r"key_padding has 2 lengths but the batch has 3",
        ),
    ],
)
def test_mask_errors(call: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_softmax_of_integers_is_refused() -> None:
    with pytest.raises(TypeError, match=r"softmax needs floating-point scores, got int64"):
        qkv.softmax(np.array([1, 2]))
