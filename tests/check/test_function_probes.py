"""``qkv check --function``: the probe with a known score order, and batched inputs.

- A normalisation that is no softmax (weights out of the scores' order, or not in the ratios
  e^(s_j − s_k)) is ``not-softmax``, found on the probe whose scores are known and whose
  V is the identity (so the context rows are the weights). A softmax in another base is
  exponential in the scores, so it is not "not-softmax" (it is unrecognised).
- The probes are (L, d). A function written only for (B, H, L, d) is probed with B = H = 1;
  with ``batched=True`` (``--batched``) a function must also work on leading (B, H) axes,
  else it is ``unbatched``: the ``K.T`` of NumPy reverses every axis of a 4-D array.

Peer expectation: PyTorch's ``scaled_dot_product_attention`` takes any leading batch axes
(its documentation's shape legend, ``(N, ..., L, E)``); course exercises often ask for
(L, d) only, hence the opt-in.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qkv.check._probes import ORDER_SCORES, probes
from qkv.cli import main
from qkv.testing import FunctionError, assert_attention, check_attention


def softmax(s: Any) -> Any:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_2d(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ K.T / np.sqrt(Q.shape[-1])) @ V


def attention_nd(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])) @ V


def attention_4d_only(Q: Any, K: Any, V: Any) -> Any:
    _b, _h, _l, d = Q.shape  # refuses (L, d) inputs
    return softmax(Q @ K.transpose(0, 1, 3, 2) / np.sqrt(d)) @ V


def torch_attention_nd(Q: Any, K: Any, V: Any) -> Any:
    return torch.softmax(Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5, dim=-1) @ V


def causal_nd(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[-2], K.shape[-2]
    s = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    return softmax(np.where(np.tril(np.ones((lq, lk), dtype=bool)), s, -np.inf)) @ V


def causal_2d(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    return softmax(np.where(np.tril(np.ones((lq, lk), dtype=bool)), s, -np.inf)) @ V


def squared_normalised(Q: Any, K: Any, V: Any) -> Any:
    """Squares are positive, but not in the scores' order: no softmax."""
    s = (Q @ K.T / np.sqrt(Q.shape[-1])) ** 2
    return (s / s.sum(axis=-1, keepdims=True)) @ V


def rank_weights(Q: Any, K: Any, V: Any) -> Any:
    """Invented weights: in the scores' order, but set by rank, not by the scores."""
    s = Q @ K.T
    ranks = np.argsort(np.argsort(s, axis=-1), axis=-1) + 1.0
    return (ranks / ranks.sum(axis=-1, keepdims=True)) @ V


def base_2(Q: Any, K: Any, V: Any) -> Any:
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    e = np.exp2(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ V


def test_the_known_order_probe_has_ordered_scores_and_identity_values() -> None:
    for kind in ("attention", "causal"):
        [order] = [p for p in probes(kind, with_mask=False) if p.name == "known score order"]
        q, k, v = order.arrays
        assert np.allclose(q @ k.T / np.sqrt(q.shape[-1]), ORDER_SCORES)
        assert np.array_equal(v, np.eye(k.shape[0]))
        assert all(len(set(row)) == len(row) for row in ORDER_SCORES)  # strictly ordered


@pytest.mark.parametrize("fn", [squared_normalised, rank_weights], ids=lambda f: f.__name__)
def test_weights_that_are_no_softmax_are_named(fn: Any) -> None:
    report = check_attention(fn)
    assert [f.diagnosis for f in report.findings if f.wrong] == ["not-softmax"]
    assert "exp(s_j)" in report.findings[0].message


def test_causal_weights_that_are_no_softmax_are_named() -> None:
    def causal_relu(Q: Any, K: Any, V: Any) -> Any:
        lq, lk = Q.shape[0], K.shape[0]
        s = np.maximum(Q @ K.T / np.sqrt(Q.shape[-1]), 0.0) + 1e-9
        s = np.where(np.tril(np.ones((lq, lk), dtype=bool)), s, 0.0)
        return (s / s.sum(axis=-1, keepdims=True)) @ V

    report = check_attention(causal_relu, kind="causal")
    assert [f.diagnosis for f in report.findings if f.wrong] == ["not-softmax"]


def test_a_function_failing_every_way_says_what_was_tried() -> None:
    def broken(Q: Any, K: Any, V: Any) -> Any:
        raise RuntimeError("not written yet")

    with pytest.raises(FunctionError, match=r"raised RuntimeError: not written yet \(also tried"):
        check_attention(broken)


def test_a_softmax_in_another_base_is_not_called_not_softmax() -> None:
    report = check_attention(base_2)
    assert [f.diagnosis for f in report.findings if f.wrong] == ["unrecognised"]


@pytest.mark.parametrize(
    ("kind", "fn"),
    [("attention", attention_nd), ("attention", torch_attention_nd), ("causal", causal_nd)],
    ids=["numpy", "torch", "causal"],
)
def test_a_function_written_for_any_leading_axes_passes_the_batched_probe(
    kind: str, fn: Any
) -> None:
    report = check_attention(fn, kind=kind, batched=True)
    assert report.ok and [f for f in report.findings if f.wrong] == []
    assert_attention(fn, kind=kind, batched=True)


@pytest.mark.parametrize(
    ("kind", "fn"), [("attention", attention_2d), ("causal", causal_2d)], ids=["attn", "causal"]
)
def test_a_function_for_l_by_d_only_is_right_by_default_and_unbatched_when_asked(
    kind: str, fn: Any
) -> None:
    assert check_attention(fn, kind=kind).ok
    report = check_attention(fn, kind=kind, batched=True)
    assert not report.ok
    [finding] = [f for f in report.findings if f.wrong]
    assert finding.diagnosis == "unbatched"
    assert "K.swapaxes(-1, -2)" in finding.message and "batched" in finding.token
    with pytest.raises(AssertionError, match="unbatched"):
        assert_attention(fn, kind=kind, batched=True)


def test_a_function_for_four_axes_only_is_probed_with_b_and_h_of_one() -> None:
    report = check_attention(attention_4d_only)
    assert report.ok and report.findings == ()
    assert report.array == "numpy (1, 1, L, d)"
    assert check_attention(attention_4d_only, batched=True).ok


def test_a_slip_in_a_four_axes_function_is_still_named() -> None:
    def unscaled_4d(Q: Any, K: Any, V: Any) -> Any:
        return softmax(Q @ K.transpose(0, 1, 3, 2)) @ V

    report = check_attention(unscaled_4d)
    assert [f.diagnosis for f in report.findings if f.wrong] == ["unscaled"]


def test_cli_batched_flag_runs_the_file_in_its_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "student.py"
    path.write_text(
        textwrap.dedent(
            """
            import numpy as np

            def attention(Q, K, V):
                s = Q @ K.T / np.sqrt(Q.shape[-1])
                e = np.exp(s - s.max(axis=-1, keepdims=True))
                return e / e.sum(axis=-1, keepdims=True) @ V
            """
        ),
        encoding="utf-8",
    )
    target = f"{path}:attention"
    assert main(["check", "--function", target]) == 0
    capsys.readouterr()
    assert main(["check", "--function", target, "--batched", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False
    assert [f["diagnosis"] for f in data["findings"]] == ["unbatched"]


def test_mask_means_auto_finds_the_functions_convention() -> None:
    """Issue 35, item 2: the mask convention decided by probing, as for classes."""
    import numpy as np

    from qkv.check import check_function

    def softmax(s: Any) -> Any:
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def keep01(Q: Any, K: Any, V: Any, mask: Any) -> Any:  # 1 = may attend, as floats
        return softmax(np.where(mask == 0, -np.inf, Q @ K.T / 4.0)) @ V

    def additive(Q: Any, K: Any, V: Any, mask: Any) -> Any:
        return softmax(Q @ K.T / 4.0 + mask) @ V

    def true_masked(Q: Any, K: Any, V: Any, mask: Any) -> Any:
        return softmax(np.where(mask, -np.inf, Q @ K.T / 4.0)) @ V

    def unscaled_additive(Q: Any, K: Any, V: Any, mask: Any) -> Any:
        return softmax(Q @ K.T + mask) @ V

    for fn in (keep01, additive, true_masked):
        report = check_function(fn, mask_means="auto")
        assert not [f for f in report.findings if f.wrong], (fn.__name__, report.text())
    report = check_function(unscaled_additive, mask_means="auto")
    assert [f.diagnosis for f in report.findings if f.wrong] == ["unscaled"]
    # given, the convention is not guessed: True = may attend read as True = masked
    assert not check_function(true_masked).ok
