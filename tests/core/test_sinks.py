"""Attention sinks (issue 14): a per-head logit in each softmax row's denominator.

weights_ij = exp(S'_ij) / (Σ_j exp(S'_ij) + exp(sink_h)); the rows sum to less than 1. The
reference (NumPy and torch) is checked against that formula written out, and the tiled
kernel against the float64 reference for the outputs and dQ, dK, dV and d(sinks), with and
without causal and window masks, over shapes drawn by hypothesis.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import masks
from qkv.kernels import tiled_attention
from qkv.nn import MultiHeadAttention
from tests.support.backends import accepts, backend_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = settings(max_examples=25, deadline=None)


def _written_out(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray, allowed: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Context and weights of attention with sinks, by the formula, one row at a time."""
    batch, heads, lq, _ = q.shape
    group = heads // k.shape[1]
    weights = np.zeros((batch, heads, lq, k.shape[2]))
    for b in range(batch):
        for h in range(heads):
            for i in range(lq):
                s = k[b, h // group] @ q[b, h, i] / math.sqrt(q.shape[-1])
                e = np.exp(s)
                if allowed is not None:
                    e = np.where(allowed[i], e, 0.0)
                weights[b, h, i] = e / (e.sum() + math.exp(sinks[h]))
    context = np.einsum("bhij,bhjd->bhid", weights, np.repeat(v, group, axis=1))
    return context, weights


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    lq = draw(st.integers(1, 40))
    lk = draw(st.integers(1, 40))
    dim = draw(st.sampled_from([1, 4, 8]))
    seed = draw(st.integers(0, 2**16))
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    block = draw(st.sampled_from([8, 16, 64]))
    rng = np.random.default_rng(seed)
    return {
        "q": rng.normal(size=(batch, heads, lq, dim)),
        "k": rng.normal(size=(batch, kv_heads, lk, dim)),
        "v": rng.normal(size=(batch, kv_heads, lk, dim)),
        "sinks": rng.normal(scale=2.0, size=heads),
        "grad": rng.normal(size=(batch, heads, lq, dim)),
        "mask": mask,
        "block": block,
    }


def _mask_options(kind: str) -> dict[str, Any]:
    if kind == "causal":
        return {"is_causal": True}
    if kind == "window":
        return {"mask": masks.sliding_window(3)}
    return {}


def _dense(kind: str, lq: int, lk: int) -> np.ndarray | None:
    if kind == "none":
        return None
    rule = masks.causal() if kind == "causal" else masks.sliding_window(3)
    return np.asarray(rule.dense(lq, lk, xp=np)).reshape(lq, lk)


@SETTINGS
@given(_cases())
def test_reference_with_sinks_is_the_formula(case: dict[str, Any]) -> None:
    q, k, v, sinks = case["q"], case["k"], case["v"], case["sinks"]
    lq, lk = q.shape[2], k.shape[2]
    context, weights = qkv.scaled_dot_product_attention(
        q,
        k,
        v,
        sinks=sinks,
        enable_gqa=True,
        return_weights=True,
        **_mask_options(case["mask"]),
    )
    want_context, want_weights = _written_out(q, k, v, sinks, _dense(case["mask"], lq, lk))
    np.testing.assert_allclose(weights, want_weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(context, want_context, rtol=1e-10, atol=1e-12)
    assert np.all(weights.sum(axis=-1) < 1.0)


def _grads(
    case: dict[str, Any], backend: str, dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v, sinks = (
        torch.tensor(case[name], dtype=dtype, requires_grad=True)
        for name in ("q", "k", "v", "sinks")
    )
    options = _mask_options(case["mask"])
    if backend == "tiled":
        out = tiled_attention(
            q, k, v, sinks=sinks, block_q=case["block"], block_kv=case["block"], **options
        )
    else:
        out = qkv.scaled_dot_product_attention(
            q, k, v, sinks=sinks, enable_gqa=True, backend="reference", **options
        )
    grads = torch.autograd.grad(
        (out * torch.tensor(case["grad"], dtype=dtype)).sum(), [q, k, v, sinks]
    )
    return out.detach(), [g.detach() for g in grads]


@SETTINGS
@given(_cases())
def test_tiled_sinks_match_the_float64_reference(case: dict[str, Any]) -> None:
    want, want_grads = _grads(case, "reference", torch.float64)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        out, grads = _grads(case, "tiled", dtype)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        for name, got, expected in zip(
            ("dQ", "dK", "dV", "dsinks"), grads, want_grads, strict=True
        ):
            torch.testing.assert_close(
                got.double(), expected, rtol=tol, atol=tol * 10, msg=f"{name} ({dtype})"
            )


def test_dsinks_is_minus_the_sink_share_times_dO_dot_O() -> None:
    """d(sinks)_h = −Σ_rows share_i · (dO_i · O_i): the sink is a key of value 0 whose
    weight share_i takes from every other key in proportion."""
    rng = np.random.default_rng(3)
    q, k, v = (torch.tensor(rng.normal(size=(1, 2, 7, 4)), requires_grad=True) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    grad = torch.tensor(rng.normal(size=(1, 2, 7, 4)))
    out = tiled_attention(q, k, v, sinks=sinks, is_causal=True, block_q=4, block_kv=4)
    (d_sinks,) = torch.autograd.grad((out * grad).sum(), [sinks])
    _, weights = qkv.scaled_dot_product_attention(
        q.detach(),
        k.detach(),
        v.detach(),
        sinks=sinks.detach(),
        is_causal=True,
        return_weights=True,
    )
    share = 1.0 - weights.sum(dim=-1)  # (1, H, Lq)
    want = -(share * (grad * out.detach()).sum(dim=-1)).sum(dim=(0, 2))
    torch.testing.assert_close(d_sinks, want)


@pytest.mark.parametrize("backend", backend_names())
def test_a_fully_masked_row_gives_all_its_attention_to_the_sink(backend: Any) -> None:
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([0.0, 3.0], dtype=torch.float64, requires_grad=True)
    allowed = torch.ones(5, 5, dtype=torch.bool)
    allowed[2] = False  # row 2 sees no key
    if not accepts(backend, q, k, v, mask=allowed, sinks=sinks):
        pytest.skip(f"{backend} takes no sinks here")
    out = qkv.scaled_dot_product_attention(q, k, v, mask=allowed, sinks=sinks, backend=backend)
    assert torch.equal(out[0, :, 2], torch.zeros(2, 4, dtype=torch.float64))
    out.sum().backward()
    for x in (q, k, v, sinks):
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())


@pytest.mark.parametrize("backend", backend_names())
def test_a_minus_infinite_sink_is_no_sink(backend: Any) -> None:
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(6, 6, dtype=torch.bool)
    allowed[1] = False
    none = torch.full((3,), -math.inf, dtype=torch.float64, requires_grad=True)
    if not accepts(backend, q, k, v, mask=allowed, sinks=none):
        pytest.skip(f"{backend} takes no sinks here")
    got = qkv.scaled_dot_product_attention(q, k, v, mask=allowed, sinks=none, backend=backend)
    want = qkv.scaled_dot_product_attention(q, k, v, mask=allowed, backend="reference")
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert none.grad is not None and torch.equal(none.grad, torch.zeros(3, dtype=torch.float64))


def test_sdpa_refuses_sinks_and_says_why() -> None:
    q = torch.randn(1, 2, 4, 8)
    sinks = torch.zeros(2)
    dispatch = qkv.explain_dispatch(q, q, q, sinks=sinks)
    assert dispatch.backend == "tiled"
    assert "sink" in str(dispatch)
    with pytest.raises(ValueError, match="sink"):
        qkv.scaled_dot_product_attention(q, q, q, sinks=sinks, backend="sdpa")


@pytest.mark.parametrize(
    ("sinks", "match"),
    [
        (np.zeros(3), r"shape \(2,\)"),
        (np.array([0.0, np.nan]), "finite or −inf"),
        (np.array([0.0, np.inf]), "finite or −inf"),
        (np.array([0, 1]), "floating-point"),
    ],
)
def test_bad_sinks_are_refused_naming_the_argument(sinks: np.ndarray, match: str) -> None:
    q = np.ones((2, 3, 4))  # (H, L, D) with enable_gqa: two heads
    with pytest.raises((ValueError, TypeError), match=match) as info:
        qkv.scaled_dot_product_attention(q, q, q, enable_gqa=True, sinks=sinks)
    assert "sinks" in str(info.value) and "Hint:" in str(info.value)


def test_multi_head_attention_takes_sinks() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8))
    W = rng.normal(size=(8, 8))
    sinks = np.array([0.3, -0.2])
    out, weights = qkv.multi_head_attention(
        x, W, W, W, num_heads=2, sinks=sinks, return_weights=True
    )
    q = (x @ W).reshape(5, 2, 4).transpose(1, 0, 2)[None]
    context, want = _written_out(q, q, q, sinks, None)
    np.testing.assert_allclose(weights, want[0], rtol=1e-10)
    np.testing.assert_allclose(out, context[0].transpose(1, 0, 2).reshape(5, 8), rtol=1e-10)


def test_module_learns_its_sinks_from_zero() -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, num_heads=4, num_kv_heads=2, sinks=True)
    assert attn.sinks is not None and torch.equal(attn.sinks.detach(), torch.zeros(4))
    x = torch.randn(2, 9, 16)
    _, weights = attn(x, is_causal=True, need_weights=True)
    assert bool((weights.sum(dim=-1) < 1).all())
    attn(x, is_causal=True).pow(2).sum().backward()
    assert attn.sinks.grad is not None and bool((attn.sinks.grad != 0).all())
    plain = MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 4, batch_first=True))
    assert plain.sinks is None


def test_trace_records_each_rows_sink_share_and_saves_it(tmp_path: Any) -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, 6, 4)) for _ in range(3))
    sinks = np.array([1.0, -2.0])
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=sinks)
    sink = trace.calls[0].meta["sink"]
    assert sink["logits"] == [1.0, -2.0]
    assert sink["axes"] == ["head", "query"]
    share = np.array(sink["share"])
    np.testing.assert_allclose(share, 1.0 - trace["weights"].value.sum(axis=-1), atol=1e-12)
    path = tmp_path / "sinks.json"
    trace.save(path)
    loaded = qkv.Trace.load(path)
    assert loaded.calls[0].meta["sink"]["share"] == json.loads(json.dumps(sink["share"]))


def test_explain_says_how_much_of_a_rows_attention_goes_to_the_sink() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 6))
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(x, x, x, sinks=np.array([1.0]), is_causal=True)
    text = qkv.render.text(qkv.Trace.from_json(trace.to_json()))
    line = next(line for line in text.splitlines() if "of its attention to the sink" in line)
    share = 1.0 - trace["weights"].value.sum(axis=-1)
    assert f"gives {share[3]:.2f} of its attention to the sink" in line  # the worked row
