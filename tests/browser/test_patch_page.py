"""The page of ``qkv patch --html`` in a real browser: the heatmap has a cell per layer and
head, a click opens that head's steps on both prompts with their difference, the prompts'
text is shown as text, and the page logs no error and requests nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.cli import main
from tests.support.browser import Tab
from tests.support.flip_model import save_flip_model

CELLS = "document.querySelectorAll('table.heat button').length"
TITLE = "document.querySelector('.detail h2').textContent"
PRESSED = (
    "[...document.querySelectorAll('table.heat button[aria-pressed=true]')]"
    ".map(b => b.dataset.layer + '/' + b.dataset.head)"
)
CAPTIONS = "[...document.querySelectorAll('[data-step=weights] caption')].map(c => c.textContent)"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_flip_model(tmp_path_factory.mktemp("flip") / "flip")
    target = folder.parent / "patch.html"
    argv = ["patch", "--hf", str(folder), "--clean", "the cat sat on <b>x</b>"]
    argv += ["--corrupt", "the dog sat on <b>x</b>", "--answer", "mat", "--wrong", "house"]
    assert main([*argv, "--html", str(target)]) == 0
    return target


def test_the_heatmap_opens_on_the_head_with_the_largest_effect(tab: Tab, page: Path) -> None:
    tab.open(page)
    assert tab.problems() == []
    assert tab.js(CELLS) == 8  # 2 layers x 4 heads
    assert tab.js(PRESSED) == ["0/0"]
    assert tab.js(TITLE) == "Layer 0 (model.layers.0.self_attn), head 0"
    label = tab.js("document.querySelector('table.heat button').getAttribute('aria-label')")
    assert label == "layer 0 head 0: logit_diff(mat − house) 5.5705"
    assert tab.js(CAPTIONS) == ["clean", "corrupt", "clean − corrupt"]
    steps = tab.js("[...document.querySelectorAll('.detail .step')].map(s => s.dataset.step)")
    assert steps == ["Q", "K", "V", "scaled", "weights", "context"]


def test_a_click_opens_that_heads_steps_on_both_prompts(tab: Tab, page: Path) -> None:
    tab.open(page)
    context = "document.querySelector('[data-step=context]').textContent"
    before = tab.js(context)
    tab.js('document.querySelector(\'button[data-layer="1"][data-head="2"]\').click()')
    tab.browser.pump(0.1)
    assert tab.js(PRESSED) == ["1/2"]
    assert tab.js(TITLE) == "Layer 1 (model.layers.1.self_attn), head 2"
    assert tab.js(context) != before
    # the V of the animal differs between the prompts: the difference table says so
    diff = "document.querySelectorAll('[data-step=V] table')[2].innerText"
    assert "clean − corrupt" in tab.js(diff)
    assert tab.problems() == []


def test_the_prompts_text_is_text_never_html(tab: Tab, page: Path) -> None:
    tab.open(page)
    assert tab.js("document.querySelectorAll('#qkv-patch b').length") == 0
    summary = tab.js("document.querySelector('.summary').textContent")
    assert summary.startswith("clean: the cat sat on <b>x</b>")
    headers = "[...document.querySelectorAll('[data-step=weights] th')].map(t => t.textContent)"
    assert "[UNK]" in tab.js(headers)  # the tokenizer's own tokens label the rows


@pytest.fixture(scope="module")
def heads_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_flip_model(tmp_path_factory.mktemp("heads") / "flip")
    texts = folder.parent / "prompts.txt"
    texts.write_text("the cat sat on the mat\nthe dog ran to the house\n", encoding="utf-8")
    target = folder.parent / "heads.html"
    argv = ["heads", "--hf", str(folder), "--texts", str(texts), "--html", str(target)]
    assert main([*argv, "--induction-length", "8"]) == 0
    return target


def test_the_heads_page_has_a_heatmap_per_statistic(tab: Tab, heads_page: Path) -> None:
    tab.open(heads_page)
    assert tab.problems() == []
    tables = "[...document.querySelectorAll('table')].map(t => t.dataset.statistic)"
    assert tab.js(tables) == ["entropy", "sink", "previous", "diagonal", "induction"]
    # head 0 of layer 0 looks at the animal, or at the first token before one comes
    cell = "document.querySelector('table[data-statistic=entropy] tr:nth-child(2) td')"
    assert float(tab.js(cell + ".textContent")) < 0.5
    assert tab.js(cell + ".className") != ""
