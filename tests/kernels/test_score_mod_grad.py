"""Gradients of tensors a ``score_mod`` captures, through the tiled kernel (issue 14).

Learned ALiBi slopes, a bias table indexed by relative position (T5-style), per-head scalars,
and a captured tensor computed from the leaf (``slopes = log_slopes.exp()``): their gradients
from the tiled kernel's backward equal those of autograd through the float64 reference, with
and without causal and window masks, with sinks, over shapes drawn by hypothesis. The score
modifiers are the examples FlexAttention's documentation gives for learned biases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import masks
from qkv.kernels import tiled_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = settings(max_examples=25, deadline=None)

ScoreModFactory = Callable[[dict[str, torch.Tensor]], Callable[..., torch.Tensor]]
ParamFactory = Callable[[np.random.Generator, int], dict[str, Any]]


def _alibi(p: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda s, b, h, q, kv: s - p["slopes"][h] * (q - kv).abs()


def _relative_table(p: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    table = p["table"]  # (H, 2·R + 1): one bias per head and clipped relative position
    reach = (table.shape[1] - 1) // 2
    return lambda s, b, h, q, kv: s + table[h, (kv - q).clamp(-reach, reach) + reach]


def _per_head_scale(p: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda s, b, h, q, kv: s * p["gain"][h] + p["offset"]


def _from_leaf(p: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    slopes = p["log_slopes"].exp()  # not a leaf: the gradient must reach log_slopes
    return lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs()


def _softcap_learned(p: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda s, b, h, q, kv: p["cap"] * torch.tanh(s / p["cap"])


FACTORIES: dict[str, tuple[ScoreModFactory, ParamFactory]] = {
    "alibi": (_alibi, lambda rng, h: {"slopes": rng.uniform(0.05, 1.0, h)}),
    "table": (_relative_table, lambda rng, h: {"table": rng.normal(size=(h, 9))}),
    "per-head": (
        _per_head_scale,
        lambda rng, h: {"gain": rng.uniform(0.5, 2.0, h), "offset": rng.normal(size=())},
    ),
    "from-leaf": (_from_leaf, lambda rng, h: {"log_slopes": rng.normal(-1.0, 0.5, h)}),
    "softcap": (_softcap_learned, lambda rng, h: {"cap": np.array(rng.uniform(2.0, 6.0))}),
}


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    lq = draw(st.integers(1, 40))
    lk = draw(st.integers(1, 40))
    dim = draw(st.sampled_from([2, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(sorted(FACTORIES)))
    return {
        "q": rng.normal(size=(batch, heads, lq, dim)),
        "k": rng.normal(size=(batch, kv_heads, lk, dim)),
        "v": rng.normal(size=(batch, kv_heads, lk, dim)),
        "grad": rng.normal(size=(batch, heads, lq, dim)),
        "kind": kind,
        "params": FACTORIES[kind][1](rng, heads),
        "mask": draw(st.sampled_from(["none", "causal", "window"])),
        "sinks": rng.normal(size=heads) if draw(st.booleans()) else None,
        "block": draw(st.sampled_from([8, 16, 64])),
    }


def _run(case: dict[str, Any], backend: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The output, then the gradients of q, k, v, (sinks,) and each captured tensor."""
    q, k, v = (torch.tensor(case[n], dtype=dtype, requires_grad=True) for n in ("q", "k", "v"))
    params = {
        name: torch.tensor(value, dtype=dtype, requires_grad=True)
        for name, value in case["params"].items()
    }
    sinks = (
        None
        if case["sinks"] is None
        else torch.tensor(case["sinks"], dtype=dtype, requires_grad=True)
    )
    score_mod = FACTORIES[case["kind"]][0](params)
    options: dict[str, Any] = {"score_mod": score_mod, "sinks": sinks}
    if case["mask"] == "causal":
        options["is_causal"] = True
    elif case["mask"] == "window":
        options["mask"] = masks.sliding_window(4)
    if backend == "tiled":
        out = tiled_attention(q, k, v, block_q=case["block"], block_kv=case["block"], **options)
    else:
        out = qkv.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, backend="reference", **options
        )
    wrt = [q, k, v, *([] if sinks is None else [sinks]), *params.values()]
    loss = (out * torch.tensor(case["grad"], dtype=dtype)).sum()
    grads = torch.autograd.grad(loss, wrt)
    return [out.detach(), *(g.detach() for g in grads)]


@SETTINGS
@given(_cases())
def test_captured_tensors_get_the_reference_gradients(case: dict[str, Any]) -> None:
    want = _run(case, "reference", torch.float64)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-4)):
        got = _run(case, "tiled", dtype)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                g.double(), w, rtol=tol, atol=tol * 10, msg=f"item {i} of {case['kind']}"
            )


def test_learned_slopes_get_a_gradient_through_scaled_dot_product_attention() -> None:
    """The dispatcher's tiled backend (auto picks it for a score_mod on torch tensors)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
    slopes = torch.full((4,), 0.1, requires_grad=True)
    out = qkv.scaled_dot_product_attention(
        q, k, v, is_causal=True, score_mod=lambda s, b, h, qi, kv: s - slopes[h] * (qi - kv)
    )
    out.sum().backward()
    assert slopes.grad is not None and bool(torch.isfinite(slopes.grad).all())
    assert bool((slopes.grad != 0).all())


def test_score_mod_gradient_is_computed_block_by_block() -> None:
    """No (Lq, Lk) tensor is formed: the score modifier only ever sees one block."""
    seen: list[tuple[int, ...]] = []
    gain = torch.tensor(0.7, requires_grad=True)

    def score_mod(s: torch.Tensor, b: Any, h: Any, qi: Any, kv: Any) -> torch.Tensor:
        seen.append(tuple(s.shape))
        return s * gain

    q, k, v = (torch.randn(1, 2, 256, 8, requires_grad=True) for _ in range(3))
    out = tiled_attention(q, k, v, score_mod=score_mod, block_q=64, block_kv=64)
    out.sum().backward()
    assert gain.grad is not None
    assert max(int(np.prod(shape)) for shape in seen) <= 2 * 64 * 64
