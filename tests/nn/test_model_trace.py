"""Tracing qkv modules inside a model: chosen layers, heads and queries, named by module path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import qkv
import qkv.trace as trace_module
import qkv.trace._trace as recording
from qkv import render
from qkv._array import to_numpy
from qkv.cli import main
from qkv.nn import KVCache, MultiHeadAttention, TransformerBlock


class TwoLayers(torch.nn.Module):
    def __init__(self, num_kv_heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            TransformerBlock(16, 4, num_kv_heads=num_kv_heads) for _ in range(2)
        )

    def forward(self, x: torch.Tensor, cache: list[KVCache] | None = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, is_causal=True, cache=None if cache is None else cache[i])
        return x


def _weights_of(model: TwoLayers, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The attention weights of one layer, computed without tracing."""
    h = x
    for block in model.blocks[:layer]:
        h = block(h, is_causal=True)
    block = model.blocks[layer]
    assert isinstance(block, TransformerBlock)
    weights: torch.Tensor
    _, weights = block.attn(block.attn_norm(h), is_causal=True, need_weights=True)
    return weights


def test_two_layer_model_trace_names_the_right_modules_and_heads() -> None:
    model = TwoLayers()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), qkv.tracing(model=model, layers=["blocks.1"], heads=[0, 2]) as t:
        model(x)
    assert {step.layer for step in t} == {"blocks.1.attn"}
    weights = t["weights"]
    assert weights.axes == ("batch", "head", "query", "key") and weights.shape == (2, 2, 5, 5)
    assert weights.index == {"head": [0, 2]}
    expected = _weights_of(model, 1, x)[:, [0, 2]].detach().numpy()
    np.testing.assert_allclose(weights.value, expected, atol=1e-6)
    assert t.names == [
        "embeddings", "Q", "K", "V", "scores", "scaled", "masked", "weights", "context",
        "concat", "output",
    ]  # fmt: skip
    assert t.meta["layers"]["blocks.1.attn"]["heads"] == [0, 2]
    assert t.heads == (0, 2) and t.layers == ("blocks.1",)  # the selection, for kernels


def test_every_layer_by_pattern_and_position_in_model_order() -> None:
    model = TwoLayers()
    x = torch.randn(1, 4, 16)
    with torch.no_grad(), qkv.tracing(model=model, layers="blocks.*.attn", steps="weights") as t:
        model(x)
    assert [s.layer for s in t] == ["blocks.0.attn", "blocks.1.attn"]
    assert t.names == ["weights", "weights"]
    with torch.no_grad(), qkv.tracing(model=model, layers=-1, steps=["weights"]) as last:
        model(x)
    assert [s.layer for s in last] == ["blocks.1.attn"]
    np.testing.assert_allclose(last.steps[0].value, t.steps[1].value, atol=1e-6)


def test_query_selection_and_gqa_keys_follow_the_selected_heads() -> None:
    model = TwoLayers(num_kv_heads=2)  # heads 0, 1 use key/value head 0; heads 2, 3 use 1
    x = torch.randn(1, 6, 16)
    with torch.no_grad(), qkv.tracing(model=model, layers=0, heads=[1, 2], queries=-1) as t:
        model(x)
    weights, keys = t["weights"], t["K"]
    assert weights.shape == (1, 2, 1, 6) and weights.index == {"head": [1, 2], "query": [5]}
    assert keys.axes == ("batch", "kv_head", "key", "dim")
    assert keys.index == {"kv_head": [0, 1]} and keys.shape == (1, 2, 6, 4)
    expected = _weights_of(model, 0, x)[:, [1, 2], -1:].detach().numpy()
    np.testing.assert_allclose(weights.value, expected, atol=1e-6)
    assert t.query_tokens == ["t5"]  # the rows are labelled by their position


def test_tracing_in_training_is_detached_and_keeps_gradients() -> None:
    model = TwoLayers()
    model.train()
    x = torch.randn(1, 4, 16, requires_grad=True)
    with qkv.tracing(model=model, heads=0) as t:
        out = model(x)
    out.square().sum().backward()
    assert x.grad is not None and all(isinstance(s.value, np.ndarray) for s in t)
    reference = TwoLayers()
    x2 = x.detach().clone().requires_grad_()
    reference(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)  # tracing changed no gradient


def test_layers_not_selected_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoLayers()
    copied: list[tuple[int, ...]] = []
    real = to_numpy

    def counting(value: object) -> np.ndarray:
        out = real(value)
        copied.append(out.shape)
        return out

    monkeypatch.setattr(recording, "to_numpy", counting)
    with torch.no_grad(), qkv.tracing(model=model, layers=[1], steps=["weights"]) as t:
        model(torch.randn(1, 3, 16))
    assert copied == [(1, 4, 3, 3)] and len(t) == 1


def test_nothing_recorded_or_copied_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("trace touched although tracing is off")

    monkeypatch.setattr(trace_module.Trace, "record", forbidden)
    monkeypatch.setattr(recording, "to_numpy", forbidden)
    model = TwoLayers()
    model(torch.randn(1, 3, 16)).sum().backward()


def test_without_model_modules_are_named_by_call_order() -> None:
    a, b = MultiHeadAttention(8, 2), MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with torch.no_grad(), qkv.tracing(layers=1, steps="weights") as t:
        a(x)
        b(x)
        a(x)
    assert [s.layer for s in t] == ["MultiHeadAttention.1"]


def test_parameters_only_when_asked_and_decoding_with_cache() -> None:
    model = TwoLayers()
    caches = [KVCache(), KVCache()]
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        model(x[:, :3], caches)
        with qkv.tracing(model=model, layers=0, steps=["W_q", "weights"]) as t:
            model(x[:, 3:], caches)
    assert t.names == ["W_q", "weights"]
    assert t["W_q"].shape == (16, 16) and t["weights"].shape == (1, 4, 1, 4)


def test_saved_model_trace_renders_and_explains(tmp_path: Path) -> None:
    model = TwoLayers()
    with torch.no_grad(), qkv.tracing(model=model, heads=[3], queries=[0, 2]) as t:
        model(torch.randn(1, 4, 16))
    path = tmp_path / "trace.json"
    t.save(path)
    loaded = qkv.Trace.load(path)
    assert loaded.heads == (3,) and loaded["weights"].index == {"head": [3], "query": [0, 2]}
    assert loaded["weights"].layer == "blocks.1.attn"
    text = render.text(loaded, width=100)
    assert "blocks.0.attn" in text and "blocks.1.attn" in text
    for fmt in ("markdown", "latex"):
        assert "blocks.1.attn" in render.render(loaded, fmt)
    assert json.loads(render.render(loaded, "json"))["format"] == "qkv-trace"
    out = tmp_path / "trace.md"
    assert main(["explain", "--trace", str(path), "--format", "markdown", "-o", str(out)]) == 0
    assert "blocks.0.attn" in out.read_text(encoding="utf-8")
    one = tmp_path / "one.txt"
    assert main(["explain", "--trace", str(path), "--query", "t2", "-o", str(one)]) == 0
    assert "queries  t2 (1 of 2 shown)" in one.read_text(encoding="utf-8")


def test_explain_trace_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--trace", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}', encoding="utf-8")
    assert main(["explain", "--trace", str(bad)]) == 2
    assert "not a qkv trace" in capsys.readouterr().err
    good = tmp_path / "good.json"
    with qkv.tracing() as t:
        qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
    t.save(good)
    assert main(["explain", "--trace", str(good), "--example", "two-heads"]) == 2
    assert "--example cannot be used with --trace" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layers": ["decoder"]}, ValueError,
         r"tracing layers: 'decoder' selects no attention module of the model\. Hint: its "
         r"attention modules are 'blocks.0.attn', 'blocks.1.attn' \(or 0 to 1 by position\)"),
        ({"layers": [5]}, ValueError, r"tracing layers: 5 selects no attention module"),
        ({"heads": [True]}, TypeError,
         r"tracing heads must be an integer or a non-empty list of integers, got \[True\]"),
        ({"queries": "last"}, TypeError, r"tracing queries must be an integer"),
        ({"steps": ["attention"]}, ValueError,
         r"tracing steps: unknown step name 'attention'\. Hint: the steps are embeddings"),
        ({"layers": [1.5]}, TypeError, r"tracing layers must be a module path, a position"),
    ],
)  # fmt: skip
def test_tracing_argument_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match), qkv.tracing(model=TwoLayers(), **kwargs):
        pass


def test_tracing_errors_about_the_model_and_heads() -> None:
    expects = r"tracing\(model=\.\.\.\) expects a torch.nn.Module, got str"
    with pytest.raises(TypeError, match=expects), qkv.tracing(model="gpt"):
        pass
    empty = r"the Linear has no qkv attention module to record"
    with pytest.raises(ValueError, match=empty), qkv.tracing(model=torch.nn.Linear(2, 2)):
        pass
    negative = r"a negative position needs model="
    with pytest.raises(ValueError, match=negative), qkv.tracing(layers=-1):
        pass
    model = TwoLayers()
    missing = r"tracing heads=\[7\]: index 7 does not exist in layer 'blocks.0.attn', which has 4"
    with pytest.raises(ValueError, match=missing), qkv.tracing(model=model, heads=7):
        model(torch.randn(1, 2, 16))


# -- traces made of calls (issue 13) and one numbering rule in the header (issue 12) -------


def test_calls_of_a_model_by_layer_and_decoding_step() -> None:
    model = TwoLayers()
    caches = [KVCache(), KVCache()]
    x = torch.randn(1, 5, 16)
    with torch.no_grad(), qkv.tracing(model=model, steps=["weights"]) as t:
        model(x[:, :3], caches)  # the prompt, then one token at a time
        model(x[:, 3:4], caches)
        model(x[:, 4:], caches)
    assert t.layer_names() == ["blocks.0.attn", "blocks.1.attn"]
    assert [(c.layer, c.position) for c in t.calls] == [
        ("blocks.0.attn", 0), ("blocks.1.attn", 0), ("blocks.0.attn", 1),
        ("blocks.1.attn", 1), ("blocks.0.attn", 2), ("blocks.1.attn", 2),
    ]  # fmt: skip
    last = t.call(layer="blocks.1.attn", index=-1)
    assert last["weights"].shape == (1, 4, 1, 5) and last.meta["num_heads"] == 4
    assert last.calls[0].meta["shapes"]["key"] == [1, 4, 5, 4]
    assert last.calls[0].meta["head_dim"] == 4  # the module's own facts
    np.testing.assert_array_equal(last["weights"].value, t.steps[-1].value)
    assert "Attention weights" in render.text(last)


def test_header_names_heads_and_rows_as_the_tables_do() -> None:
    model = TwoLayers()
    with torch.no_grad(), qkv.tracing(model=model, heads=[0, 2], queries=[0, -1]) as t:
        model(torch.randn(1, 5, 16))
    t.tokens = ["the", "cat", "saw", "the", "dog"]
    t2 = qkv.Trace(tokens=["the", "cat", "saw", "the", "dog"])
    with torch.no_grad(), qkv.tracing(t2, model=model, heads=[0, 2], queries=[1, 3]):
        model(torch.randn(1, 5, 16))
    assert t.meta["description"] == (
        "Recorded with qkv.tracing; recorded layers: blocks.0.attn, blocks.1.attn; "
        "head 0 and head 2 of 4 heads; query rows t0 and t4."
    )
    assert t2.meta["description"].endswith(
        "head 0 and head 2 of 4 heads; query rows cat and the#3."
    )


def test_a_layer_input_is_not_called_token_embeddings() -> None:
    """A block's attention reads what the layers before it (and its own norm) made of the
    token embeddings: the trace of a model titles that step "Input of the layer" in every
    format, and a worked example, which starts from the embeddings, keeps its title."""
    model = TwoLayers(num_kv_heads=2)
    with torch.no_grad(), qkv.tracing(model=model, queries=[-1]) as t:
        model(torch.randn(1, 5, 16))
    narrative = render.narrate(t)
    firsts = [s.steps[0] for s in narrative.sections if s.title and s.title.endswith("Inputs")]
    assert [view.name for view in firsts] == ["embeddings", "embeddings"]
    assert {view.title for view in firsts} == {"Input of the layer"}
    assert all("token embeddings" in view.meaning for view in firsts)  # what it is made of
    for text in (render.text(t), render.markdown(t), render.latex(t), render.html(t)):
        assert "Input of the layer" in text and "Token embeddings" not in text
    example = qkv.examples.run(qkv.examples.builtin("i-love-statistics"))
    assert "Step 1. Token embeddings" in render.text(example)
