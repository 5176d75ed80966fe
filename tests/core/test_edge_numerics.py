"""Edge numerics on every backend (issue 12, items 1–8 and the backend parts of 15/16):
blocked biases (−inf, torch.finfo(float32).min), NaN in live and masked inputs, gradients,
batch size 0, more than 4 dimensions, half precision, overflow, a patched torch SDPA, and the
refusals that explain_dispatch reports."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import masks
from qkv.kernels import tiled_attention
from tests.support.backends import backend_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = backend_names(auto=True)
FMIN32 = float(torch.finfo(torch.float32).min)
FMIN64 = float(torch.finfo(torch.float64).min)


def _attend(q: Any, k: Any, v: Any, backend: Any, **options: Any) -> Any:
    return qkv.scaled_dot_product_attention(q, k, v, backend=backend, **options)


def _grads(
    inputs: list[torch.Tensor], backend: str, weight: torch.Tensor, **options: Any
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The output and the gradients of (output · weight).sum() for each input."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    q, k, v, *rest = leaves
    if rest:
        options = {**options, "bias": rest[0]}
    out = _attend(q, k, v, backend, **options)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 1e-4 if expected.dtype == torch.float32 else 1e-9
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True, msg=what)


# -- item 1: rows whose allowed keys all carry a blocked bias -----------------------------


@st.composite
def blocked_cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    lq, lk, d = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=dtype) for n in (lq, lk, lk))
    blocked = [-math.inf, FMIN32] + ([FMIN64, -1e300] if dtype == torch.float64 else [])
    values = draw(
        st.lists(st.one_of(st.sampled_from(blocked), st.floats(-3, 3)), min_size=lk, max_size=lk)
    )
    bias = torch.tensor(values, dtype=dtype).repeat(lq, 1)  # (Lq, Lk)
    dead_rows = draw(st.lists(st.integers(0, lq - 1), max_size=lq))
    for row in dead_rows:  # every key of these rows blocked
        bias[row] = draw(st.sampled_from(blocked))
    mask = None
    if draw(st.booleans()):
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=lq * lk, max_size=lq * lk)))
        mask = mask.reshape(lq, lk)
    return {"q": q, "k": k, "v": v, "bias": bias, "mask": mask}


@settings(max_examples=80, deadline=None)
@given(blocked_cases())
def test_blocked_bias_rows_give_the_reference_answer_forward_and_backward(
    case: dict[str, Any],
) -> None:
    """A −inf bias on every allowed key gives zeros; finfo.min on every allowed key gives
    the softmax of equal numbers (the mean of the values); the gradients too. (With a
    gradient, sdpa refuses a huge bias: torch's backward is wrong on such rows.)"""
    q, k, v, bias, mask = case["q"], case["k"], case["v"], case["bias"], case["mask"]
    weight = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    inputs = [q, k, v, bias]
    expected, expected_grads = _grads(inputs, "reference", weight, mask=mask)
    with torch.no_grad():  # sdpa runs the forward (with a gradient, auto avoids it)
        _close(_attend(q, k, v, "sdpa", bias=bias, mask=mask), expected, "sdpa: output")
    for backend in ("tiled", "auto"):
        out, grads = _grads(inputs, backend, weight, mask=mask)
        assert bool(torch.isfinite(out).all()), backend
        _close(out, expected, f"{backend}: output")
        for name, got, want in zip("QKVB", grads, expected_grads, strict=True):
            assert got is not None and want is not None
            assert bool(torch.isfinite(got).all()), f"{backend}: d{name} not finite"
            _close(got, want, f"{backend}: d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("blocked", [-math.inf, FMIN32])
@pytest.mark.parametrize("with_mask", [False, True])
def test_tiled_kernel_on_blocked_rows_across_blocks(
    dtype: torch.dtype, blocked: float, with_mask: bool
) -> None:
    """Several query and key blocks; rows blocked whole, as a left-padded decoder's (T5)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=gen, dtype=dtype) for _ in range(3))
    bias = torch.zeros(2, 1, 40, 40, dtype=dtype)
    bias[0, :, :, :13] = blocked  # padding on the left of batch element 0
    bias[1, :, 5:9] = blocked  # rows 5–8 of element 1 see nothing
    mask = masks.causal() if with_mask else None
    weight = torch.randn(2, 2, 40, 8, generator=gen, dtype=dtype)
    expected, expected_grads = _grads([q, k, v, bias], "reference", weight, mask=mask)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
    out = tiled_attention(*leaves[:3], bias=leaves[3], mask=mask, block_q=16, block_kv=16)
    (out * weight).sum().backward()
    _close(out.detach(), expected, "output")
    for name, leaf, want in zip("QKVB", leaves, expected_grads, strict=True):
        assert want is not None and leaf.grad is not None
        _close(leaf.grad, want, f"d{name}")


def test_blocked_bias_with_lse() -> None:
    """return_lse gives the log-sum-exp of the biased scores, also with a huge bias."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 4, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[1] = -1e300
    bias[2, :2] = -math.inf
    _, lse = tiled_attention(q, k, v, bias=bias, return_lse=True)
    scores = q @ k.mT / math.sqrt(3) + bias
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-12, atol=0)


# -- item 2: torch's SDPA replaced by a function that calls qkv ----------------------------


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_patched_torch_sdpa_calling_qkv_does_not_recurse(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def patched(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        out: torch.Tensor = qkv.scaled_dot_product_attention(
            query, key, value, mask=attn_mask, is_causal=is_causal, scale=scale, backend=backend
        )
        return out

    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    expected = _attend(q, k, v, "reference", is_causal=True)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", patched)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    _close(out, expected, backend)


# -- item 3: more than 4 dimensions --------------------------------------------------------


def test_auto_runs_more_than_four_dimensions() -> None:
    q, k, v = (torch.randn(2, 3, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(3, 1, 5, 5) > 0.3
    expected = _attend(q, k, v, "reference", mask=mask, is_causal=True)
    out = _attend(q, k, v, "auto", mask=mask, is_causal=True)
    _close(out, expected, "auto, 5-D")
    assert qkv.explain_dispatch(q, k, v).backend == "reference"


# -- item 4: batch size 0 ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5, 4), (0, 2, 5, 4), (2, 0, 5, 4)])
def test_empty_batch_gives_an_empty_result(backend: str, shape: tuple[int, ...]) -> None:
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    out = _attend(q, k, v, backend, is_causal=True)
    assert tuple(out.shape) == shape
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and tuple(x.grad.shape) == shape


def test_empty_batch_numpy_and_weights() -> None:
    q = np.zeros((0, 5, 4))
    out, weights = qkv.scaled_dot_product_attention(q, q, q, return_weights=True)
    assert out.shape == (0, 5, 4) and weights.shape == (0, 5, 5)
    out = tiled_attention(*(torch.zeros(0, 2, 5, 4) for _ in range(3)), bias=torch.zeros(5, 5))
    assert tuple(out.shape) == (0, 2, 5, 4)


# -- item 5: NaN in a live input comes out NaN -------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_nan_in_a_query_gives_nan_in_its_row(backend: str, masked: bool) -> None:
    q, k, v = (torch.randn(1, 2, 4, 3) for _ in range(3))
    q[0, 1, 2, 0] = math.nan
    mask = torch.ones(4, 4, dtype=torch.bool).tril() if masked else None
    out = _attend(q, k, v, backend, mask=mask)
    assert bool(torch.isnan(out[0, 1, 2]).all()), backend
    others = torch.ones(out.shape, dtype=torch.bool)
    others[0, 1, 2] = False
    assert bool(torch.isfinite(out[others]).all()), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_every_key_gives_nan(backend: str) -> None:
    q, k, v = (torch.randn(1, 1, 3, 2) for _ in range(3))
    k[..., 1] = math.nan
    assert bool(torch.isnan(_attend(q, k, v, backend)).all()), backend


# -- item 6: half precision, what each backend computes -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_of_each_backend(dtype: torch.dtype) -> None:
    """A backend that computes half inputs in a wider dtype (``half_in``: the reference
    and tiled, in float32) gives the float64 result rounded (at most half a unit in the
    last place, plus float32 rounding); one that hands them to its kernel as they are
    (sdpa) is within 4 units of the half type. The table is the registry's."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 64, 16, generator=gen).to(dtype) for _ in range(3))
    exact = _attend(q.double(), k.double(), v.double(), "reference")
    eps = torch.finfo(dtype).eps
    size = float(exact.abs().max())
    registry = qkv.attention.BACKENDS
    for backend in backend_names():
        wider = registry[backend].half_in
        bound = eps / 2 if wider is not None else 4 * eps
        out = _attend(q, k, v, backend)
        assert out.dtype == dtype
        error = float((out.double() - exact).abs().max())
        assert error <= bound * size + 1e-5, (backend, error / size / eps)
        notes = " ".join(qkv.explain_dispatch(q, k, v, backend=backend).notes)
        if wider is not None:
            assert f"computed in {wider} and the result rounded to {str(dtype)[6:]}" in notes
        else:
            assert f"{str(dtype)[6:]}: given to " in notes, (backend, notes)


# -- item 7: masked NaN never reaches a gradient -------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", ["key", "query", "value"])
def test_masked_nan_never_reaches_the_gradients(
    backend: str, dtype: torch.dtype, where: str
) -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 4, 3, generator=gen, dtype=dtype) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[:, 3] = False  # nobody attends key 3
    mask[2, :] = False  # query 2 attends nothing
    if where == "key":
        k[0, 1, 3, 0] = math.nan
    elif where == "value":
        v[0, 0, 3, 1] = math.nan
    else:
        q[0, 1, 2, 1] = math.nan
    out, grads = _grads([q, k, v], backend, torch.ones(1, 2, 4, 3, dtype=dtype), mask=mask)
    assert bool(torch.isfinite(out).all())
    for name, grad in zip("QKV", grads, strict=True):
        assert grad is not None
        assert bool(torch.isfinite(grad).all()), f"{backend}: d{name} has NaN"


# -- item 8: overflow --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "scale"), [(1e308, None), (1.0, 1e308), (1e200, 1.0)], ids=["big", "scale", "mid"]
)
def test_overflowing_scores_raise_one_clear_error(entry: float, scale: float | None) -> None:
    q = np.array([[entry, 1.0], [1.0, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning either
        with pytest.raises(ValueError, match=r"overflowed float64.*Hint: rescale") as info:
            qkv.scaled_dot_product_attention(q, q, q, scale=scale)
    assert "\n" not in str(info.value)


def test_overflow_in_a_masked_out_pair_is_harmless() -> None:
    q = np.array([[1e200, 0.0], [1.0, 1.0]])
    mask = np.array([[False, True], [True, True]])
    out = qkv.scaled_dot_product_attention(q, q, np.eye(2), mask=mask, scale=1.0)
    assert np.isfinite(out).all()


# -- items 15/16: explain_dispatch, is_causal with mask, qkv.nn ---------------------------


def test_explain_dispatch_reports_a_refused_backend() -> None:
    q = torch.randn(1, 2, 4, 3)
    found = qkv.explain_dispatch(q, q, q, backend="sdpa", score_mod=masks.softcap(5.0))
    assert found.backend == "none"
    assert found.refusal is not None and "score_mod" in found.refusal
    assert "sdpa" in str(found)
    with pytest.raises(ValueError, match="cannot run this call: a score_mod"):
        qkv.scaled_dot_product_attention(q, q, q, backend="sdpa", score_mod=masks.softcap(5.0))


def test_is_causal_with_a_mask_is_combined_and_said() -> None:
    q, k, v = (torch.randn(1, 1, 4, 3, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[True, False, True, True]]).expand(4, 4)
    found = qkv.explain_dispatch(q, k, v, mask=mask, is_causal=True)
    assert any("combined" in note for note in found.notes)
    both = mask & torch.ones(4, 4, dtype=torch.bool).tril()
    _close(
        _attend(q, k, v, "auto", mask=mask, is_causal=True),
        _attend(q, k, v, "reference", mask=both),
        "combined",
    )


def test_multi_head_attention_names_a_dtype_mismatch() -> None:
    module = qkv.nn.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=r"query is float64 but the module's weights are float32"):
        module(torch.randn(2, 5, 8, dtype=torch.float64))


def test_key_padding_lengths_beyond_the_keys_are_refused() -> None:
    module = qkv.nn.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"key_padding_lengths must be between 0 and .* Lk = 5"):
        module(torch.randn(2, 5, 8), key_padding_lengths=[7, 3])
    q = torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"key_padding: lengths must be at most .* Lk = 5"):
        qkv.scaled_dot_product_attention(q, q, q, mask=masks.key_padding([6, 2]))


def test_an_overflowing_projection_names_the_step() -> None:
    x = np.array([[1.7e308, 1.7e308], [1.0, 1.0]])
    w = np.eye(2) * 0.8 + 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"Q = x·W_q overflowed float64.*Hint: rescale"):
            qkv.self_attention(x, w, w, w)


# -- issue 12, leftover: a −inf bias on some keys of a live row is a mask -----------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("backend", ["tiled", "auto", "sdpa"])
def test_nan_value_behind_a_neg_inf_bias_never_reaches_the_output(
    dtype: torch.dtype, with_mask: bool, backend: str
) -> None:
    """Keys 3 and 20 carry a −inf bias in every row (the rows stay live), and their values
    hold NaN and inf: the reference gives those keys weight exactly 0, so the output and the
    gradients stay finite ("NaN or ±inf in a masked-out position never reaches the output").
    The tiled kernel used to give them the floor's tiny weight, so 2⁻⁸⁰ · NaN came out."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen, dtype=dtype) for _ in range(3))
    bias = torch.zeros(40, 40, dtype=dtype)
    bias[:, 3] = -math.inf
    bias[:, 20] = -math.inf
    v[0, :, 3] = math.nan
    v[0, 1, 20, 0] = math.inf
    mask = masks.causal() if with_mask else None
    weight = torch.randn(1, 2, 40, 8, generator=gen, dtype=dtype)
    expected, expected_grads = _grads([q, k, v], "reference", weight, mask=mask, bias=bias)
    assert bool(torch.isfinite(expected).all())
    if backend == "sdpa":  # forward only (sdpa refuses nothing here, but keep autograd out)
        with torch.no_grad():
            _close(_attend(q, k, v, backend, mask=mask, bias=bias), expected, "sdpa: output")
        return
    out, grads = _grads([q, k, v], backend, weight, mask=mask, bias=bias)
    _close(out, expected, f"{backend}: output")
    for name, got, want in zip("QKV", grads, expected_grads, strict=True):
        assert got is not None and want is not None
        _close(got, want, f"{backend}: d{name}")


@pytest.mark.parametrize("block", [8, 64])
def test_tiled_kernel_gives_neg_inf_bias_keys_weight_zero_with_a_score_mod(block: int) -> None:
    """The same through a score modifier that returns −inf for some keys, and through the
    kernel's own entry with several blocks: the result equals the reference's."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 1, 24, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    v[0, 0, 5] = math.nan

    def hide_five(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return torch.where(j == 5, -math.inf, s)

    expected = qkv.scaled_dot_product_attention(q, k, v, score_mod=hide_five, backend="reference")
    assert bool(torch.isfinite(expected).all())
    out = tiled_attention(q, k, v, score_mod=hide_five, block_q=block, block_kv=block)
    _close(out, expected, "tiled: output")
