"""The data of the page's model view (``render/_model_view.py``): one map per layer and head,
pooled without losing probability, with the numbers its label needs."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np

import qkv
from qkv import examples, render
from qkv.render._html import page_data
from qkv.render._model_view import THUMBNAIL, model_view

ASSETS = Path(render.__file__).parent / "assets"


def model_trace(layers: int = 3, heads: int = 4, n: int = 5, rows: int | None = None) -> qkv.Trace:
    """A trace as a model gives it: one call per layer, each named by its module path."""
    rng = np.random.default_rng(layers * 100 + n)
    trace = qkv.Trace(tokens=[f"w{i}" for i in range(n)])
    for layer in range(layers):
        scores = rng.normal(size=(heads, rows or n, n)) * 3
        weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
        trace.record(
            "weights", weights, formula="A", description="", axes=("head", "query", "key"),
            layer=f"blocks.{layer}.attn",
        )  # fmt: skip
    return trace


def pixels(entry: dict[str, object]) -> np.ndarray:
    shape = entry["shape"]
    assert isinstance(shape, list) and isinstance(entry["data"], str)
    raw = np.frombuffer(base64.b64decode(entry["data"]), dtype=np.uint8)
    return raw.reshape(shape)


def test_a_map_per_layer_and_head_with_its_strongest_key() -> None:
    trace = model_trace()
    view = model_view(trace, trace.calls, trace.layer_names(), lambda labels: 0, precision=6)
    assert view is not None
    assert [row["name"] for row in view["rows"]] == [f"blocks.{i}.attn" for i in range(3)]
    assert [len(row["heads"]) for row in view["rows"]] == [4, 4, 4]
    entry = view["rows"][2]["heads"][1]
    weights = trace.calls[2]["weights"].value[1]
    assert entry["title"] == "Head 1 of 4 heads"
    assert entry["top"] == [[int(np.argmax(r)), round(float(r.max()), 6)] for r in weights]
    drawn = pixels(entry)
    assert drawn.shape == (5, 5) and drawn.max() == 255
    # unpooled, the map is the weights themselves, scaled to their largest
    np.testing.assert_allclose(drawn / 255, weights / weights.max(), atol=1 / 255)


def test_a_long_sequence_is_pooled_keeping_each_groups_share() -> None:
    n = 100
    trace = model_trace(layers=2, heads=1, n=n, rows=1)
    view = model_view(trace, trace.calls, trace.layer_names(), lambda labels: 0, precision=6)
    assert view is not None
    entry = view["rows"][0]["heads"][0]
    assert entry["shape"] == [1, THUMBNAIL]
    weights = trace.calls[0]["weights"].value[0, 0]
    edges = np.linspace(0, n, THUMBNAIL + 1).round().astype(int)
    shares = np.add.reduceat(weights, edges[:-1])  # the keys of each group, summed
    assert abs(shares.sum() - 1) < 1e-9
    assert entry["max"] == round(float(shares.max()), 6)
    np.testing.assert_allclose(pixels(entry)[0] / 255, shares / shares.max(), atol=1 / 255)


def test_the_page_opens_on_the_selected_layer_and_head() -> None:
    trace = model_trace()
    trace.meta["selected"] = {"layer": "blocks.1.attn", "head": 3}
    data = page_data(trace)
    assert data["modelView"]["start"] == {"call": 1, "head": 3}
    trace.meta["selected"] = {"layer": "blocks.1.attn", "head": 9}  # not on the page
    assert page_data(trace)["modelView"]["start"] == {"call": 1, "head": 0}
    trace.meta["selected"] = {"layer": "nowhere", "head": 0}
    assert page_data(trace)["modelView"]["start"] is None


def test_heads_chosen_by_a_selection_keep_their_numbers() -> None:
    x = np.random.default_rng(0).normal(size=(1, 4, 3, 2))  # (B, H, L, D)
    with qkv.tracing(heads=[1, 3]) as trace:
        for layer in ("a.attn", "b.attn"):
            with trace.in_layer(layer, num_heads=4):
                qkv.scaled_dot_product_attention(x, x, x)
    trace.meta["selected"] = {"layer": "b.attn", "head": 3}
    view = page_data(trace)["modelView"]
    assert [entry["title"] for entry in view["rows"][0]["heads"]] == [
        "Head 1 of 4 heads",
        "Head 3 of 4 heads",
    ]
    assert view["start"] == {"call": 1, "head": 1}


def test_worked_examples_and_single_maps_have_no_grid() -> None:
    assert page_data(examples.run(examples.builtin("two-heads")))["modelView"] is None
    assert page_data(model_trace(layers=1, heads=1))["modelView"] is None


def test_the_script_never_writes_html_and_is_on_the_page() -> None:
    script = (ASSETS / "model_view.js").read_text(encoding="utf-8")
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert unsafe not in script
    assert "new Function" not in script and "</script" not in script.lower()
    page = render.html(model_trace())
    assert "qkvPage.extend" in page and "mv-grid" in page
