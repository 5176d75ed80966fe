"""The HTML page in a real browser: Debian's Chromium, headless, driven over the DevTools
protocol through a pipe (``tests/support/browser.py``; fixtures in ``conftest.py``).

The page is opened from a ``file://`` path. Each test checks what a person would see or do:
no console error and no network request, hovering and keyboard focus move the highlight,
switching heads or layers changes the matrix, hostile tokens stay text, 512 tokens stay
responsive. A screenshot is saved under the test's temporary folder.

`make test` installs Chromium where it is missing; without it these tests FAIL (never skip).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qkv
from qkv import examples, render
from tests.support.browser import Tab

SCRIPT = '<script>alert("token")</script>'
IMAGE = '"><img src=x onerror="window.qkvInjected=1;alert(2)">'
SVG = "<svg onload=alert(3)>"

pytestmark = pytest.mark.slow


def hostile_trace() -> qkv.Trace:
    trace = examples.run(examples.builtin("two-heads"))
    trace.tokens = [SCRIPT, IMAGE, "like", "&amp; \u2028</script>"]
    trace.meta["name"] = f"{SVG} name"
    trace.meta["description"] = f"{IMAGE} description"
    return trace


def two_layer_trace() -> qkv.Trace:
    """A trace as a model gives it: two attention calls, each recorded with its layer."""
    rng = np.random.default_rng(6)
    trace = qkv.Trace(tokens=["the", "cat", "sat"])
    for index, layer in enumerate(["encoder.layers.0.attn", f"encoder.layers.1.{SVG}"]):
        scores = rng.normal(size=(2, 3, 3)) * (index + 1)
        weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
        trace.record(
            "scores", scores, formula="S = Q·Kᵀ", description="", axes=("head", "query", "key"),
            layer=layer,
        )  # fmt: skip
        trace.record(
            "weights", weights, formula="A = softmax(S)", description="",
            axes=("head", "query", "key"), layer=layer,
        )  # fmt: skip
    return trace


def write(tmp_path: Path, trace: qkv.Trace, name: str = "page.html", **options: Any) -> Path:
    path = tmp_path / name
    render.html(trace, path, **options)
    return path


LIT_LINES = (
    "[...document.querySelectorAll('svg.lines line.on')].map(l => l.dataset.q + '-' + l.dataset.k)"
)
LIT_CELLS = (
    "[...document.querySelectorAll('[data-step=weights] tr')]"
    ".map((tr, i) => [...tr.children].some(c => c.classList.contains('on')) ? i : -1)"
    ".filter(i => i >= 0)"
)
LINE_WIDTHS = (
    "[...document.querySelectorAll('svg.lines line')].map(l => l.getAttribute('stroke-width'))"
)
LOWEST_CONTRAST = """(() => {
  const lum = (css) => {
    const rgb = css.match(/[\\d.]+/g).slice(0, 3).map((c) => Number(c) / 255);
    const lin = rgb.map((c) => (c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4)));
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2];
  };
  const ratios = [...document.querySelectorAll("table.matrix td, table.matrix th")]
    .filter((cell) => cell.textContent)
    .map((cell) => {
      const style = getComputedStyle(cell);
      const [a, b] = [lum(style.color), lum(style.backgroundColor)];
      return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    });
  return [ratios.length, Math.min(...ratios)];
})()"""
WEIGHTS_TEXT = "document.querySelector('[data-step=weights] table').innerText"


def test_page_opens_from_disk_with_no_error_and_no_request(tab: Tab, tmp_path: Path) -> None:
    path = write(tmp_path, examples.run(examples.builtin("two-heads")))
    tab.open(path)
    assert tab.problems() == []
    assert tab.js("document.querySelector('h1').textContent") == "Time flies like arrows"
    titles = tab.js("[...document.querySelectorAll('.step h3')].map(h => h.textContent)")
    assert "Step 10. Attention weights" in titles and "Step 11. Context vectors" in titles
    assert tab.js("document.querySelectorAll('.hv-col.q .tok').length") == 4
    assert tab.js("document.querySelectorAll('svg.lines line').length") == 16
    reading = tab.js("document.querySelector('.reading .eq').textContent")
    assert reading.startswith("c_time = ") and "·v_flies" in reading
    cells, contrast = tab.js(LOWEST_CONTRAST)
    assert cells > 100 and contrast >= 4.5  # WCAG AA for the numbers on coloured cells
    shot = tab.screenshot(tmp_path / "two-heads.png")
    assert shot.startswith(b"\x89PNG") and (tmp_path / "two-heads.png").stat().st_size > 10_000


def test_hovering_a_token_moves_the_highlight(tab: Tab, tmp_path: Path) -> None:
    tab.open(write(tmp_path, examples.run(examples.builtin("two-heads"))))
    tab.hover(".hv-col.q .tok[data-index='1']")
    lines, cells = tab.js(LIT_LINES), tab.js(LIT_CELLS)
    assert sorted(lines) == ["1-0", "1-1", "1-2", "1-3"]
    assert cells == [2]  # row 0 is the header; query 1 is row 2
    reading = tab.js("document.querySelector('.reading .eq').textContent")
    assert reading.startswith("c_flies = ")

    tab.hover(".hv-col.q .tok[data-index='3']")
    assert sorted(tab.js(LIT_LINES)) == ["3-0", "3-1", "3-2", "3-3"]
    assert tab.js(LIT_CELLS) == [4]

    tab.hover(".hv-col.k .tok[data-index='2']")  # a key: who attends to it
    assert sorted(tab.js(LIT_LINES)) == ["0-2", "1-2", "2-2", "3-2"]
    column = tab.js(
        "[...document.querySelectorAll('[data-step=weights] td.on')].map(td => td.cellIndex)"
    )
    assert set(column) == {3} and len(column) == 4
    assert tab.problems() == []


def test_the_keyboard_alone_reaches_and_selects_a_query(tab: Tab, tmp_path: Path) -> None:
    tab.open(write(tmp_path, examples.run(examples.builtin("the-cat-sat-on-the-mat"))))
    for _ in range(8):  # Tab through the controls to the query tokens
        tab.press("Tab")
        if tab.js("document.activeElement.dataset.axis || ''") == "query":
            break
    assert tab.js("document.activeElement.dataset.axis") == "query"
    start = int(tab.js("document.activeElement.dataset.index"))
    tab.press("ArrowDown")
    assert tab.js("document.activeElement.dataset.index") == str(start + 1)
    assert {line.split("-")[0] for line in tab.js(LIT_LINES)} == {str(start + 1)}
    tab.press("Enter")
    assert tab.js("document.getElementById('qkv-query').value") == str(start + 1)
    assert tab.js("document.activeElement.getAttribute('aria-pressed')") == "true"
    assert tab.problems() == []


def test_switching_heads_changes_the_matrix_and_the_lines(tab: Tab, tmp_path: Path) -> None:
    tab.open(write(tmp_path, examples.run(examples.builtin("two-heads"))))
    assert tab.js("document.getElementById('qkv-head').closest('label').hidden") is False
    weights = tab.js(WEIGHTS_TEXT)
    widths = tab.js(LINE_WIDTHS)
    tab.choose("qkv-head", 1)
    assert tab.js(WEIGHTS_TEXT) != weights
    assert tab.js("document.querySelector('.section-title:nth-of-type(2)') !== null")
    assert "Head 1 of 2 heads" in tab.js("document.querySelector('.steps').textContent")
    assert "Head 0 of 2 heads" not in tab.js("document.querySelector('.steps').textContent")
    other = tab.js(LINE_WIDTHS)
    assert other != widths
    tab.choose("qkv-head", 0)
    assert tab.js(WEIGHTS_TEXT) == weights
    assert tab.problems() == []


def test_a_trace_of_several_layers_gets_a_layer_selector(tab: Tab, tmp_path: Path) -> None:
    tab.open(write(tmp_path, two_layer_trace()))
    options = tab.js("[...document.getElementById('qkv-layer').options].map(o => o.textContent)")
    assert options == ["encoder.layers.0.attn", f"encoder.layers.1.{SVG}"]
    assert tab.js("document.getElementById('qkv-layer').closest('label').hidden") is False
    first = tab.js(WEIGHTS_TEXT)
    tab.choose("qkv-layer", 1)
    assert tab.js(WEIGHTS_TEXT) != first
    tab.choose("qkv-head", 1)
    assert tab.js(WEIGHTS_TEXT) != first
    assert tab.js("document.querySelectorAll('svg, img').length") == 1  # the head view's only
    assert tab.problems() == []


def test_hostile_tokens_and_names_stay_text(tab: Tab, tmp_path: Path) -> None:
    tab.open(write(tmp_path, hostile_trace()))
    tab.hover(".hv-col.q .tok[data-index='1']")
    tab.hover(".hv-col.k .tok[data-index='0']")
    tab.choose("qkv-head", 1)
    tab.browser.pump(0.3)
    assert tab.problems() == []  # no alert, no request for "x", no error
    assert tab.events("Page.javascriptDialogOpening") == []
    assert tab.js("window.qkvInjected === undefined")
    assert tab.js("document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert tab.js("document.scripts.length") == 2  # the data block and qkv's own script
    assert tab.js("document.querySelector('h1').textContent") == f"{SVG} name"
    tokens = tab.js("[...document.querySelectorAll('.hv-col.q .tok .t')].map(t => t.textContent)")
    assert tokens == [SCRIPT, IMAGE, "like", "&amp; \u2028</script>"]
    assert SCRIPT in tab.js("document.body.innerText")
    tab.screenshot(tmp_path / "hostile.png")


def test_512_tokens_stay_responsive(tab: Tab, tmp_path: Path) -> None:
    rng = np.random.default_rng(512)
    x = rng.normal(size=(512, 16))
    w_q, w_k, w_v, w_o = (rng.normal(size=(16, 16)) / 2 for _ in range(4))
    with qkv.tracing() as trace:
        qkv.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=2)
    trace.tokens = [f"w{i}" for i in range(512)]
    path = write(tmp_path, trace, steps=("Q", "K", "V", "weights", "context"))
    seconds = tab.open(path)
    assert tab.problems() == []
    lines = tab.js("document.querySelectorAll('svg.lines line').length")
    assert 0 < lines < 6000, lines  # only the tokens in view, not 512 × 512
    assert tab.js("document.querySelectorAll('[data-step=weights] canvas').length") == 1
    assert tab.js("document.querySelectorAll('td').length") < 200
    tab.js("document.querySelector('.hv-scroll').scrollTop = 400 * 22")
    tab.browser.pump(0.2)
    queries = tab.js(
        "[...document.querySelectorAll('svg.lines line')].map(l => Number(l.dataset.q))"
    )
    assert max(queries) >= 400
    tab.hover(".hv-col.q .tok[data-index='410']")
    assert {line.split("-")[0] for line in tab.js(LIT_LINES)} == {"410"}
    assert tab.js("document.querySelector('.reading .eq').textContent").startswith("c_w410 = ")
    tab.screenshot(tmp_path / "long.png")
    print(f"512 tokens: {path.stat().st_size / 1e6:.1f} MB page, opened in {seconds:.2f} s")
