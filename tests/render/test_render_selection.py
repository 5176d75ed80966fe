"""Traces recorded with a selection (``qkv.tracing(heads=..., queries=...)``) are labelled by
the ORIGINAL head numbers and query positions in every renderer: the narrative (text,
Markdown, LaTeX), the JSON file, the heatmap and the HTML page.

Each test compares a selected trace with the whole trace of the same call, so a label that
points at the wrong head or row fails on the numbers, not only on the words.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import render
from qkv.cli import main
from qkv.nn import TransformerBlock
from qkv.render import Narrative, Table
from qkv.render._html import page_data
from qkv.trace import Step, Trace

TOKENS = ["the", "cat", "sat", "on", "the"]
SVG_TEXT = "{http://www.w3.org/2000/svg}text"


def gqa_weights(seed: int = 0) -> tuple[np.ndarray, ...]:
    """x (5, 8) and W_q (8, 8), W_k, W_v (8, 4), W_o (8, 8): 4 heads of d_k = 2 sharing
    2 key/value heads (heads 0, 1 use key/value head 0; heads 2, 3 use 1)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(5, 8))
    return (
        x,
        rng.normal(size=(8, 8)),
        rng.normal(size=(8, 4)),
        rng.normal(size=(8, 4)),
        (rng.normal(size=(8, 8))),
    )


def gqa_trace(
    heads: list[int] | None = None, queries: list[int] | None = None, tokens: bool = True
) -> Trace:
    x, w_q, w_k, w_v, w_o = gqa_weights()
    with qkv.tracing(heads=heads, queries=queries) as t:
        qkv.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4, num_kv_heads=2)
    if tokens:
        t.tokens = list(TOKENS)
    return t


def section(narrative: Narrative, title: str) -> dict[str, Table]:
    """The tables of the section titled ``title``, by step name."""
    for s in narrative.sections:
        if s.title == title:
            return {view.name: view.table for view in s.steps if view.table is not None}
    titles = [s.title for s in narrative.sections]
    raise AssertionError(f"no section {title!r}; the sections are {titles}")


def assert_same_row(selected: Table, whole: Table, label: str) -> None:
    """The row ``label`` of the selected table holds the numbers of that row of the whole."""
    assert selected.columns == whole.columns
    np.testing.assert_allclose(
        selected.values[selected.rows.index(label)], whole.values[whole.rows.index(label)]
    )


def data_of(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert found is not None
    result: dict[str, Any] = json.loads(found.group(1))
    return result


def svg_texts(path: Path) -> list[str]:
    root = ET.fromstring(path.read_text(encoding="utf-8"))
    return ["".join(node.itertext()) for node in root.iter(SVG_TEXT)]


# -- the narrative: text, Markdown, LaTeX ----------------------------------------------------


def test_selected_heads_and_query_are_titled_and_labelled_by_their_original_numbers() -> None:
    selected = gqa_trace(heads=[2, 3], queries=[-1])
    assert selected["weights"].index == {"head": [2, 3], "query": [4]}
    text = render.text(selected, width=80)
    assert "Head 2 of 4 heads (key/value head 1 of 2)" in text
    assert "Head 3 of 4 heads (key/value head 1 of 2)" in text
    assert "Head 0 of" not in text and "Head 1 of" not in text
    words = " ".join(text.split())  # the header wraps at 80 columns
    assert "4 (2 key/value heads: grouped-query attention); recorded: head 2 and head 3" in words
    assert "queries  recorded: rows the#4" in text
    # the kept query is the 5th token ("the" at position 4), never the 1st one
    assert "\nthe#4 " in text and "c_the#4 = " in text and "q_the#4·k_the#0 = " in text
    assert "c_the#0" not in text and "\nt0 " not in text


def test_selected_sections_hold_the_numbers_of_those_heads_and_rows() -> None:
    whole = render.narrate(gqa_trace())
    selected = render.narrate(gqa_trace(heads=[2, 3], queries=[-1]))
    for title in (
        "Head 2 of 4 heads (key/value head 1 of 2)",
        "Head 3 of 4 heads (key/value head 1 of 2)",
    ):
        mine, theirs = section(selected, title), section(whole, title)
        for name in ("Q", "scores", "scaled", "weights", "context"):
            assert mine[name].rows == ("the#4",)
            assert_same_row(mine[name], theirs[name], "the#4")
        for name in ("K", "V"):  # the key/value head the two query heads share
            assert mine[name].rows == theirs[name].rows == ("the#0", "cat", "sat", "on", "the#4")
            np.testing.assert_allclose(mine[name].values, theirs[name].values)
    mine, theirs = section(selected, "Combining the heads"), section(whole, "Combining the heads")
    # every head's columns are in concat and W_q, named by head: h2.d1 is head 2's first one
    assert mine["concat"].columns == theirs["concat"].columns
    assert mine["concat"].columns[4:6] == ("h2.d1", "h2.d2")
    assert_same_row(mine["concat"], theirs["concat"], "the#4")
    inputs = section(selected, "Inputs")
    assert inputs["W_q"].columns == section(whole, "Inputs")["W_q"].columns
    assert inputs["W_q"].columns[-2:] == ("h3.d1", "h3.d2")


def test_worked_lines_of_a_selected_trace_are_those_of_the_whole_trace() -> None:
    whole_trace = gqa_trace()
    whole_trace.meta["queries"] = [4]  # the whole trace, showing and working out query 4
    whole, selected = render.narrate(whole_trace), render.narrate(gqa_trace([3], [-1]))
    title = "Head 3 of 4 heads (key/value head 1 of 2)"

    def lines(narrative: Narrative) -> dict[str, list[str]]:
        return {
            v.name: [e.plain for e in v.equations]
            for s in narrative.sections
            if s.title == title
            for v in s.steps
        }

    mine, theirs = lines(selected), lines(whole)
    assert all(mine[name] for name in ("scores", "scaled", "weights", "context"))
    assert mine == theirs
    assert mine["context"][0].startswith("c_the#4 = ")


def test_a_single_selected_head_gets_its_own_section() -> None:
    text = render.text(gqa_trace(heads=[1], queries=[0, -1]), width=100)
    assert "Inputs" in text and "Combining the heads" in text
    assert "Head 1 of 4 heads (key/value head 0 of 2)" in text
    assert "recorded: head 1" in text
    assert "recorded: rows the#0 and the#4" in text


def test_selecting_every_head_renders_exactly_as_no_selection() -> None:
    x, w_q, w_k, w_v, w_o = gqa_weights()
    w_k, w_v = (np.hstack([w, w]) for w in (w_k, w_v))  # 4 key/value heads: plain MHA
    traces = []
    for heads in (None, [0, 1, 2, 3]):
        with qkv.tracing(heads=heads) as t:
            qkv.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4)
        t.tokens = list(TOKENS)
        traces.append(t)
    assert traces[1]["weights"].index == {"head": [0, 1, 2, 3]}
    assert render.text(traces[1]) == render.text(traces[0])


def test_every_head_of_a_gqa_trace_keeps_its_grouping_remark() -> None:
    # heads=[0, 1, 2, 3] keeps every query head but records one key/value row per head
    traces = [gqa_trace(), gqa_trace(heads=[0, 1, 2, 3])]
    assert traces[1]["K"].index == {"kv_head": [0, 0, 1, 1]}
    assert render.text(traces[1]) == render.text(traces[0])
    assert "Head 2 of 4 heads (key/value head 1 of 2)" in render.text(traces[0])


def test_markdown_and_latex_use_the_original_numbers() -> None:
    selected = gqa_trace(heads=[2], queries=[-1])
    markdown = render.markdown(selected)
    assert "Head 2 of 4 heads (key/value head 1 of 2)" in markdown
    assert re.search(r"^\| the#4 \|", markdown, re.M)
    assert "c_the#4 = " in markdown or "c_{\\text{the\\#4}}" in markdown
    latex = render.latex(selected)
    assert "Head 2 of 4 heads (key/value head 1 of 2)" in latex
    assert r"c_{\text{the\#4}}" in latex
    assert r"\text{the\#0}" not in latex.split("Attention scores")[1].split("&")[0]


def test_json_keeps_the_original_indices_and_renders_the_same_when_read_back() -> None:
    selected = gqa_trace(heads=[2, 3], queries=[-1])
    data = json.loads(render.json(selected))
    weights = next(s for s in data["steps"] if s["name"] == "weights")
    assert weights["index"] == {"head": [2, 3], "query": [4]}
    assert next(s for s in data["steps"] if s["name"] == "K")["index"] == {"kv_head": [1, 1]}
    back = Trace.from_json(render.json(selected))
    assert render.text(back) == render.text(selected)


def test_positions_label_the_query_when_there_are_no_tokens() -> None:
    text = render.text(gqa_trace(heads=[2], queries=[-1], tokens=False), width=80)
    assert "queries  recorded: rows t4" in text
    assert "\nt4 " in text and "c_t4 = " in text and "\nt0 " in text  # t0: a key, an embedding
    assert "c_t0" not in text


def test_a_selected_query_of_single_head_attention_keeps_its_projection_line() -> None:
    x = np.array([[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]])
    w_q = np.array([[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]])
    w_k = np.array([[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]])
    w_v = np.array([[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]])
    with qkv.tracing(queries=1) as t:
        qkv.self_attention(x, w_q, w_k, w_v)
    t.tokens = ["I", "love", "statistics"]
    text = render.text(t)
    # the seed's hand-checked numbers for "love", the 2nd token
    assert "q_love = x_love·W_q = [0.4000, 0.8000, 0.6000]·W_q = [0.5000, 0.8000]" in text
    assert "c_love = 0.3046·v_I + 0.3387·v_love + 0.3567·v_statistics = [0.5385, 0.8193]" in text


@settings(max_examples=20)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    picks=st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),
    rows=st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
)
def test_any_selection_shows_the_numbers_its_labels_name(
    kv_heads: int, picks: list[int], rows: list[int]
) -> None:
    rng = np.random.default_rng(kv_heads)
    x = rng.normal(size=(5, 4))
    w_q, w_o = rng.normal(size=(4, 8)), rng.normal(size=(8, 4))
    w_k, w_v = rng.normal(size=(4, 2 * kv_heads)), rng.normal(size=(4, 2 * kv_heads))
    narratives = []
    for heads, queries in ((None, None), (picks, rows)):
        with qkv.tracing(heads=heads, queries=queries) as t:
            qkv.multi_head_attention(
                x, w_q, w_k, w_v, w_o, num_heads=4, num_kv_heads=kv_heads, is_causal=True
            )
        t.tokens = list("abcde")
        narratives.append(render.narrate(t))
    whole, selected = narratives
    titles = [s.title for s in selected.sections if s.title and s.title.startswith("Head")]
    assert [int(t.split()[1]) for t in titles] == picks  # in the order asked for
    for title in titles:
        mine, theirs = section(selected, title), section(whole, title)
        assert mine["weights"].rows == tuple("abcde"[r] for r in rows)
        for label in mine["weights"].rows:
            for name in ("scores", "masked", "weights", "context"):
                assert_same_row(mine[name], theirs[name], label)
        np.testing.assert_allclose(mine["V"].values, theirs["V"].values)


def test_a_trace_built_by_hand_names_query_99_of_100_and_head_5() -> None:
    rng = np.random.default_rng(1)
    weights = rng.dirichlet(np.ones(100), size=(1, 1))  # (head, query, key)
    tokens = [f"w{i}" for i in range(100)]
    trace = Trace(tokens=tokens, meta={"num_heads": 8})
    trace.steps.append(
        Step("weights", weights, "A = softmax(S')", "", ("head", "query", "key"),
             index={"head": [5], "query": [99]})
    )  # fmt: skip
    narrative = render.narrate(trace)
    (head,) = [s for s in narrative.sections if s.title]
    assert head.title == "Head 5 of 8 heads"
    table = head.steps[0].table
    assert table is not None and table.rows == ("w99",) and table.columns[0] == "w0"
    assert "recorded: head 5" in render.text(trace)
    # without the number of heads, the head is still head 5
    trace.meta = {}
    assert [s.title for s in render.narrate(trace).sections if s.title] == ["Head 5"]


# -- pictures: heatmap and HTML page ----------------------------------------------------------


def test_heatmap_titles_heads_and_labels_rows_by_their_original_numbers(tmp_path: Path) -> None:
    selected = gqa_trace(heads=[2, 3], queries=[0, -1])
    path = tmp_path / "weights.svg"
    figure = render.heatmap(selected, path)
    panels = [ax for ax in figure.axes if ax.get_gid()]
    assert [ax.get_title() for ax in panels] == ["head 2", "head 3"]
    for ax in panels:
        assert [t.get_text() for t in ax.get_yticklabels()] == ["the#0", "the#4"]
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            "the#0", "cat", "sat", "on", "the#4"
        ]  # fmt: skip
    texts = svg_texts(path)
    assert "head 2" in texts and "head 3" in texts
    assert "head 0" not in texts and "head 1" not in texts
    # heads= names the recorded heads by their original numbers, as tracing(heads=...) did
    one = render.heatmap(selected, heads=[3])
    assert [ax.get_title() for ax in one.axes if ax.get_gid()] == ["head 3"]
    with pytest.raises(ValueError, match=r"heads: 0 is not a head of this trace; it recorded "
                       r"heads 2, 3 \(0-based\)"):  # fmt: skip
        render.heatmap(selected, heads=[0])


def test_heatmap_of_a_selected_row_of_a_long_sequence_names_its_token(tmp_path: Path) -> None:
    weights = np.random.default_rng(2).dirichlet(np.ones(100), size=(1, 1))
    trace = Trace(tokens=[f"w{i}" for i in range(100)], meta={"num_heads": 8})
    trace.steps.append(
        Step("weights", weights, "A", "", ("head", "query", "key"),
             index={"head": [5], "query": [99]})
    )  # fmt: skip
    path = tmp_path / "long.svg"
    figure = render.heatmap(trace, path)
    (ax,) = [ax for ax in figure.axes if ax.get_gid()]
    assert ax.get_title() == "head 5"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["w99"]
    assert "w99" in svg_texts(path) and "head 5" in svg_texts(path)


def test_html_page_selector_rows_and_query_menu_use_the_original_numbers() -> None:
    selected = gqa_trace(heads=[2, 3], queries=[1, -1])
    data = data_of(render.html(selected))
    (call,) = data["calls"]
    heads = [(s["title"], s["head"]) for s in call["sections"] if s["head"] is not None]
    assert heads == [
        ("Head 2 of 4 heads (key/value head 1 of 2)", 0),  # the page selects by position
        ("Head 3 of 4 heads (key/value head 1 of 2)", 1),
    ]
    for s in call["sections"]:
        for step in s["steps"]:
            if step.get("rowAxis") == "query":  # rows and the query menu
                assert data["labels"][step["rows"]] == ["cat", "the#4"]
            if step.get("colAxis") == "key":
                assert data["labels"][step["cols"]] == ["the#0", "cat", "sat", "on", "the#4"]
    facts = dict(call["facts"])
    assert facts["heads"].endswith("recorded: head 2 and head 3")
    assert facts["queries"] == "recorded: rows cat and the#4"
    # the query the page opens on: asked for by its original position, or by its token
    for wanted in ([4], ["the#4"], [-1]):
        selected.meta["queries"] = wanted
        assert page_data(selected)["calls"][0]["query"] == 1


# -- a model (qkv.nn, torch) and the command line ------------------------------------------------


class TwoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(TransformerBlock(16, 4, num_kv_heads=2) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, is_causal=True)
        return x


def model_traces() -> tuple[Trace, Trace]:
    """Layer blocks.1.attn of a model, whole and with heads [2] and queries [1, -1]."""
    model = TwoBlocks()
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1))
    traces = []
    for heads, queries in ((None, None), ([2], [1, -1])):
        with (
            torch.no_grad(),
            qkv.tracing(model=model, layers=-1, heads=heads, queries=queries) as t,
        ):
            model(x)
        traces.append(t)
    return traces[0], traces[1]


def test_a_selected_model_trace_shows_the_heads_and_rows_it_recorded() -> None:
    whole, selected = model_traces()
    assert selected["weights"].index == {"head": [2], "query": [1, 5]}
    title = "Head 2 of 4 heads (key/value head 1 of 2)"
    mine, theirs = section(render.narrate(selected), title), section(render.narrate(whole), title)
    assert mine["weights"].rows == ("t1", "t5")
    for label in ("t1", "t5"):
        for name in ("Q", "scores", "masked", "weights", "context"):
            assert_same_row(mine[name], theirs[name], label)
    np.testing.assert_allclose(mine["K"].values, theirs["K"].values, rtol=1e-6)
    text = render.text(selected)
    assert f"{title}" in text and "c_t5 = " in text and "c_t1 = " in text


def test_explain_trace_shows_the_original_heads_and_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, selected = model_traces()
    path = tmp_path / "trace.json"
    selected.save(path)
    out = tmp_path / "out.txt"
    assert main(["explain", "--trace", str(path), "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    words = " ".join(text.split())  # facts wrap at 80 columns
    assert "Head 2 of 4 heads (key/value head 1 of 2)" in text and "Head 0 of" not in text
    assert "recorded: head 2" in words
    assert "queries recorded: rows t1 and t5" in words
    assert "c_t5 = " in text and "\nt5 " in text
    # --query picks a recorded row by its original position, or by its label
    for query in ("5", "t5"):
        one = tmp_path / f"one-{query}.txt"
        assert main(["explain", "--trace", str(path), "--query", query, "-o", str(one)]) == 0
        shown = one.read_text(encoding="utf-8")
        assert "queries  t5 (1 of 2 shown); recorded: rows t1 and t5" in shown
        assert "c_t5 = " in shown and "c_t1 = " not in shown
    page = tmp_path / "page.html"
    assert main(["explain", "--trace", str(path), "--html", str(page), "-o", str(out)]) == 0
    (call,) = data_of(page.read_text(encoding="utf-8"))["calls"]
    assert [s["title"] for s in call["sections"] if s["head"] is not None] == [
        "Head 2 of 4 heads (key/value head 1 of 2)"
    ]
    capsys.readouterr()
