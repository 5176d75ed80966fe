"""The page of ``qkv patch --by position --html`` in a real browser: the heatmap of
``--by head`` with a row per head shown (``layer.head``) and a column per position, opened
on the cell with the largest effect; a click on a cell opens that head's steps on both
prompts. The page of ``--by head`` is tested in ``test_patch_page.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.cli import main
from tests.support.browser import Tab
from tests.support.flip_model import save_flip_model

TITLE = "document.querySelector('.detail h2').textContent"
PRESSED = (
    "[...document.querySelectorAll('table.heat button[aria-pressed=true]')]"
    ".map(b => b.dataset.row + '/' + b.dataset.col)"
)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_flip_model(tmp_path_factory.mktemp("flip") / "flip")
    target = folder.parent / "position.html"
    argv = ["patch", "--hf", str(folder), "--clean", "the cat sat on the", "--corrupt"]
    argv += ["the dog sat on the", "--answer", "mat", "--wrong", "house", "--by", "position"]
    assert main([*argv, "--layer", "0", "--positions", "1,4", "--html", str(target)]) == 0
    return target


def test_rows_are_heads_columns_positions_and_it_opens_on_the_largest_effect(
    tab: Tab, page: Path
) -> None:
    tab.open(page)
    assert tab.problems() == []
    headers = "[...document.querySelectorAll('table.heat th')].map(t => t.textContent)"
    assert tab.js(headers) == ["layer.head", "1 cat", "4 the", "0.0", "0.1", "0.2", "0.3"]
    assert tab.js("document.querySelectorAll('table.heat button').length") == 8
    assert tab.js(PRESSED) == ["0/1"]  # head 0 at the last token
    assert tab.js(TITLE) == "Layer 0 (model.layers.0.self_attn), head 0, 4 the"
    label = 'document.querySelector(\'button[data-row="0"][data-col="1"]\').ariaLabel'
    assert tab.js(label) == "layer 0 head 0, 4 the: logit_diff(mat − house) 5.5705"


def test_a_click_opens_that_heads_steps(tab: Tab, page: Path) -> None:
    tab.open(page)
    tab.js('document.querySelector(\'button[data-row="2"][data-col="0"]\').click()')
    tab.browser.pump(0.1)
    assert tab.js(PRESSED) == ["2/0"]
    assert tab.js(TITLE) == "Layer 0 (model.layers.0.self_attn), head 2, 1 cat"
    steps = "[...document.querySelectorAll('.detail .step')].map(s => s.dataset.step)"
    assert tab.js(steps) == ["Q", "K", "V", "scaled", "weights", "context"]
    assert tab.problems() == []
