"""The page's model view in a real browser: the page ``qkv explain --hf DIR --html`` writes
for a tiny saved model (``tests/support/hf_models.py``), opened from disk in headless
Chromium (fixtures in ``conftest.py``).

The grid has one map per layer and head; clicking a map, or the keyboard alone, switches the
head view and the step-by-step to that layer and head for the query selected; each map says
its numbers in its label; the page logs no error and requests nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qkv import examples, render
from qkv.cli import main
from tests.support.browser import Tab
from tests.support.hf_models import save_tiny

TEXT = "the cat sat on the mat and the dog ran"
WEIGHTS_TEXT = "document.querySelector('[data-step=weights] table').innerText"
LINE_WIDTHS = (
    "[...document.querySelectorAll('svg.lines line')].map(l => l.getAttribute('stroke-width'))"
)
SELECTED = (
    "[...document.querySelectorAll('.mv-grid [role=gridcell][aria-selected=true] .mv-map')]"
    ".map(b => b.dataset.call + '/' + b.dataset.head)"
)
VALUE = "document.getElementById({!r}).value"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama") / "tiny-llama"
    save_tiny("llama", folder)
    page = folder.parent / "model.html"
    argv = ["explain", "--hf", str(folder), "--text", TEXT, "--layer", "1", "--head", "2"]
    assert main([*argv, "--html", str(page)]) == 0
    return page


def test_the_grid_has_a_map_per_layer_and_head(tab: Tab, model_page: Path) -> None:
    tab.open(model_page)
    assert tab.problems() == []
    assert tab.js("document.querySelectorAll('.mv-grid [role=row]').length") == 3  # + header
    assert tab.js("document.querySelectorAll('.mv-map canvas').length") == 8  # 2 × 4
    layers = tab.js("[...document.querySelectorAll('.mv-layer')].map(e => e.textContent)")
    assert layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # the page opens on the layer and head asked for
    assert tab.js(SELECTED) == ["1/2"]
    assert tab.js(VALUE.format("qkv-layer")) == "1"
    assert tab.js(VALUE.format("qkv-head")) == "2"
    assert "Head 2 of 4 heads" in tab.js("document.querySelector('.steps').textContent")
    # ... and on the last token, the one a causal model predicts from
    query = VALUE.format("qkv-query")
    assert tab.js(query) == str(tab.js("document.getElementById('qkv-query').length") - 1)
    label = tab.js("document.querySelector('.mv-map').getAttribute('aria-label')")
    assert re.fullmatch(
        r"model\.layers\.0\.self_attn, Head 0 of 4 heads \(key/value head 0 of 2\): query ran "
        r"attends most to \S+ \(weight 0\.\d{4}\); largest share in the map \d\.\d{4}\.",
        label,
    ), label
    assert tab.js("document.querySelector('.mv-map').title") == label
    tab.screenshot(model_page.parent / "model-view.png")


def test_clicking_a_map_switches_the_head_view_and_the_matrix(tab: Tab, model_page: Path) -> None:
    tab.open(model_page)
    tab.choose("qkv-query", 5)  # the query "mat", kept across the switch
    weights, widths = tab.js(WEIGHTS_TEXT), tab.js(LINE_WIDTHS)
    tab.js('document.querySelector(\'.mv-map[data-call="0"][data-head="1"]\').click()')
    tab.browser.pump(0.1)
    assert tab.js(SELECTED) == ["0/1"]
    assert tab.js(VALUE.format("qkv-layer")) == "0"
    assert tab.js(VALUE.format("qkv-head")) == "1"
    assert tab.js(VALUE.format("qkv-query")) == "5"
    assert tab.js(WEIGHTS_TEXT) != weights
    assert tab.js(LINE_WIDTHS) != widths
    steps = tab.js("document.querySelector('.steps').textContent")
    assert "Head 1 of 4 heads" in steps and "Head 2 of 4 heads" not in steps
    label = tab.js("document.querySelector('.mv-map').getAttribute('aria-label')")
    assert "query mat attends most to" in label  # the labels follow the query selected
    # the selectors move the grid's mark too
    tab.choose("qkv-layer", 1)
    assert tab.js(SELECTED) == ["1/0"]
    assert tab.problems() == []


def test_the_keyboard_alone_moves_in_the_grid_and_selects(tab: Tab, model_page: Path) -> None:
    tab.open(model_page)
    for _ in range(12):  # Tab through the controls into the grid: one stop
        tab.press("Tab")
        if tab.js("document.activeElement.classList.contains('mv-map')"):
            break
    focused = "document.activeElement.dataset.call + '/' + document.activeElement.dataset.head"
    assert tab.js(focused) == "1/2"  # the grid's stop is the selected map
    tab.press("ArrowUp")
    assert tab.js(focused) == "0/2"
    weights = tab.js(WEIGHTS_TEXT)
    tab.press("Enter")
    assert tab.js(SELECTED) == ["0/2"]
    assert tab.js(VALUE.format("qkv-layer")) == "0"
    assert tab.js(WEIGHTS_TEXT) != weights
    tab.press("Tab")  # one stop: Tab leaves the grid
    assert not tab.js("document.activeElement.classList.contains('mv-map')")
    assert tab.problems() == []


def test_pages_without_a_model_have_no_grid(tab: Tab, tmp_path: Path) -> None:
    path = tmp_path / "two-heads.html"
    render.html(examples.run(examples.builtin("two-heads")), path)
    tab.open(path)
    assert tab.js("document.querySelector('.modelview') === null")
    assert tab.problems() == []


@pytest.fixture(scope="module")
def one_query_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page of issue 25: a grouped-query model (4 heads, 2 key/value heads) with one
    query row, ``--query cat``."""
    folder = tmp_path_factory.mktemp("llama-gqa") / "tiny-llama"
    save_tiny("llama", folder)
    page = folder.parent / "cat.html"
    argv = ["explain", "--hf", str(folder), "--text", TEXT, "--query", "cat"]
    assert main([*argv, "--html", str(page)]) == 0
    return page


def test_every_head_of_a_grouped_query_model_reads_its_context_vector(
    tab: Tab, one_query_page: Path
) -> None:
    """Heads 2 and 3 share key/value head 1: their context panel reads the weighted sum of
    that head's value vectors (it said "This trace has no context vectors" when the page gave
    them key/value head 0). The grid's columns are the heads' own numbers, from 0."""
    tab.open(one_query_page)
    assert tab.problems() == []
    headers = tab.js("[...document.querySelectorAll('.mv-head')].map(e => e.textContent)")
    assert headers == ["0", "1", "2", "3"]
    reading = "document.querySelector('.panel.reading').innerText"
    for layer in (0, 1):
        tab.choose("qkv-layer", layer)
        for head in range(4):
            tab.choose("qkv-head", head)
            text = tab.js(reading)
            assert "no context vectors" not in text, (layer, head)
            assert "The context vector of the query “cat”" in text, (layer, head)
            assert re.search(r"c_cat = 0\.\d{4}·v_the", text), (layer, head)
            steps = tab.js("document.querySelector('.steps').textContent")
            assert f"Head {head} of 4 heads (key/value head {head // 2} of 2)" in steps
    assert tab.problems() == []
