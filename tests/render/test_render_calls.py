"""Every renderer shows a trace call by call, as the trace recorded its calls (``trace.calls``),
each with its own facts; and the header names recorded heads and rows as the sections and the
tables do (issue 13 follow-up, issue 12 item 17).

A call with both a bias and a score modifier records two ``bias`` steps: before, the renderers
split it into two calls where the name came again.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import render
from qkv.render import Narrative

TOKENS = ["the", "cat", "sat", "on", "the", "mat"]


def biased_softcap_trace(seed: int = 0, heads: int = 2) -> tuple[qkv.Trace, np.ndarray]:
    """One SDPA call with a bias and ``softcap(5.0)``; also its weights in float64, computed
    here from the formulas (softmax(5·tanh((Q·Kᵀ·scale + bias)/5)))."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, heads, 4, 8))
    bias = rng.normal(size=(4, 4))
    with qkv.tracing() as t:
        qkv.scaled_dot_product_attention(q, q, q, bias=bias, score_mod=qkv.masks.softcap(5.0))
    s = q[0] @ q[0].transpose(0, 2, 1) / np.sqrt(8) + bias
    s = 5.0 * np.tanh(s / 5.0)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return t, e / e.sum(axis=-1, keepdims=True)


def data_of(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert found is not None
    result: dict[str, Any] = json.loads(found.group(1))
    return result


def step_numbers(narrative: Narrative) -> list[tuple[int, str]]:
    """(number, name) of every step shown, each once, in order (a step shown for every head
    is counted once)."""
    seen: dict[int, str] = {}
    for section in narrative.sections:
        for view in section.steps:
            seen.setdefault(view.number, view.name)
    return sorted(seen.items())


# -- one call with a bias and a score modifier -----------------------------------------------


def test_a_call_with_a_bias_and_a_score_modifier_is_shown_as_one_call() -> None:
    t, weights = biased_softcap_trace()
    assert len(t.calls) == 1 and t.names.count("bias") == 2
    narrative = render.narrate(t)
    # one call: sections titled by head only, no "Call 0 of 2 calls"
    assert [s.title for s in narrative.sections] == ["Head 0 of 2 heads", "Head 1 of 2 heads"]
    assert step_numbers(narrative) == list(
        enumerate(["Q", "K", "V", "scores", "scaled", "bias", "bias", "weights", "context"], 1)
    )
    text = render.text(t)
    assert "Call 0 of" not in text and "Call 1 of" not in text
    assert "Step 7. " in text and "S' = softcap(5.0)(S')" in text
    # the weights shown are those of the whole call, as computed in float64
    for head, section in enumerate(narrative.sections):
        (table,) = [v.table for v in section.steps if v.name == "weights" and v.table]
        np.testing.assert_allclose(table.values, weights[head], rtol=1e-10, atol=1e-12)


def test_the_page_and_the_heatmap_of_that_call_show_one_call(tmp_path: Path) -> None:
    t, weights = biased_softcap_trace()
    data = data_of(render.html(t))
    assert [c["name"] for c in data["calls"]] == ["call 0"]
    (call,) = data["calls"]
    numbers = [
        (step["number"], step["name"], step["formula"])
        for step in call["sections"][0]["steps"]
        if step["name"] == "bias"
    ]
    assert numbers == [(6, "bias", "S' = S' + bias"), (7, "bias", "S' = softcap(5.0)(S')")]
    shown = next(s for s in call["sections"][1]["steps"] if s["name"] == "weights")
    raw = np.frombuffer(base64.b64decode(shown["data"]), dtype="<f4").reshape(shown["shape"])
    np.testing.assert_allclose(raw, weights[1], rtol=1e-6)
    figure = render.heatmap(t, tmp_path / "w.svg")
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == ["head 0", "head 1"]  # one call: no "call 0, ..." / "call 1, ..." rows


@settings(max_examples=25, deadline=None)
@given(
    bias=st.booleans(),
    softcap=st.booleans(),
    causal=st.booleans(),
    calls=st.integers(1, 3),
)
def test_sections_follow_the_recorded_calls(
    bias: bool, softcap: bool, causal: bool, calls: int
) -> None:
    """However the calls are made, the narrative has one group of sections per recorded call,
    and each call's steps are numbered 1, 2, ... in the order they ran (the calls from 0)."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(3, 4))
    with qkv.tracing() as t:
        for _ in range(calls):
            qkv.scaled_dot_product_attention(
                q,
                q,
                q,
                bias=rng.normal(size=(3, 3)) if bias else None,
                score_mod=qkv.masks.softcap(5.0) if softcap else None,
                is_causal=causal,
            )
    assert len(t.calls) == calls
    narrative = render.narrate(t)
    assert len(narrative.sections) == calls
    for index, (section, call) in enumerate(zip(narrative.sections, t.calls, strict=True)):
        if calls > 1:
            assert section.title == f"Call {index} of {calls} calls"
        assert [(v.number, v.name) for v in section.steps] == list(enumerate(call.names, 1))


# -- each call's own facts -------------------------------------------------------------------


def test_each_call_of_a_page_shows_its_own_mask_and_scale() -> None:
    """The page's facts of a call are that call's (``call.meta``), not the last call's."""
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 2, 5, 4))
    with qkv.tracing() as t:
        qkv.scaled_dot_product_attention(q, q, q, is_causal=True)
        qkv.scaled_dot_product_attention(q, q, q, mask=qkv.masks.key_padding([3]), scale=1.0)
    first, second = (dict(c["facts"]) for c in data_of(render.html(t))["calls"])
    assert first["mask"].startswith("causal")
    assert first["scale"] == "scaled by 1/√d_k = 1/√4 = 0.5000"
    assert second["mask"] == "key padding (lengths 3)"
    assert second["scale"] == "not scaled (scale = 1)"


def test_html_page_is_exported() -> None:
    page = render.html(biased_softcap_trace()[0])
    assert isinstance(page, render.HtmlPage) and isinstance(page, str)
    assert "HtmlPage" in render.__all__


# -- one numbering rule in the header --------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    heads=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    queries=st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True),
    tokens=st.booleans(),
)
def test_the_header_names_recorded_heads_and_rows_as_titles_and_tables_do(
    heads: list[int], queries: list[int], tokens: bool
) -> None:
    """``heads: 4; recorded: head 1 and head 3`` names the heads as the section titles do
    (``Head 1 of 4 heads``) and ``queries: recorded: rows the#0 and mat`` the rows as the tables
    label them; no "numbered from" in any format."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(1, 4, 6, 4))
    with qkv.tracing(heads=heads, queries=queries) as t:
        qkv.scaled_dot_product_attention(q, q, q)
    if tokens:
        t.tokens = list(TOKENS)
    narrative = render.narrate(t)
    facts = {fact.label: fact.plain for fact in narrative.facts}
    named = [f"head {h}" for h in heads]  # in the order they were selected
    listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
    if heads == [0, 1, 2, 3]:  # every head, in order: shown as without a selection
        assert facts["heads"] == "4"
    else:
        assert facts["heads"] == f"4; recorded: {listed}"
    assert [s.title for s in narrative.sections] == [f"Head {h} of 4 heads" for h in heads]
    weights = next(v.table for v in narrative.sections[0].steps if v.name == "weights")
    assert weights is not None
    rows = list(weights.rows)
    listed = rows[0] if len(rows) == 1 else ", ".join(rows[:-1]) + " and " + rows[-1]
    assert facts["queries"] == f"recorded: rows {listed}"
    for output in (render.text(t, width=200), render.markdown(t), render.latex(t)):
        assert "numbered from" not in output
