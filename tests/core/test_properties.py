"""Properties of attention that hold for every input (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from tests.support.strategies import Case, cases, fully_masked_rows

TOL = 1e-12
SETTINGS = settings(max_examples=60, deadline=None)


def run(case: Case, **overrides: object) -> tuple[np.ndarray, np.ndarray]:
    kwargs: dict[str, object] = {
        "mask": case.mask,
        "bias": case.bias,
        "is_causal": case.is_causal,
        "causal_alignment": case.alignment,
        "scale": case.scale,
        "enable_gqa": case.gqa,
        "return_weights": True,
    }
    kwargs.update(overrides)
    query = kwargs.pop("query", case.query)
    key = kwargs.pop("key", case.key)
    value = kwargs.pop("value", case.value)
    context, weights = qkv.scaled_dot_product_attention(query, key, value, **kwargs)  # type: ignore[arg-type]
    return context, weights


@SETTINGS
@given(cases())
def test_weight_rows_sum_to_one_or_zero_when_fully_masked(case: Case) -> None:
    _, weights = run(case)
    sums = weights.sum(axis=-1)
    empty = fully_masked_rows(case)
    np.testing.assert_allclose(sums[~empty], 1.0, atol=TOL)
    assert (weights >= 0).all() and (sums[empty] == 0).all()


@SETTINGS
@given(cases(allow_causal=False), st.randoms(use_true_random=False))
def test_permuting_keys_and_values_together_changes_nothing(case: Case, random: object) -> None:
    lk = case.key.shape[-2]
    perm = np.arange(lk)
    random.shuffle(perm)  # type: ignore[attr-defined]

    def permute_keys(a: np.ndarray | None) -> np.ndarray | None:
        return a if a is None or a.shape[-1] == 1 else a[..., perm]

    expected, _ = run(case)
    got, _ = run(
        case,
        key=case.key[..., perm, :],
        value=case.value[..., perm, :],
        mask=permute_keys(case.mask),
        bias=permute_keys(case.bias),
    )
    np.testing.assert_allclose(got, expected, atol=TOL)


@SETTINGS
@given(cases(allow_causal=False, allow_mask=False, allow_bias=False))
def test_permuting_queries_permutes_the_context_vectors(case: Case) -> None:
    perm = np.arange(case.query.shape[-2])[::-1]
    expected, _ = run(case)
    got, _ = run(case, query=case.query[..., perm, :])
    np.testing.assert_allclose(got, expected[..., perm, :], atol=TOL)


@SETTINGS
@given(cases(allow_bias=False), st.floats(-50, 50))
def test_adding_a_constant_to_a_score_row_changes_nothing(case: Case, constant: float) -> None:
    rows = np.linspace(0, constant, case.query.shape[-2])[:, None]  # (Lq, 1): one per row
    expected, _ = run(case)
    got, _ = run(case, bias=rows)
    np.testing.assert_allclose(got, expected, atol=1e-10)


@SETTINGS
@given(cases(allow_gqa=False))
def test_grouped_query_attention_equals_repeated_keys_and_values(case: Case) -> None:
    group = 2
    query = np.repeat(case.query, group, axis=1)  # H = 2 · Hkv
    scores_mask = case.mask
    if scores_mask is not None and scores_mask.ndim == 4 and scores_mask.shape[1] > 1:
        scores_mask = np.repeat(scores_mask, group, axis=1)
    bias = case.bias
    if bias is not None and bias.ndim == 4:
        bias = np.repeat(bias, group, axis=1)
    gqa, _ = run(case, query=query, mask=scores_mask, bias=bias, enable_gqa=True)
    repeated, _ = run(
        case,
        query=query,
        key=np.repeat(case.key, group, axis=1),
        value=np.repeat(case.value, group, axis=1),
        mask=scores_mask,
        bias=bias,
    )
    np.testing.assert_allclose(gqa, repeated, atol=0)


@SETTINGS
@given(cases(allow_causal=False, allow_mask=False), st.data())
def test_masking_a_key_out_equals_removing_it(case: Case, data: st.DataObject) -> None:
    lk = case.key.shape[-2]
    if lk < 2:
        return
    drop = data.draw(st.integers(0, lk - 1))
    keep = np.arange(lk) != drop
    bias = case.bias
    masked, _ = run(case, mask=keep)  # True = may attend
    removed, _ = run(
        case,
        key=case.key[..., keep, :],
        value=case.value[..., keep, :],
        bias=None if bias is None else bias[..., keep],
    )
    np.testing.assert_allclose(masked, removed, atol=TOL)


@SETTINGS
@given(st.integers(1, 9), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_kv_cache_decoding_equals_the_full_causal_pass(length: int, chunk: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(1, 2, length, 3)) for _ in range(3))
    full = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        # the new queries are the last positions: the cache holds every key up to `stop`
        step = qkv.scaled_dot_product_attention(
            q[..., start:stop, :],
            k[..., :stop, :],
            v[..., :stop, :],
            is_causal=True,
            causal_alignment="bottom-right",
        )
        np.testing.assert_allclose(step, full[..., start:stop, :], atol=TOL)


@pytest.mark.parametrize("alignment", ["top-left", "bottom-right"])
def test_causal_output_depends_only_on_earlier_inputs(alignment: str) -> None:
    """The gradient of output i is non-zero exactly for inputs at positions ≤ i."""
    torch.manual_seed(0)
    lq, lk = (5, 5) if alignment == "top-left" else (3, 6)
    q = torch.randn(lq, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(lk, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(lk, 4, dtype=torch.float64, requires_grad=True)
    offset = lk - lq if alignment == "bottom-right" else 0
    out = qkv.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        causal_alignment=alignment,  # type: ignore[arg-type]
    )
    for i in range(lq):
        dq, dk, dv = torch.autograd.grad(out[i].sum(), (q, k, v), retain_graph=True)
        reaches = dk.abs().sum(-1) + dv.abs().sum(-1) > 0
        assert reaches.tolist() == [j <= i + offset for j in range(lk)]
        # other queries never matter (query 0 alone with one key has gradient 0 too)
        assert all(dq[j].abs().sum() == 0 for j in range(lq) if j != i)
