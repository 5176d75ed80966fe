"""Backends and the dispatcher: every backend equals the reference on the calls it accepts;
auto picks the backend the policy says, and explains why."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import qkv
from qkv import masks
from qkv.attention import _backend
from tests.support.backends import accepts, backend_names
from tests.support.strategies import Case, cases

TOL = 1e-12  # float64: the backends differ from the reference by rounding only


pytestmark = pytest.mark.usefixtures("one_torch_thread")


SETTINGS = settings(max_examples=40, deadline=None)


def options(case: Case) -> dict[str, Any]:
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return {
        "mask": as_tensor(case.mask),
        "bias": as_tensor(case.bias),
        "is_causal": case.is_causal,
        "causal_alignment": case.alignment,
        "scale": case.scale,
        "enable_gqa": case.gqa,
    }


def tensors(case: Case) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(a) for a in (case.query, case.key, case.value))


@SETTINGS
@given(cases(), st.sampled_from(backend_names(reference=False)))
def test_every_backend_equals_the_reference_on_what_it_accepts(case: Case, backend: str) -> None:
    q, k, v = tensors(case)
    assume(accepts(backend, q, k, v, **options(case)))
    expected = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **options(case))
    got = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **options(case))
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=TOL)


@SETTINGS
@given(cases(allow_mask=False, allow_bias=False))
def test_auto_equals_the_reference_with_structured_masks(case: Case) -> None:
    q, k, v = tensors(case)
    lq, lk = q.shape[-2], k.shape[-2]
    rule = masks.sliding_window(2, 1, alignment=case.alignment) | masks.key_padding(  # type: ignore[arg-type]
        [max(lk - 2, 0)] * q.shape[0]
    )
    kwargs = options(case) | {"mask": rule}
    expected = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kwargs)
    for backend in backend_names(reference=False, auto=True):
        if not accepts(backend, q, k, v, **kwargs):
            continue
        got = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=TOL)
    assert lq >= 1


def test_auto_choices_follow_the_policy() -> None:
    small = torch.randn(1, 2, 16, 8)
    long = torch.randn(1, 1, 4096, 8)

    def chosen(*args: Any, **kwargs: Any) -> str:
        return qkv.explain_dispatch(*args, **kwargs).backend

    assert chosen(np.ones((3, 4)), np.ones((3, 4)), np.ones((3, 4))) == "reference"
    assert chosen(small, small, small) == "sdpa"
    assert chosen(small, small, small, is_causal=True) == "sdpa"
    assert chosen(small, small, small, mask=masks.causal()) == "sdpa"  # a small dense mask
    assert chosen(long, long, long, mask=masks.sliding_window(64)) == "tiled"
    assert chosen(long, long, long, is_causal=True, causal_alignment="bottom-right") == "sdpa"
    assert chosen(small, small, small, dropout_p=0.1) == "tiled"
    assert chosen(small, small, small, score_mod=masks.softcap(5.0)) == "tiled"
    assert chosen(small, small, small, return_weights=True) == "reference"
    with qkv.tracing():
        assert chosen(small, small, small) == "reference"


def test_explain_names_every_backend_and_fits_80_columns() -> None:
    long = torch.randn(1, 1, 4096, 8)
    report = qkv.explain_dispatch(long, long, long, mask=masks.sliding_window(64))
    text = str(report)
    assert text.splitlines()[0] == "backend: tiled (asked: auto)"
    assert all(len(line) <= 80 for line in text.splitlines())
    reasons = dict(report.reasons)
    assert list(reasons) == list(qkv.attention.BACKENDS)
    assert "dense mask" in reasons["sdpa"] and "refused" in reasons["sdpa"]


def test_a_backend_that_cannot_run_the_call_says_why() -> None:
    q = np.ones((3, 4))
    with pytest.raises(ValueError, match=r"backend='tiled' cannot run this call: needs PyTorch"):
        qkv.scaled_dot_product_attention(q, q, q, backend="tiled")
    t = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run this call: dropout"):
        qkv.scaled_dot_product_attention(t, t, t, dropout_p=0.5, backend="sdpa")
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run this call: weights"):
        qkv.scaled_dot_product_attention(t, t, t, return_weights=True, backend="sdpa")
    with pytest.raises(ValueError, match=r"backend must be 'auto' or one of .*got 'flash'"):
        qkv.scaled_dot_product_attention(t, t, t, backend="flash")
    with pytest.raises(TypeError, match=r"score_mod must be a qkv.masks.ScoreMod"):
        qkv.scaled_dot_product_attention(t, t, t, score_mod=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", backend_names())
def test_fully_masked_rows_and_masked_nan_on_every_backend(backend: str) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.normal(size=(1, 2, 4, 3))) for _ in range(3))
    k[0, 0, 3] = torch.nan
    v[0, 0, 3] = torch.inf
    v[0, 1, 2] = torch.nan
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[1] = False  # query 1 sees nothing
    allowed[:, 3] = False  # key 3 (NaN key, inf value) is never seen
    allowed[:, 2] = False
    out = qkv.scaled_dot_product_attention(q, k, v, mask=allowed, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[:, :, 1] == 0).all()
    expected = qkv.scaled_dot_product_attention(
        q, k[..., :2, :], v[..., :2, :], backend="reference"
    )
    torch.testing.assert_close(out[:, :, [0, 2, 3]], expected[:, :, [0, 2, 3]])


def test_dropout_is_the_same_on_the_reference_and_the_tiled_kernel() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (torch.from_numpy(rng.normal(size=(2, 3, 9, 4))) for _ in range(3))
    kwargs: dict[str, Any] = {"dropout_p": 0.3, "is_causal": True}
    for generator in (5, torch.Generator().manual_seed(5)):
        expected = qkv.scaled_dot_product_attention(
            q, k, v, generator=generator, backend="reference", **kwargs
        )
        generator = 5 if isinstance(generator, int) else torch.Generator().manual_seed(5)
        got = qkv.scaled_dot_product_attention(
            q, k, v, generator=generator, backend="tiled", **kwargs
        )
        torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
    other = qkv.scaled_dot_product_attention(q, k, v, generator=6, backend="tiled", **kwargs)
    assert not torch.allclose(other, expected)


def test_heads_and_self_attention_take_a_backend() -> None:
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.normal(size=(2, 6, 8)))
    W_q, W_k, W_v, W_o = (
        torch.from_numpy(rng.normal(size=s)) for s in ((8, 8), (8, 4), (8, 4), (8, 8))
    )
    expected = qkv.multi_head_attention(
        x, W_q, W_k, W_v, W_o, num_heads=4, num_kv_heads=2, is_causal=True, backend="reference"
    )
    for backend in backend_names(reference=False, auto=True):
        got = qkv.multi_head_attention(
            x,
            W_q,
            W_k,
            W_v,
            W_o,
            num_heads=4,
            num_kv_heads=2,
            is_causal=True,
            backend=backend,
        )
        torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
    single = qkv.self_attention(x, W_q, W_q, W_v, backend="tiled")
    torch.testing.assert_close(single, qkv.self_attention(x, W_q, W_q, W_v), rtol=0, atol=TOL)


def test_a_long_trace_records_the_selected_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "available_memory", lambda like: 200_000)
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(rng.normal(size=(1, 2, 64, 4))) for _ in range(3))
    full = qkv.attention.reference_attention(q, k, v, is_causal=True, return_weights=True)
    with pytest.warns(UserWarning, match=r"recording \d+ query rows"), qkv.tracing() as t:
        out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, full[0])
    step = t["weights"]
    assert step.index is not None
    rows = step.index["query"]
    assert len(rows) < 64 and rows[-1] == 63
    np.testing.assert_allclose(step.value, full[1].numpy()[:, :, rows], atol=TOL)
    assert t["context"].shape == (1, 2, 64, 4) and "partial" in t.meta


def test_a_trace_with_chosen_rows_matches_the_full_trace() -> None:
    rng = np.random.default_rng(4)
    q, k, v = (torch.from_numpy(rng.normal(size=(1, 4, 10, 3))) for _ in range(3))
    full = qkv.Trace()
    qkv.scaled_dot_product_attention(q, k, v, is_causal=True, trace=full)
    with qkv.tracing(heads=[1, 3], queries=[0, -1]) as t:
        qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled")
    assert t["weights"].index == {"query": [0, 9], "head": [1, 3]}
    np.testing.assert_allclose(
        t["weights"].value, full["weights"].value[:, [1, 3]][:, :, [0, 9]], atol=TOL
    )
    np.testing.assert_allclose(t["context"].value, full["context"].value[:, [1, 3]][:, :, [0, 9]])
    assert re.search("softmax", t["weights"].formula)


def test_weights_that_would_not_fit_fail_with_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "available_memory", lambda like: 10_000)
    q = torch.ones(1, 2, 64, 4)
    with pytest.raises(MemoryError, match=r"return_weights=True: the weights would form"):
        qkv.scaled_dot_product_attention(q, q, q, return_weights=True)
    assert qkv.explain_dispatch(q, q, q).backend == "sdpa"  # no weights: a fast backend
    reasons = dict(qkv.explain_dispatch(q, q, q, backend="tiled").reasons)
    assert reasons["reference"].startswith("refused: would form (Lq, Lk) matrices")


def test_explain_dispatch_draws_no_random_numbers() -> None:
    generator = torch.Generator().manual_seed(0)
    q = torch.ones(1, 1, 4, 2)
    qkv.explain_dispatch(q, q, q, dropout_p=0.5, generator=generator)
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())


def test_explain_verbose_in_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from qkv.cli import main

    assert main(["explain", "--verbose", "--example", "two-heads"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("backend: reference (asked: auto)") and "NumPy inputs" in err


@pytest.mark.parametrize(
    ("length", "rule", "backend"),
    [
        (512, "window", "sdpa"),  # SDPA with the dense mask is faster at this size
        (1024, "window", "tiled"),  # half the blocks ruled out: the tiled kernel skips them
        (1024, "documents", "tiled"),
        (1024, "key padding", "sdpa"),  # a rule that skips nothing stays on SDPA
    ],
)
def test_auto_leaves_sdpa_for_a_mask_rule_that_skips_blocks_on_cpu(
    length: int, rule: str, backend: str
) -> None:
    """docs/decisions.md, "On CPU, auto leaves SDPA for a mask rule that skips blocks"."""
    q = torch.zeros(1, 2, length, 16)
    ids = np.repeat(np.arange(8), length // 8)
    made = {
        "window": masks.sliding_window(255),
        "documents": masks.document(ids) & masks.causal(),
        "key padding": masks.key_padding([length - 3]),
    }[rule]
    report = qkv.explain_dispatch(q, q, q, mask=made)
    assert report.backend == backend
    if backend == "tiled":
        assert "rules out" in dict(report.reasons)["sdpa"]
