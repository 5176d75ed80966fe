"""Grouped-query models traced with selected heads and rows: the keys and values each head used.

Every grouped-query family of ``test_hf_tracing.py`` (Llama, Mistral, Qwen2, Gemma2, gpt-oss:
4 query heads sharing 2 key/value heads) is traced with selected rows, selected heads and
both. The trace must keep the model's own ``num_heads`` and ``num_kv_heads`` (the selection
is said by each step's ``index``), and every reader must give query head h the key/value
head h // 2: the recorded numbers equal the unselected trace's and eager's, and every output
format (text, Markdown, LaTeX, JSON, the page) shows each head with the K and V it used and
the worked q·k lines that follow from them.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import render
from qkv.render._html import page_data
from tests.hf.test_hf_tracing import PADDING, _configs, _eager, _family, _inputs


def _grouped(config: Any) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    return isinstance(heads, int) and isinstance(kv, int) and kv < heads


GQA = [name for name, (config, _, _) in _configs().items() if _grouped(config)]
SELECTIONS = {
    "rows": {"queries": [2]},
    "heads": {"heads": [3]},
    "both": {"heads": [1, 2], "queries": [2, -1]},
    "last": {"heads": [-1], "queries": [-1]},
}
TOKENS = ["a", "b", "c", "d", "e", "f"]
TOL = 1e-6


def _trace(model: Any, mask: torch.Tensor, **selection: Any) -> qkv.Trace:
    with (
        torch.no_grad(),
        qkv.tracing(qkv.Trace(tokens=list(TOKENS)), model=model, **selection) as t,
    ):
        model(**_inputs("text", mask))
    return t


def _resolved(selection: dict[str, Any], axis: str, size: int) -> list[int]:
    chosen = selection.get("heads" if axis == "head" else "queries")
    return list(range(size)) if chosen is None else [i % size for i in chosen]


def test_the_families_are_the_grouped_query_ones() -> None:
    assert [name.split()[0] for name in GQA] == ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("family", GQA)
def test_a_selection_keeps_the_model_counts_and_the_numbers_of_the_whole(
    family: str, selection: str
) -> None:
    """The meta says the model's counts whatever is selected; each selected head's rows
    equal the unselected trace's and eager's, with the K and V of key/value head h // 2."""
    model = _family(family)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    mask = PADDING["left"]
    chosen = SELECTIONS[selection]
    whole = _trace(model, mask)
    part = _trace(model, mask, **chosen)
    eager = _eager(model, "text", mask).attentions
    assert len(part.calls) == len(whole.calls) == model.config.num_hidden_layers
    assert (part.meta["num_heads"], part.meta["num_kv_heads"]) == (heads, kv_heads)
    for layer, (mine, theirs) in enumerate(zip(part.calls, whole.calls, strict=True)):
        assert (mine.meta["num_heads"], mine.meta["num_kv_heads"]) == (heads, kv_heads)
        facts = part.meta["layers"][mine.layer]
        assert (facts["num_heads"], facts["num_kv_heads"]) == (heads, kv_heads)
        picked = _resolved(chosen, "head", heads)
        rows = _resolved(chosen, "query", len(TOKENS))
        for name in ("Q", "scores", "scaled", "masked", "weights", "context"):
            step, full = mine[name], theirs[name]
            assert (step.index or {}).get("head", list(range(heads))) == picked, name
            want = full.value[:, picked][:, :, rows]
            np.testing.assert_allclose(step.value, want, atol=TOL, rtol=0, err_msg=name)
        # eager's weights of the selected heads and rows, on the real tokens (a row of
        # padding has no key to attend: qkv gives it zeros where eager spreads it evenly)
        real = mask.bool()[:, rows]  # (B, rows)
        ours = mine["weights"].value.transpose(0, 2, 1, 3)[real.numpy()]
        theirs_eager = eager[layer][:, picked][:, :, rows].transpose(1, 2)[real].numpy()
        np.testing.assert_allclose(ours, theirs_eager, atol=TOL, rtol=0)
        for name in ("K", "V"):  # one key/value row per selected head: the one it used
            step = mine[name]
            used = [h // group for h in picked]
            if "heads" in chosen:
                assert step.index == {"kv_head": used}, name
                np.testing.assert_allclose(
                    step.value, theirs[name].value[:, used], atol=TOL, rtol=0
                )
            else:  # kept whole: every key/value head
                np.testing.assert_allclose(step.value, theirs[name].value, atol=TOL, rtol=0)


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("family", GQA)
def test_every_format_shows_each_head_with_the_keys_and_values_it_used(
    family: str, selection: str
) -> None:
    model = _family(family)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    mask = PADDING["right"]
    chosen = SELECTIONS[selection]
    whole = _trace(model, mask, layers=[-1])  # the last layer: its input went through one
    part = _trace(model, mask, layers=[-1], **chosen)
    picked = _resolved(chosen, "head", heads)
    titles = {
        h: f"Head {h} of {heads} heads (key/value head {h // group} of {kv_heads})" for h in picked
    }
    narrative = render.narrate(part)
    # the whole trace, working out the same query rows: its worked lines are the reference
    whole.meta["queries"] = _resolved(chosen, "query", len(TOKENS))
    worked = {section.title: section for section in render.narrate(whole).sections}
    shown = 0
    for section in narrative.sections:
        head = next((h for h, t in titles.items() if section.title and t in section.title), None)
        if head is None:
            continue
        views = {view.name: view for view in section.steps}
        for name in ("K", "V"):
            table = views[name].table
            assert table is not None
            want = whole[name].value[0, head // group]  # the one call: the last layer
            np.testing.assert_allclose(table.values, want, atol=TOL, rtol=0, err_msg=section.title)
        # the worked q·k lines and weighted sums are written only when they reproduce the
        # recorded scores and context vectors from the K and V shown above them: the same
        # lines as the whole trace's (of which the context's are always there)
        theirs = {view.name: view for view in worked[section.title].steps}
        for name in ("scores", "scaled", "weights", "context"):
            assert views[name].equations == theirs[name].equations, (section.title, name)
        assert views["context"].equations, section.title
        shown += 1
    assert shown == len(picked) and len(part.calls) == 1
    facts = {fact.label: fact.plain for fact in narrative.facts}
    assert facts["heads"].startswith(f"{heads} ({kv_heads} key/value heads: grouped-query")
    for text in (render.text(part, width=200), render.markdown(part), render.latex(part)):
        for title in titles.values():
            assert title in text
        assert " of 1 heads" not in text and "heads 1" not in text
    # JSON: the trace itself; read back, it keeps the counts and renders the same
    again = qkv.Trace.from_json(render.json(part))
    assert [c.meta["num_kv_heads"] for c in again.calls] == [kv_heads] * len(part.calls)
    assert render.text(again, width=200) == render.text(part, width=200)
    # the page: each head's K and V, and its context vectors readable as weighted sums
    for data in page_data(part)["calls"]:
        sections = [s for s in data["sections"] if s["head"] is not None]
        assert [s["title"] for s in sections] == [titles[h] for h in picked]
        for head, entry in zip(picked, sections, strict=True):
            steps = {step["name"]: step for step in entry["steps"]}
            raw = np.frombuffer(base64.b64decode(steps["K"]["data"]), dtype="<f4")
            got = raw.reshape(steps["K"]["shape"])
            want = whole["K"].value[0, head // group]
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
            assert steps["context"]["weightedSum"] is True, entry["title"]
