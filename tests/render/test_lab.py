"""The page data of edit mode (``render/_lab.py``): which calls the page can recompute, with
which inputs and which choices. The browser tests (``tests/browser/test_edit.py``) check the
page's numbers against the core; these check the data it is given."""

from __future__ import annotations

import json

import numpy as np
import pytest

import qkv
from qkv import examples, masks
from qkv.render._html import page_data
from qkv.render._lab import LAB_CALLS_MAX


@pytest.mark.parametrize("name", examples.builtin_names())
def test_a_worked_example_hands_over_its_exact_inputs(name: str) -> None:
    example = examples.builtin(name)
    lab = page_data(examples.run(example))["calls"][0]["lab"]
    assert lab["kind"] == "projections"
    for field in ("embeddings", "W_q", "W_k", "W_v", "W_o"):
        given = getattr(example, field)
        if given is None:
            assert lab["inputs"][field] is None
        else:  # float64 through JSON: the same numbers, bit for bit
            again = np.array(json.loads(json.dumps(lab["inputs"][field])))
            assert np.array_equal(again, given)
    assert lab["heads"] == example.heads and example.heads in lab["headOptions"]
    assert lab["scale"] == "sqrt_dk" and lab["causal"] == example.causal
    keys = {f"{h}|{s}|{c}" for h in lab["headOptions"] for s in lab["scales"] for c in (0, 1)}
    assert set(lab["variants"]) == keys


def test_each_variant_has_the_words_of_its_choice() -> None:
    lab = page_data(examples.run(examples.builtin("two-heads")))["calls"][0]["lab"]
    words = lab["steps"]
    one = lab["variants"]["1|none|1"]
    names = [words[s]["name"] for section in one["sections"] for s in section["steps"]]
    assert "masked" in names and "output" in names and one["heads"] == 1
    scaled = next(
        words[s] for sec in one["sections"] for s in sec["steps"] if words[s]["name"] == "scaled"
    )
    assert "no scaling" in scaled["formula"]
    four = lab["variants"]["4|d_k|0"]
    assert four["heads"] == 4 and [s["head"] for s in four["sections"]].count(None) == 2
    assert "masked" not in [words[s]["name"] for sec in four["sections"] for s in sec["steps"]]
    assert all(words[s]["equations"] == [] for sec in four["sections"] for s in sec["steps"])
    facts = dict(map(tuple, four["facts"]))
    assert facts["heads"] == "4" and "tokens" not in facts


def test_a_scale_as_given_is_kept_as_a_choice() -> None:
    trace = examples.run(examples.builtin("i-love-statistics"), scale=0.3)
    lab = page_data(trace)["calls"][0]["lab"]
    assert lab["scale"] == "given" and lab["factor"] == 0.3
    assert lab["scales"] == ["sqrt_dk", "none", "d_k", "given"]


def test_q_k_v_given_directly_are_the_inputs() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(1, 2, 3, 4)) for _ in range(3))
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, backend="reference")
    lab = page_data(trace)["calls"][0]["lab"]
    assert lab["kind"] == "qkv" and lab["headOptions"] == [2]
    assert np.array_equal(np.array(lab["inputs"]["K"]), k[0])


@pytest.mark.parametrize(
    ("kv_heads", "options"),
    [
        (1, {"mask": masks.sliding_window(1)}),
        (1, {"is_causal": True, "causal_alignment": "bottom-right"}),
        (1, {"bias": np.ones((3, 5))}),
        (2, {"enable_gqa": True}),  # 4 query heads share 2 key/value heads
    ],
)
def test_calls_the_page_cannot_recompute_get_no_inputs(
    kv_heads: int, options: dict[str, object]
) -> None:
    rng = np.random.default_rng(2)
    heads = 4 if kv_heads > 1 else 1
    q = rng.normal(size=(heads, 3, 4))[None] if heads > 1 else rng.normal(size=(3, 4))
    shape = (1, kv_heads, 5, 4) if heads > 1 else (5, 4)
    k, v = rng.normal(size=shape), rng.normal(size=shape)
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, backend="reference", **options)  # type: ignore[arg-type]
    assert "lab" not in page_data(trace)["calls"][0]


def test_kept_steps_are_the_variants_steps_and_calls_are_capped() -> None:
    trace = examples.run(examples.builtin("two-heads"))
    lab = page_data(trace, steps=("W_q", "weights"))["calls"][0]["lab"]
    names = {
        lab["steps"][s]["name"]
        for v in lab["variants"].values()
        for sec in v["sections"]
        for s in sec["steps"]
    }
    assert names == {"W_q", "weights"}
    x = np.eye(3)
    with qkv.tracing() as many:
        for _ in range(LAB_CALLS_MAX + 2):
            qkv.self_attention(x, x, x, x)
    calls = page_data(many)["calls"]
    assert ["lab" in c for c in calls] == [True] * LAB_CALLS_MAX + [False, False]


def test_no_script_of_the_page_writes_html() -> None:
    from qkv.render._html import SCRIPTS, page_script

    assert {"lab.js", "panels.js", "decode.js"} <= set(SCRIPTS)
    script = page_script()
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert unsafe not in script
    assert (
        "new Function" not in script and "fetch(" not in script and "XMLHttpRequest" not in script
    )
