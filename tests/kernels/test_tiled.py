"""The tiled kernel against the float64 reference: outputs and dQ/dK/dV, masks, GQA, both
alignments, bias, score modifiers, dropout; block skipping; fully masked rows and NaN."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import masks
from qkv.attention import reference_attention
from qkv.kernels import _forward, tiled_attention
from tests.support.mask_cases import draw_rule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SETTINGS = settings(max_examples=60, deadline=None)
EPS32 = float(np.finfo(np.float32).eps)


@dataclass
class TiledCase:
    q: np.ndarray  # (B, H, Lq, D)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    options: dict[str, Any]  # mask, bias, score_mod, is_causal, causal_alignment, scale
    block_q: int
    block_kv: int


def _rule(draw: st.DrawFn, b: int, lq: int, lk: int) -> masks.Mask:
    """A rule of the registry (tests/support/mask_cases.py), maybe combined."""
    rule = draw_rule(draw(st.randoms()), b, lq, lk)
    combine = draw(st.sampled_from(["", "&", "|", "~"]))
    if combine == "&":
        rule = rule & masks.sliding_window(4, 4)
    elif combine == "|":
        rule = rule | masks.causal()
    elif combine == "~":
        rule = ~rule
    return rule


@st.composite
def tiled_cases(draw: st.DrawFn, *, allow_score_mod: bool = True) -> TiledCase:
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    h = hkv * group
    lq, lk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    d, dv = draw(st.integers(1, 8)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.3, 1.0, 3.0]))
    q = rng.normal(scale=spread, size=(b, h, lq, d))
    k = rng.normal(scale=spread, size=(b, hkv, lk, d))
    v = rng.normal(size=(b, hkv, lk, dv))
    options: dict[str, Any] = {
        "is_causal": draw(st.booleans()),
        "causal_alignment": draw(st.sampled_from(["top-left", "bottom-right"])),
        "scale": draw(st.one_of(st.none(), st.floats(0.1, 2.0))),
    }
    mask_kind = draw(st.sampled_from(["none", "dense", "rule"]))
    if mask_kind == "dense":
        shape = draw(st.sampled_from([(b, 1, lq, lk), (lq, lk), (b, h, lq, lk)]))
        options["mask"] = torch.from_numpy(rng.random(shape) < 0.7)
    elif mask_kind == "rule":
        options["mask"] = _rule(draw, b, lq, lk)
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(lq, lk), (b, h, lq, lk), (1, h, 1, lk)]))
        options["bias"] = rng.normal(size=shape)
    if allow_score_mod:
        options["score_mod"] = draw(
            st.sampled_from(
                [None, masks.softcap(2.0), masks.alibi(h), masks.alibi(h).then(masks.softcap(5.0))]
            )
        )
    return TiledCase(q, k, v, options, draw(st.integers(2, 9)), draw(st.integers(2, 9)))


def _tensors(case: TiledCase, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(a, dtype=dtype, requires_grad=True) for a in (case.q, case.k, case.v))


def _options(case: TiledCase, dtype: torch.dtype) -> dict[str, Any]:
    options = dict(case.options)
    if options.get("bias") is not None:
        options["bias"] = torch.tensor(options["bias"], dtype=dtype)
    return options


def _forward_backward(run: Any, case: TiledCase, dtype: torch.dtype) -> list[np.ndarray]:
    """Output and the gradients of a fixed random function of it, as float64 arrays."""
    q, k, v = _tensors(case, dtype)
    out = run(q, k, v, **_options(case, dtype))
    weights = torch.from_numpy(np.random.default_rng(0).normal(size=tuple(out.shape))).to(dtype)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    return [x.detach().double().numpy() for x in (out, *grads)]


def _reference(q: Any, k: Any, v: Any, **options: Any) -> Any:
    return reference_attention(q, k, v, enable_gqa=True, **options)


@SETTINGS
@given(tiled_cases())
def test_tiled_equals_the_reference_in_float32_within_the_references_own_error(
    case: TiledCase,
) -> None:
    def tiled(q: Any, k: Any, v: Any, **options: Any) -> Any:
        return tiled_attention(q, k, v, block_q=case.block_q, block_kv=case.block_kv, **options)

    exact = _forward_backward(_reference, case, torch.float64)
    reference32 = _forward_backward(_reference, case, torch.float32)
    got = _forward_backward(tiled, case, torch.float32)
    for name, e, r, g in zip(("out", "dq", "dk", "dv"), exact, reference32, got, strict=True):
        own_error = float(np.abs(r - e).max(initial=0.0))  # the reference's float32 error
        size = float(np.abs(e).max(initial=0.0))
        tolerance = 8 * own_error + 64 * EPS32 * max(size, 1.0)
        np.testing.assert_allclose(g, e, rtol=0, atol=tolerance, err_msg=name)


@SETTINGS
@given(tiled_cases())
def test_tiled_equals_the_reference_in_float64(case: TiledCase) -> None:
    def tiled(q: Any, k: Any, v: Any, **options: Any) -> Any:
        return tiled_attention(q, k, v, block_q=case.block_q, block_kv=case.block_kv, **options)

    exact = _forward_backward(_reference, case, torch.float64)
    got = _forward_backward(tiled, case, torch.float64)
    for name, e, g in zip(("out", "dq", "dk", "dv"), exact, got, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-11, err_msg=name)


@settings(max_examples=30, deadline=None)
@given(tiled_cases())
def test_the_running_max_alone_equals_the_reference(case: TiledCase) -> None:
    """The forward pass keeps the shift at 0 and falls back to the running max only for
    rows far from 0; taking the fallback for every row changes nothing."""

    def tiled(q: Any, k: Any, v: Any, **options: Any) -> Any:
        return tiled_attention(q, k, v, block_q=case.block_q, block_kv=case.block_kv, **options)

    exact = _forward_backward(_reference, case, torch.float64)
    with mock.patch.object(_forward, "_MOST", -1.0):  # no sum is ever small enough
        got = _forward_backward(tiled, case, torch.float64)
    for name, e, g in zip(("out", "dq", "dk", "dv"), exact, got, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [-400.0, -90.0, -30.0, 0.0, 30.0, 70.0, 400.0])
def test_scores_far_from_zero_give_the_same_weights(offset: float, dtype: torch.dtype) -> None:
    """exp(score) alone would overflow or underflow far from 0 (beyond about ±40): such
    rows take the running max, and the result is softmax's, which ignores the offset."""
    rng = np.random.default_rng(3)
    q, k, v = (torch.tensor(rng.normal(size=(1, 2, 40, 4))) for _ in "qkv")
    bias = torch.tensor(rng.normal(size=(40, 40)) + offset)
    bias[:, 1::3] = -1e4  # a mask made of a bias: far below every other score
    scores = (q @ k.transpose(-1, -2)) / 2 + bias
    scores = scores.masked_fill(~masks.causal().dense(40, 40, xp=torch), -torch.inf)
    got, lse = tiled_attention(
        *(x.to(dtype) for x in (q, k, v)),
        bias=bias.to(dtype),
        is_causal=True,
        return_lse=True,
        block_q=8,
        block_kv=8,
    )
    # float32 rounds each score to about 6e-8 of its size: that much error in every weight
    tolerance = 1e-11 if dtype == torch.float64 else 64 * EPS32 * (1 + abs(offset))
    torch.testing.assert_close(got.double(), torch.softmax(scores, -1) @ v, rtol=0, atol=tolerance)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=tolerance)


@pytest.mark.parametrize("block", [16, None])
def test_a_row_with_one_allowed_key_gets_its_value_to_the_bit(block: int | None) -> None:
    """A query that may attend one key only (every row of sliding_window(0), the first row
    under a causal mask) has weight exactly 1 there, and the reference's output is that
    key's value itself. With the shift held at 0 the kernel gave exp(s)·v / exp(s), which
    misses v in about one entry of ten; with the row's score as its shift it is exact."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 80, 8, generator=g) * 3 for _ in "qkv")
    window = tiled_attention(q, k, v, mask=masks.sliding_window(0), block_q=block, block_kv=block)
    assert torch.equal(window, v)
    causal = tiled_attention(q, k, v, is_causal=True, block_q=block, block_kv=block)
    assert torch.equal(causal[:, :, 0], v[:, :, 0])


def test_rows_of_equal_scores_under_a_mask_are_exact_as_in_the_reference() -> None:
    """Equal scores under a window and a bias that is constant along each row: the weights
    of a row are equal, so with L allowed keys (a power of 2 here) each is exactly 1/L in
    the reference, the context is the exact mean of its values, and dV is exact (dQ and
    dK are 0 in exact arithmetic and rounding noise in both)."""
    q = torch.full((1, 2, 64, 4), 0.7, requires_grad=True)
    k = torch.full((1, 2, 64, 4), -1.3, requires_grad=True)
    v = torch.arange(64.0).repeat(1, 2, 4, 1).transpose(-1, -2).contiguous()
    v.requires_grad_(True)
    bias = torch.linspace(-3, 3, 64)[:, None].expand(64, 64)  # one level per row
    window = masks.sliding_window(15)  # rows from 15 on see 16 keys
    runs = []
    for run in (tiled_attention, reference_attention):
        out = run(q, k, v, mask=window, bias=bias)
        runs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    (got, _, _, got_dv), (expected, _, _, expected_dv) = runs
    assert torch.equal(got[:, :, 15:], expected[:, :, 15:])
    assert torch.equal(got_dv[:, :, 16:], expected_dv[:, :, 16:])  # keys seen by 16 rows


def test_a_column_of_ones_in_the_values_comes_out_exactly_one() -> None:
    """A column of V that is 1 at every key (the others random), under a causal mask and a
    bias: that column of the output is exactly 1, as the reference's softmax sums to 1 and
    SDPA gives it. The kernel sees the constant column and sums each row's l in the same
    products as the context; with l summed apart (the fast path of every other call) the
    division misses 1 by an ulp in some rows, which the second half checks."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g) * 2 for _ in "qkv")
    v[..., 3] = 1.0
    bias = torch.randn(300, 300, generator=g)
    out = tiled_attention(q, k, v, bias=bias, is_causal=True)
    assert torch.equal(out[..., 3], torch.ones_like(out[..., 3]))
    with mock.patch.object(_forward, "constant_column", return_value=False):
        apart = tiled_attention(q, k, v, bias=bias, is_causal=True)
    assert not torch.equal(apart[..., 3], torch.ones_like(apart[..., 3]))


def test_values_whose_weighted_sum_overflows_without_the_max_still_come_out_finite() -> None:
    q, k = (torch.randn(1, 1, 16, 4) for _ in "qk")
    v = torch.randn(1, 1, 16, 4) * 1e30
    bias = torch.full((16, 16), 30.0)  # exp(30) · 1e30 overflows float32; softmax does not
    got = tiled_attention(q, k, v, bias=bias, block_q=4, block_kv=4)
    expected = reference_attention(*(x.double() for x in (q, k, v)))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double() / 1e30, expected / 1e30, rtol=0, atol=1e-5)


@SETTINGS
@given(tiled_cases())
def test_skipping_blocks_is_bit_identical_to_computing_every_block(case: TiledCase) -> None:
    def run(skip: bool) -> Any:
        def tiled(q: Any, k: Any, v: Any, **options: Any) -> Any:
            return tiled_attention(
                q,
                k,
                v,
                block_q=case.block_q,
                block_kv=case.block_kv,
                skip_blocks=skip,
                **options,
            )

        return _forward_backward(tiled, case, torch.float32)

    for skipped, computed in zip(run(True), run(False), strict=True):
        np.testing.assert_array_equal(skipped, computed)


@settings(max_examples=25, deadline=None)
@given(tiled_cases(allow_score_mod=False), st.integers(0, 2**62))
def test_dropout_drops_what_the_reference_drops(case: TiledCase, seed: int) -> None:
    options: dict[str, Any] = {"dropout_p": 0.4, "generator": seed}

    def tiled(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        return tiled_attention(
            q, k, v, block_q=case.block_q, block_kv=case.block_kv, **kw, **options
        )

    def reference(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        return _reference(q, k, v, **kw, **options)

    for e, g in zip(
        _forward_backward(reference, case, torch.float64),
        _forward_backward(tiled, case, torch.float64),
        strict=True,
    ):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-11)


def test_gradients_reach_the_bias_and_through_the_lse() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.normal(size=(2, 2, 7, 3)), requires_grad=True) for _ in range(3))
    bias = torch.tensor(rng.normal(size=(1, 2, 7, 7)), requires_grad=True)
    out, lse = tiled_attention(
        q, k, v, bias=bias, is_causal=True, return_lse=True, block_q=3, block_kv=2
    )
    scores = (q @ k.transpose(-1, -2)) / 3**0.5 + bias
    scores = scores.masked_fill(~masks.causal().dense(7, 7, xp=torch), -torch.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    loss = out.square().sum() + lse.sum()
    expected = torch.softmax(scores, dim=-1) @ v
    expected_loss = expected.square().sum() + torch.logsumexp(scores, dim=-1).sum()
    for mine, theirs in zip(
        torch.autograd.grad(loss, (q, k, v, bias)),
        torch.autograd.grad(expected_loss, (q, k, v, bias)),
        strict=True,
    ):
        torch.testing.assert_close(mine, theirs)


def test_fully_masked_rows_give_zeros_and_masked_nan_never_reaches_the_output() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (torch.tensor(rng.normal(size=(1, 2, 6, 4)), requires_grad=True) for _ in range(3))
    with torch.no_grad():
        k[0, 0, 5] = torch.nan
        v[0, 1, 5] = torch.inf
        q[0, 0, 2] = torch.nan  # a query that attends nothing
    mask = masks.key_padding([5]) & masks.from_function(lambda b, h, i, j: i != 2, "not 2")
    out, lse = tiled_attention(q, k, v, mask=mask, return_lse=True, block_q=2, block_kv=2)
    assert torch.isfinite(out).all()
    assert (out[:, :, 2] == 0).all() and (lse[:, :, 2] == -torch.inf).all()
    expected = reference_attention(q.detach(), k.detach(), v.detach(), mask=mask)
    torch.testing.assert_close(out, expected)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq[:, :, 2] == 0).all()  # a query that attends nothing has no gradient
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dk[:, :, 5] == 0).all() and (dv[:, :, 5] == 0).all()  # nor has a padding key


def test_nan_in_a_value_reaches_only_the_queries_that_attend_it() -> None:
    q, k, v = (torch.randn(1, 1, 5, 3, dtype=torch.float64) for _ in range(3))
    v[0, 0, 3, 1] = torch.nan
    out = tiled_attention(q, k, v, is_causal=True, block_q=2, block_kv=2)
    expected = reference_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, equal_nan=True)
    assert torch.isnan(out[0, 0, 3:, 1]).all() and not torch.isnan(out[0, 0, :3]).any()


def test_half_precision_is_computed_in_float32() -> None:
    q, k, v = (torch.randn(1, 2, 33, 8).half() for _ in range(3))
    out = tiled_attention(q, k, v, is_causal=True, block_q=8, block_kv=8)
    assert out.dtype == torch.float16
    expected = reference_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query": np.ones((1, 1, 2, 2))}, r"query must be a torch.Tensor for the tiled kernel"),
        ({"query": torch.ones(2, 2)}, r"query must be a floating-point tensor of 4 dimensions"),
        ({"key": torch.ones(1, 3, 2, 2), "value": torch.ones(1, 3, 2, 2)}, r"Hkv must divide H"),
        ({"value": torch.ones(1, 2, 3, 2)}, r"shapes do not fit"),
        ({"score_mod": "softcap"}, r"score_mod must be a qkv.masks.ScoreMod"),
    ],
)
def test_bad_input_to_the_kernel(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "query": torch.ones(1, 2, 2, 2),
        "key": torch.ones(1, 2, 2, 2),
        "value": torch.ones(1, 2, 2, 2),
    }
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        tiled_attention(**args)


@pytest.mark.slow
def test_memory_at_16384_tokens_stays_far_below_the_full_matrix() -> None:
    from qkv.bench import peak_memory

    n = 16384
    q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
    full_matrix = n * n * 4  # one (Lq, Lk) float32 matrix: 1 GiB
    added, out = peak_memory(lambda: tiled_attention(q, k, v, is_causal=True))
    assert out.shape == (1, 1, n, 16)
    assert added < full_matrix / 32, f"{added / 2**20:.0f} MiB"
    torch.testing.assert_close(
        out[0, 0, :64],
        reference_attention(q[0, 0, :64], k[0, 0, :64], v[0, 0, :64], is_causal=True),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_share_the_blocks_without_changing_the_result(threads: int) -> None:
    rng = np.random.default_rng(5)
    q, k, v = (
        torch.tensor(rng.normal(size=s), requires_grad=True)
        for s in ((2, 4, 37, 8), (2, 2, 41, 8), (2, 2, 41, 5))
    )
    bias = torch.tensor(rng.normal(size=(1, 4, 37, 1)), requires_grad=True)
    kwargs: dict[str, Any] = {
        "mask": masks.causal("bottom-right") | masks.key_padding([20, 41]),
        "bias": bias,
        "dropout_p": 0.2,
        "generator": 9,
        "block_q": 5,
        "block_kv": 6,
    }
    serial = tiled_attention(q, k, v, **kwargs)
    serial_grads = torch.autograd.grad(serial.square().sum(), (q, k, v, bias))
    torch.set_num_threads(threads)
    parallel = tiled_attention(q, k, v, **kwargs)
    parallel_grads = torch.autograd.grad(parallel.square().sum(), (q, k, v, bias))
    again = torch.autograd.grad(tiled_attention(q, k, v, **kwargs).square().sum(), (q, k, v, bias))
    assert all(torch.equal(a, b) for a, b in zip(again, parallel_grads, strict=True))  # same bits
    with torch.inference_mode():
        inferred = tiled_attention(q, k, v, **kwargs)
    assert torch.get_num_threads() == threads  # the caller's setting is kept
    torch.set_num_threads(1)
    assert torch.equal(parallel, serial) and torch.equal(inferred, serial)
    for mine, theirs in zip(parallel_grads, serial_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
