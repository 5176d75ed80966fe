"""The operators a compiled graph calls (``qkv::tiled_attention``, its backward,
``qkv::key_padding_mask``): torch's own checks of a custom operator (``opcheck``: the schema,
the fake implementation's shapes and strides against the real ones, the autograd
registration, and AOTAutograd's use of both), and their numbers against the eager kernel."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.library import opcheck

import qkv
import qkv.nn  # registers qkv::key_padding_mask
from qkv.kernels import tiled_in_graph

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, H, HKV, L, D = 2, 4, 2, 9, 8


def _inputs(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """query, key, value (B, H or Hkv, L, D), each a transposed view as a model makes it."""
    g = torch.Generator().manual_seed(0)
    shapes = ((B, L, H, D), (B, L, HKV, D), (B, L, HKV, D))
    return [
        torch.randn(shape, generator=g).to(dtype).transpose(1, 2).requires_grad_()
        for shape in shapes
    ]


def _options(case: str, q: torch.Tensor) -> dict[str, Any]:
    causal = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    cases: dict[str, dict[str, Any]] = {
        "causal": {"is_causal": True},
        "mask and bias": {
            "mask": causal,
            "bias": torch.randn(1, H, L, L, generator=torch.Generator().manual_seed(1)).to(q),
        },
        "sinks": {"sinks": torch.tensor([0.5, -1.0, 0.0, 2.0]).to(q), "is_causal": True},
        "dropout": {"seed": torch.tensor([123]), "dropout_p": 0.25},
        "candidate": {"candidate": torch.randn(B, L, H, D).to(q).transpose(1, 2)},
    }
    return cases[case]


CASES = ["causal", "mask and bias", "sinks", "dropout", "candidate"]


def _arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> Any:
    return (
        q,
        k,
        v,
        options.get("mask"),
        options.get("bias"),
        options.get("sinks"),
        options.get("seed"),
        options.get("candidate"),
        options.get("is_causal", False),
        "top-left",
        D**-0.5,
        options.get("dropout_p", 0.0),
        True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_the_tiled_operator_passes_torchs_operator_checks(case: str, dtype: torch.dtype) -> None:
    q, k, v = _inputs(dtype)
    result = opcheck(torch.ops.qkv.tiled_attention.default, _arguments(q, k, v, _options(case, q)))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("case", ["causal", "mask and bias", "sinks", "dropout"])
def test_the_operator_gives_the_eager_kernels_numbers_and_gradients(case: str) -> None:
    q, k, v = _inputs()
    options = _options(case, q)
    seed = options.pop("seed", None)
    got = tiled_in_graph(
        q,
        k,
        v,
        mask=options.get("mask"),
        bias=options.get("bias"),
        sinks=options.get("sinks"),
        seed=seed,
        candidate=None,
        is_causal=options.get("is_causal", False),
        causal_alignment="top-left",
        scale=D**-0.5,
        dropout_p=options.get("dropout_p", 0.0),
        grad=True,
    )
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    generator = None if seed is None else int(seed)
    expected = qkv.scaled_dot_product_attention(
        q,
        k,
        v,
        mask=options.get("mask"),
        bias=options.get("bias"),
        sinks=options.get("sinks"),
        is_causal=options.get("is_causal", False),
        dropout_p=options.get("dropout_p", 0.0),
        generator=generator,
        enable_gqa=True,
        backend="tiled",
    )
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for mine, theirs in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def test_a_kept_candidate_takes_the_gradient_and_a_redone_one_none() -> None:
    q, k, v = _inputs()
    candidate = torch.randn(B, H, L, D, requires_grad=True)
    out, *_, ran = torch.ops.qkv.tiled_attention(*_arguments(q, k, v, {"candidate": candidate}))
    assert not bool(ran)
    torch.testing.assert_close(out, candidate.detach())
    out.sum().backward()
    assert candidate.grad is not None and bool((candidate.grad == 1).all())
    assert q.grad is not None and not bool(q.grad.any())  # the tiled kernel did not run
    nan = candidate.detach().clone()
    nan[0, 0, 0, 0] = torch.nan  # torch let a NaN through: the kernel redoes the call
    nan.requires_grad_()
    out, *_, ran = torch.ops.qkv.tiled_attention(*_arguments(q, k, v, {"candidate": nan}))
    assert bool(ran) and bool(torch.isfinite(out).all())
    out.sum().backward()
    assert nan.grad is not None and not bool(nan.grad.any())


def test_the_key_padding_operator_checks_the_lengths_when_it_runs() -> None:
    lengths = torch.tensor([3, 7])
    result = opcheck(torch.ops.qkv.key_padding_mask.default, (lengths, 7))
    assert set(result.values()) == {"SUCCESS"}, result
    allowed = torch.ops.qkv.key_padding_mask(lengths, 7)
    assert allowed.shape == (2, 1, 1, 7) and allowed.sum().item() == 10
    with pytest.raises(ValueError, match=r"key_padding_lengths must be between 0 and the key "
                       r"length Lk = 7, got \[3, 8\]"):  # fmt: skip
        torch.ops.qkv.key_padding_mask(torch.tensor([3, 8]), 7)
