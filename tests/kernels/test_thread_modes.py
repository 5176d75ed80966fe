"""The tiled kernel's two ways of using threads compute the same numbers.

``"torch"`` spreads each operation over PyTorch's threads; ``"pool"`` gives whole blocks to
threads of its own. The forward and dK, dV are the same to the bit; dQ adds the key blocks'
shares in another order, so only its rounding may differ. The float64 reference decides.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import qkv
from qkv.kernels import get_thread_mode, set_thread_mode, tiled_attention
from qkv.masks import document, sliding_window


@pytest.fixture
def two_threads() -> Iterator[None]:
    before, mode = torch.get_num_threads(), get_thread_mode()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        set_thread_mode(mode)


def _grads(
    mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object
) -> list[torch.Tensor]:
    """The output and dQ, dK, dV of the tiled kernel in ``mode`` ("reference": qkv's
    readable reference instead)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    if mode == "reference":
        out = qkv.scaled_dot_product_attention(*leaves, backend="reference", **options)  # type: ignore[arg-type]
    else:
        set_thread_mode(mode)  # type: ignore[arg-type]
        out = tiled_attention(*leaves, **options)  # type: ignore[arg-type]
    out.backward(torch.cos(out.detach()))
    return [out.detach(), *(x.grad for x in leaves if x.grad is not None)]


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"mask": sliding_window(40)},
        {"mask": document([0] * 70 + [1] * 90 + [2] * 140)},
        {},
    ],
    ids=["causal", "window", "documents", "dense"],
)
def test_both_modes_compute_the_same_numbers(options: dict[str, object]) -> None:
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 16, generator=generator) for _ in "qkv")
    out_t, dq_t, dk_t, dv_t = _grads("torch", q, k, v, **options)
    out_p, dq_p, dk_p, dv_p = _grads("pool", q, k, v, **options)
    assert torch.equal(out_t, out_p) and torch.equal(dk_t, dk_p) and torch.equal(dv_t, dv_p)
    torch.testing.assert_close(dq_t, dq_p, rtol=1e-5, atol=1e-6)
    exact = _grads("reference", q.double(), k.double(), v.double(), **options)
    for fast, reference in zip((out_p, dq_p, dk_p, dv_p), exact, strict=True):
        torch.testing.assert_close(fast.double(), reference, rtol=1e-4, atol=1e-5)


def test_a_mode_that_does_not_exist_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"mode must be 'torch' or 'pool', got 'openmp'"):
        set_thread_mode("openmp")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"), [("pool", "pool"), ("", "torch"), ("bogus", "torch")]
)
def test_the_environment_variable_chooses_the_mode(value: str, expected: str) -> None:
    code = "import qkv.kernels as k; print(k.get_thread_mode())"
    env = {**os.environ, "QKV_THREAD_MODE": value}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == expected
    if value == "bogus":
        assert "QKV_THREAD_MODE must be 'torch' or 'pool', got 'bogus'" in done.stderr
