"""qkv.patching, qkv.edits.ablation_sweep and the metrics.

The sweep is compared, cell by cell, with the same sweep done by hand on eager attention
(forward pre-hooks on the output projection, tests/edits/oracle.py), as TransformerLens's
``patching.get_act_patch_attn_head_out_all_pos`` computes it; and on a constructed model
(tests/support/flip_model.py) where one head alone decides the answer.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import qkv
from qkv.edits import ablation_sweep, head_means
from tests.edits.oracle import OracleEdit, oracle, record_eager
from tests.hf.test_hf_tracing import _causal_lm
from tests.support.flip_model import HOUSE, MAT, flip_model
from tests.support.hf_models import VOCAB

CLEAN = torch.tensor([[5, 6, 7, 8, 9, 10]])
CORRUPT = torch.tensor([[5, 6, 20, 8, 9, 10]])


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([[VOCAB[w] for w in text.split()]])


def test_one_head_flips_the_answer_of_the_constructed_model() -> None:
    model = flip_model()
    table = qkv.patching(
        model, _ids("the cat sat on the"), _ids("the dog sat on the"), qkv.logit_diff(MAT, HOUSE)
    )
    assert table.clean > 5 and table.corrupt < -5
    assert table.values[0][0] == pytest.approx(table.clean, abs=1e-5)
    flat = [v for row in table.values for v in row]
    assert sum(abs(v - table.corrupt) > 1e-5 for v in flat) == 1  # that head and no other
    assert table.best() == (0, 0)
    assert table.normalized()[0][0] == pytest.approx(1.0, abs=1e-6)
    assert table.normalized()[1][3] == pytest.approx(0.0, abs=1e-6)
    assert table.layers == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    # the head attends to the same position in both prompts: its pattern alone changes nothing
    weights = qkv.patching(
        model,
        _ids("the cat sat on the"),
        _ids("the dog sat on the"),
        qkv.logit_diff(MAT, HOUSE),
        what="weights",
    )
    assert max(abs(v - weights.corrupt) for row in weights.values for v in row) < 1e-5


def _oracle_sweep(model: Any, metric: Any, kind: str) -> list[list[float]]:
    rows = []
    for layer in range(2):
        row = []
        for head in range(4):
            context, weights = record_eager(model, lambda: model(CLEAN), layer, head)
            value = {"context": context, "weights": weights, "zero": None}[kind]
            with torch.no_grad(), oracle(model, OracleEdit(kind, layer, head, value)):
                row.append(metric(model(CORRUPT if kind != "zero" else CLEAN).logits))
        rows.append(row)
    return rows


@pytest.mark.parametrize("what", ["context", "weights"])
def test_the_sweep_equals_the_same_sweep_on_eager_with_hooks(what: str) -> None:
    model = _causal_lm("llama (GQA)")
    metric = qkv.logit_diff(3, 17)
    table = qkv.patching(model, CLEAN, CORRUPT, metric, what=what)
    expected = _oracle_sweep(model, metric, what)
    assert len(table.values) == 2 and all(len(row) == 4 for row in table.values)
    for ours, theirs in zip(table.values, expected, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    with torch.no_grad():
        assert table.clean == pytest.approx(metric(model(CLEAN).logits), abs=1e-5)
        assert table.corrupt == pytest.approx(metric(model(CORRUPT).logits), abs=1e-5)
    assert len({round(v, 4) for row in table.values for v in row}) > 1


def test_the_ablation_sweep_equals_zeroing_each_head_by_hand() -> None:
    model = _causal_lm("llama (GQA)")
    metric = qkv.prob(3)
    table = ablation_sweep(model, CLEAN, metric)
    assert table.what == "zero" and table.clean is None
    for ours, theirs in zip(table.values, _oracle_sweep(model, metric, "zero"), strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    means = head_means(model, [CLEAN, CORRUPT])
    mean_table = ablation_sweep(model, CLEAN, metric, how="mean", mean=means)
    assert mean_table.what == "mean" and mean_table.values != table.values
    assert all(math.isnan(v) for row in table.normalized() for v in row)


def test_metrics_read_the_last_position() -> None:
    logits = torch.tensor([[[9.0, 9.0, 9.0], [1.0, 0.0, 3.0]], [[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]])
    assert qkv.logit_diff(2, 0)(logits) == pytest.approx(((3 - 1) + 0) / 2)
    expected = (math.exp(3) / (math.e + 1 + math.exp(3)) + 1 / (2 + math.exp(2))) / 2
    assert qkv.prob(2)(logits) == pytest.approx(expected)
    with pytest.raises(ValueError, match="token id 7 is not in the vocabulary of 3"):
        qkv.prob(7)(logits)
    with pytest.raises(TypeError, match="answer must be a token id"):
        qkv.logit_diff("mat", 0)


def test_any_function_of_the_logits_is_a_metric_and_a_bad_one_is_named() -> None:
    model = flip_model()
    clean, corrupt = _ids("the cat sat on the"), _ids("the dog sat on the")
    table = qkv.patching(model, clean, corrupt, lambda logits: logits[0, -1, MAT])
    assert table.values[0][0] == pytest.approx(table.clean)
    with pytest.raises(TypeError, match="the metric returned list, not one number"):
        qkv.patching(model, clean, corrupt, lambda logits: [1, 2])
    with pytest.raises(TypeError, match="metric must be a function of the logits"):
        qkv.patching(model, clean, corrupt, "logit_diff")
    with pytest.raises(ValueError, match="what must be 'context' or 'weights', got 'pattern'"):
        qkv.patching(model, clean, corrupt, qkv.prob(MAT), what="pattern")
    shapes = r"clean inputs have shape \(1, 3\) and the corrupt ones \(1, 5\)"
    with pytest.raises(ValueError, match=shapes):
        qkv.patching(model, _ids("the cat sat"), corrupt, qkv.prob(MAT))
