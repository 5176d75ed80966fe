"""The page of ``qkv explain --tiled --html`` in a real browser: the tiles as a grid of query
blocks × key blocks, lit as the forward pass visits them (buttons and arrow keys), the
selected tile's numbers, the backward of one key block, and tokens shown as text."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.cli import main
from tests.support.browser import Tab

CELLS = "[...document.querySelectorAll('table.grid button')].map(b => b.textContent)"
VISITED = "document.querySelectorAll('table.grid button.visited').length"
CURRENT = (
    "[...document.querySelectorAll('table.grid button')]"
    ".findIndex(b => b.getAttribute('aria-current') === 'step')"
)
WHERE = "document.querySelector('.where').textContent"
CAPTIONS = "[...document.querySelectorAll('section table.matrix caption')].map(c => c.textContent)"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("tiled") / "tiles.html"
    argv = ["explain", "--tiled", "--example", "two-heads", "--causal", "--html", str(target)]
    assert main(argv) == 0
    return target


def test_the_grid_lights_the_tiles_as_they_are_visited(tab: Tab, page: Path) -> None:
    tab.open(page)
    assert tab.problems() == []
    assert tab.js(CELLS) == ["masked", "skipped", "full", "masked"]
    assert tab.js(VISITED) == 1 and tab.js(CURRENT) == 0
    assert tab.js(WHERE).startswith("Tile 1 of 4: query block 0 (time, flies) × key block 0")
    assert "S' (scaled scores)" in tab.js(CAPTIONS)
    tab.js("document.getElementById('qkv-next').click()")
    tab.browser.pump(0.05)
    assert tab.js(VISITED) == 2 and tab.js(CURRENT) == 1
    assert "skipped" in tab.js(WHERE)
    assert "nothing is computed" in tab.js("document.querySelector('section').textContent")


def test_the_arrow_keys_move_through_the_tiles(tab: Tab, page: Path) -> None:
    tab.open(page)
    tab.js("document.querySelector('table.grid button').focus()")
    tab.press("ArrowDown")
    tab.press("ArrowDown")
    assert tab.js(CURRENT) == 2 and tab.js(VISITED) == 3
    assert tab.js("document.activeElement.getAttribute('aria-current')") == "step"
    tab.press("ArrowUp")
    assert tab.js(CURRENT) == 1
    assert tab.problems() == []


def test_a_tile_shows_its_numbers_and_the_backward(tab: Tab, page: Path) -> None:
    tab.open(page)
    tab.js("document.querySelectorAll('table.grid button')[3].click()")
    tab.browser.pump(0.05)
    captions = tab.js(CAPTIONS)
    for caption in ("P̃ = exp(S' − m_new)", "row by row", "O before", "O after"):
        assert caption in captions
    for caption in ("O = O_acc / l", "log-sum-exp", "D", "dS", "dK of the block"):
        assert caption in captions
    cells = tab.js("[...document.querySelectorAll('td')].map(td => td.textContent)")
    assert cells and not any("NaN" in cell for cell in cells)
    assert "Backward of key block 0" in tab.js("document.getElementById('qkv-tiled').textContent")
    tab.choose("qkv-head", 1)
    tab.browser.pump(0.05)
    assert tab.js(CURRENT) == 0
    assert tab.problems() == []


def test_tokens_are_text(tab: Tab, tmp_path: Path) -> None:
    example = tmp_path / "evil.yaml"
    example.write_text(
        "format: 2\ntokens: ['<img src=x onerror=alert(1)>', b, c]\ninputs:\n"
        "  Q: [[1, 0], [0, 1], [1, 1]]\n  K: [[1, 0], [0, 1], [1, 1]]\n"
        "  V: [[1, 2], [3, 4], [5, 6]]\n",
        encoding="utf-8",
    )
    target = tmp_path / "evil.html"
    assert main(["explain", "--tiled", "--example", str(example), "--html", str(target)]) == 0
    tab.open(target)
    assert tab.js("document.querySelectorAll('img').length") == 0
    assert "<img src=x onerror=alert(1)>" in tab.js(WHERE)
    assert tab.problems() == []
