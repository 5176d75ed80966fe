"""qkv on a CUDA GPU (issue 19): compiled FlexAttention for mask rules and score modifiers,
SDPA for dense, causal and boolean masks, the tiled kernel as a fallback, traces recorded on
the CPU. Every result is compared with the float64 reference on the CPU, forward and
backward (dQ, dK, dV, and the sinks and captured tensors where they learn), in float32,
bfloat16 and float16, with GQA (H = 4, Hkv = 2). The bounds are derived, case by case, from
the errors the reference itself makes in float32 and in the dtype (:func:`_bound`).

Needs a CUDA device; skipped elsewhere (tests/cuda/conftest.py). Run:
``pytest -m cuda tests/cuda``. Each new rule, dtype and shape compiles FlexAttention once
(seconds each): the whole file takes minutes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels._flex_masks import BLOCK_MASKS
from tests.support.flex_cases import HEADS, inputs, mask_cases, score_cases

pytestmark = pytest.mark.cuda

CUDA = "cuda"
DIM = 64
L = 300  # ragged against the 128-blocks
LQ, LK = 130, 300

EPS = {dtype: torch.finfo(dtype).eps for dtype in (torch.float32, torch.float16, torch.bfloat16)}
DTYPES = list(EPS)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max(1, max |want|), in float64 on the CPU."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got64 - want64).abs().max()) / max(1.0, float(want64.abs().max()))


def _bound(dtype: torch.dtype, own32: float, own: float) -> float:
    """How far a kernel in ``dtype`` may be from the float64 reference, from the errors the
    reference itself makes on the same (rounded) inputs: ``own32`` computed in float32,
    ``own`` with inputs in ``dtype`` (float32 arithmetic, the result rounded to ``dtype``).

    float32, as the CPU tests (tests/kernels/test_tiled.py): 8 × own32 + 64 ulps. Half
    precision: the float32 error scaled to the dtype's unit roundoff (the same arithmetic
    with its products fed operands rounded to ``dtype``, as FlexAttention rounds the weights
    and dS before the matrix products), plus twice the rounding of the result. torch's SDPA
    on the CPU, in float16 and bfloat16, stays within a third of it on these cases. The
    inputs are rounded to the dtype first on both sides, so the bounds measure the
    arithmetic, not the inputs.
    """
    if dtype == torch.float32:
        return 8 * own32 + 64 * EPS[torch.float32]
    return own32 * EPS[dtype] / EPS[torch.float32] + 2 * own


def _close(got: torch.Tensor, want: torch.Tensor, bound: float, name: str) -> None:
    assert got.shape == want.shape, name
    assert bool(torch.isfinite(got.cpu()).all() == torch.isfinite(want.cpu()).all()), name
    error = _error(got, want)
    assert error <= bound, f"{name}: {error:.3g} > {bound:.3g}"


def _run(
    backend: Any,
    dtype: torch.dtype,
    q_len: int,
    kv_len: int,
    options: dict[str, Any],
    *,
    learn: tuple[str, ...] = (),
    reference_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and gradients (dQ, dK, dV, then of ``learn``'s tensors in options) on CUDA in
    ``dtype`` (backend), or of the reference on the CPU in ``reference_dtype``
    (``"reference"``); the inputs are rounded to ``dtype`` in both."""
    reference = backend == "reference"
    device, run_dtype = ("cpu", reference_dtype) if reference else (CUDA, dtype)
    q, k, v = inputs(q_len, kv_len, dtype=dtype, dim=DIM)  # rounded to dtype on both sides
    q, k, v = (x.to(device=device, dtype=run_dtype).requires_grad_() for x in (q, k, v))
    moved: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(device=device, dtype=run_dtype).requires_grad_(name in learn)
        elif isinstance(value, torch.Tensor):  # a boolean mask array
            value = value.to(device)
        moved[name] = value
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, **moved)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [q, k, v, *(moved[name] for name in learn)]
    grads = torch.autograd.grad((out * grad.to(out)).sum(), leaves)
    return out, list(grads)


def _parity(
    backend: Any,
    dtype: torch.dtype,
    q_len: int,
    kv_len: int,
    options: dict[str, Any],
    name: str,
    learn: tuple[str, ...] = (),
) -> None:
    out, grads = _run(backend, dtype, q_len, kv_len, options, learn=learn)
    assert out.device.type == CUDA and out.dtype == dtype
    references = []  # the reference in float64, in float32, and with inputs in dtype
    for reference_dtype in (torch.float64, torch.float32, dtype):
        want, want_grads = _run(
            "reference", dtype, q_len, kv_len, options, learn=learn, reference_dtype=reference_dtype
        )
        references.append([want, *want_grads])
    labels = ["output", "dQ", "dK", "dV", *(f"d{n}" for n in learn)]
    results = zip(labels, [out, *grads], *references, strict=True)
    for label, got, want, want32, want_dtype in results:
        bound = _bound(dtype, _error(want32, want), _error(want_dtype, want))
        _close(got, want, bound, f"{name} {label} ({dtype})")


def _pairs(q_len: int, kv_len: int) -> list[tuple[str, masks.Mask, Any]]:
    """Every mask rule, each with one of the score modifiers in turn (fewer compilations)."""
    modifiers = itertools.cycle([None, *score_cases().items()])
    out = []
    for name, rule in mask_cases(q_len, kv_len).items():
        modifier = next(modifiers)
        label = name if modifier is None else f"{name}+{modifier[0]}"
        out.append((label, rule, None if modifier is None else modifier[1]))
    return out


# -- FlexAttention: every rule and modifier, three dtypes, forward and backward ------------------


# one test per rule, so that pytest -n spreads their compilations over the cores
RULE_CASES = [
    pytest.param(q_len, kv_len, index, id=f"{shape}-{label}")
    for (q_len, kv_len, shape) in ((L, L, "square"), (LQ, LK, "Lq<Lk"))
    for index, (label, _, _) in enumerate(_pairs(q_len, kv_len))
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("q_len", "kv_len", "index"), RULE_CASES)
def test_flex_matches_the_float64_reference_for_every_rule(
    dtype: torch.dtype, q_len: int, kv_len: int, index: int
) -> None:
    name, rule, modifier = _pairs(q_len, kv_len)[index]
    _parity("flex", dtype, q_len, kv_len, {"mask": rule, "score_mod": modifier}, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(score_cases()))
def test_flex_matches_the_reference_for_every_modifier_alone(dtype: torch.dtype, name: str) -> None:
    _parity("flex", dtype, LQ, LK, {"score_mod": score_cases()[name]}, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_sends_rules_to_flex_and_matches_the_reference(dtype: torch.dtype) -> None:
    q, k, v = (x.to(CUDA) for x in inputs(L, L, dtype=dtype, dim=DIM))
    for name in ("window", "documents-causal", "key-padding"):
        rule = mask_cases(L, L)[name]
        report = qkv.explain_dispatch(q, k, v, mask=rule, enable_gqa=True)
        assert report.backend == "flex", str(report)
        _parity("auto", dtype, L, L, {"mask": rule}, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sinks_through_flexs_log_sum_exp_forward_and_backward(dtype: torch.dtype) -> None:
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0])
    rule = masks.sliding_window(40) & ~masks.key_padding([0, 5])  # rows with no key at all
    options = {"mask": rule, "sinks": sinks}
    _parity("flex", dtype, L, L, options, "sinks", learn=("sinks",))


def test_a_learnable_score_modifier_learns_through_flex_when_asked() -> None:
    """Captured tensors that require grad: auto keeps them on the tiled kernel; asked for,
    flex computes their gradient (torch's own, by atomic adds)."""
    table = torch.linspace(-1.0, 1.0, 2 * 32 + 1).repeat(HEADS, 1)  # (H, 2·R + 1)

    def run(backend: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = "cpu" if backend == "reference" else CUDA
        learned = table.to(device=device, dtype=torch.float32).requires_grad_()

        def relative(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
            return score + learned[h, (kv - q).clamp(-32, 32) + 32].to(score.dtype)

        q, k, v = (x.to(device=device, dtype=dtype) for x in inputs(L, L, dim=DIM))
        if backend == "auto":
            report = qkv.explain_dispatch(
                q.requires_grad_(), k, v, score_mod=relative, is_causal=True, enable_gqa=True
            )
            assert report.backend == "tiled", str(report)
            assert "gradient" in str(dict(report.reasons)["flex"]), str(report)
        out = qkv.scaled_dot_product_attention(
            q, k, v, score_mod=relative, is_causal=True, enable_gqa=True, backend=backend
        )
        (grad,) = torch.autograd.grad(out.float().square().sum(), [learned])
        return out, grad

    want, want_grad = run("reference", torch.float64)
    want32, want32_grad = run("reference", torch.float32)
    for backend in ("flex", "auto"):
        out, grad = run(backend, torch.float32)
        bound = _bound(torch.float32, _error(want32, want), 0.0)
        _close(out, want, bound, f"{backend} output")
        bound = _bound(torch.float32, _error(want32_grad, want_grad), 0.0)
        _close(grad, want_grad, bound, f"{backend} d(table)")


# -- SDPA for dense, causal and boolean masks; the tiled kernel still works ----------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_causal_and_boolean_masks_go_to_sdpa_which_names_its_kernel(
    dtype: torch.dtype,
) -> None:
    q, k, v = (x.to(CUDA) for x in inputs(L, L, dtype=dtype, dim=DIM))
    boolean = (torch.rand(L, L, generator=torch.Generator().manual_seed(3)) > 0.3).to(CUDA)
    for name, options in (
        ("dense", {}),
        ("causal", {"is_causal": True}),
        ("boolean", {"mask": boolean}),
    ):
        report = qkv.explain_dispatch(q, k, v, enable_gqa=True, **options)
        assert report.backend == "sdpa", str(report)
        assert report.sdpa_kernel in ("flash", "memory-efficient", "cuDNN", "math"), str(report)
        if dtype != torch.float32 and name != "boolean":  # fused kernels for half types
            assert report.sdpa_kernel in ("flash", "cuDNN"), str(report)
        _parity("auto", dtype, L, L, options, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_tiled_kernel_still_runs_on_cuda(dtype: torch.dtype) -> None:
    rule = masks.document([0] * 100 + [1] * 200) & masks.causal()
    _parity("tiled", dtype, L, L, {"mask": rule, "score_mod": masks.softcap(6.0)}, "tiled")


# -- traces: the selected rows, recorded on the CPU ----------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_a_trace_of_selected_rows_on_cuda_is_recorded_on_the_cpu(backend: Any) -> None:
    rule = masks.sliding_window(50)
    q, k, v = inputs(L, L, dim=DIM)
    with qkv.tracing(heads=[1, 3], queries=[0, 77, L - 1]) as trace:
        qkv.scaled_dot_product_attention(
            q.to(CUDA), k.to(CUDA), v.to(CUDA), mask=rule, enable_gqa=True, backend=backend
        )
    with qkv.tracing(heads=[1, 3], queries=[0, 77, L - 1]) as want:
        qkv.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), mask=rule, enable_gqa=True, backend="reference"
        )
    for name in ("weights", "context"):
        got, expected = trace[name].value, want[name].value
        assert isinstance(got, np.ndarray), f"{name} is not on the CPU: {type(got)}"
        np.testing.assert_allclose(got, expected, atol=5e-5, rtol=0, err_msg=name)


# -- qkv.flex_attention on CUDA: qkv rules and modifiers, the block-mask cache -----------------


def test_qkv_flex_attention_on_cuda_takes_qkv_rules_and_caches_their_block_masks() -> None:
    q, k, v = (x.to(CUDA) for x in inputs(L, L, dim=DIM))
    rule = masks.document([0] * 120 + [1] * 180) & masks.causal()
    alibi: Callable[..., Any] = masks.alibi(HEADS)
    BLOCK_MASKS.clear()
    for _ in range(3):
        out, lse = qkv.flex_attention(
            q, k, v, block_mask=rule, score_mod=alibi, enable_gqa=True, return_lse=True
        )
    assert (BLOCK_MASKS.misses, BLOCK_MASKS.hits) == (1, 2)
    want, want32 = (
        qkv.scaled_dot_product_attention(
            q.to("cpu", dtype),
            k.to("cpu", dtype),
            v.to("cpu", dtype),
            mask=rule,
            score_mod=alibi,
            enable_gqa=True,
            backend="reference",
        )
        for dtype in (torch.float64, torch.float32)
    )
    _close(out, want, _bound(torch.float32, _error(want32, want), 0.0), "flex_attention")
    assert lse.shape == (q.shape[0], HEADS, L) and lse.dtype == torch.float32
