"""The page's new controls with the keyboard alone, in a phone-wide window, and with hostile
token text, in a real browser.

Peer expectations ported (in our words, no code copied): WCAG 2.2 success criteria 2.1.1
(every function from a keyboard), 1.4.10 (reflow: no scrolling in two directions at 320 CSS
px wide content; we test 390 px, a common phone), 1.4.1 (colour is not the only means of
conveying information) and 1.4.3 (contrast of at least 4.5:1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv import examples, render
from tests.browser.lab_helpers import edited, page_steps, python_steps
from tests.browser.test_browser import IMAGE, SCRIPT, hostile_trace
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

KEYS: dict[str, tuple[str, int, str]] = {  # key: (code, virtual key code, text)
    "Tab": ("Tab", 9, ""),
    "Enter": ("Enter", 13, "\r"),
    " ": ("Space", 32, " "),
    "ArrowDown": ("ArrowDown", 40, ""),
}


def key(tab: Tab, name: str) -> None:
    """Press one key as a keyboard does (keyDown with its text, then keyUp)."""
    code, number, text = KEYS.get(name, (f"Digit{name}" if name.isdigit() else name, 0, name))
    down: dict[str, Any] = {"type": "keyDown", "key": name, "code": code}
    if number:
        down["windowsVirtualKeyCode"] = number
    if text:
        down["text"] = text
    tab.call("Input.dispatchKeyEvent", down)
    tab.call("Input.dispatchKeyEvent", {"type": "keyUp", "key": name, "code": code})
    tab.browser.pump(0.02)


def tab_to(tab: Tab, test: str, most: int = 80) -> None:
    """Press Tab until ``test`` (a JS expression on ``document.activeElement``) holds."""
    for _ in range(most):
        if tab.js(f"(() => {{ const e = document.activeElement; return Boolean({test}); }})()"):
            return
        key(tab, "Tab")
    raise AssertionError(f"Tab never reached an element where {test}")


def test_the_new_controls_work_with_the_keyboard_alone(tab: Tab, tmp_path: Path) -> None:
    example = examples.builtin("two-heads")
    path = tmp_path / "two-heads.html"
    render.html(examples.run(example), path)
    tab.open(path)
    tab_to(tab, "e.id === 'qkv-edit'")
    key(tab, "Enter")
    assert tab.js("document.getElementById('qkv-edit').getAttribute('aria-pressed')") == "true"
    key(tab, "Tab")
    assert tab.js("document.activeElement.id") == "qkv-scale"
    key(tab, "ArrowDown")  # ÷ √d_k → none
    assert tab.js("qkvPage.lab.options().scale") == "none"
    key(tab, "Tab")
    assert tab.js("document.activeElement.id") == "qkv-causal"
    key(tab, " ")
    assert tab.js("qkvPage.lab.options().causal") is True
    # The score's key (in the side column, before the steps).
    tab_to(tab, "e.id === 'qkv-sum-key'")
    key(tab, "ArrowDown")
    assert tab.js("document.getElementById('qkv-sum-key').value") == "1"
    # Into the first input cell (embeddings, time, e1); Tab selects its text, typing replaces.
    tab_to(tab, "e.dataset.edit === 'embeddings:0:0:0'")
    for char in "-0.5":
        key(tab, char)
    assert tab.js("document.activeElement.value") == "-0.5"
    python = python_steps(
        edited(example, "embeddings", 0, 0, -0.5), heads=2, scale="none", causal=True
    )
    page = page_steps(tab)
    assert np.max(np.abs(page[("weights", 1)] - python[("weights", 1)])) <= 1e-12
    # The panels below the steps: the decode steps, new random numbers for √d_k.
    tab_to(tab, "e.id === 'qkv-decode-next'", most=200)
    key(tab, "Enter")
    key(tab, "Enter")
    assert tab.js("qkvPage.decode.current().position") == 2
    tab_to(tab, "e.id === 'qkv-sqrt-again'")
    key(tab, "Enter")
    assert tab.js("document.querySelector('.sqrt-dk').dataset.seed") == "2"
    tab_to(tab, "e.id === 'qkv-reset'", most=200)
    key(tab, "Enter")
    assert tab.js("qkvPage.edited()") is False
    assert tab.problems() == []


def test_the_page_fits_a_phone_wide_window(tab: Tab, tmp_path: Path) -> None:
    tab.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True},
    )
    path = tmp_path / "two-heads.html"
    render.html(examples.run(examples.builtin("two-heads")), path)
    tab.open(path)
    widths = "[document.documentElement.scrollWidth, document.body.scrollWidth, innerWidth]"
    page, body, window = tab.js(widths)
    assert window == 390 and page <= window and body <= window, (page, body)
    tab.js("document.getElementById('qkv-edit').click()")
    tab.js("qkvPage.lab.setOptions({causal: true})")
    tab.js("qkvPage.decode.go(3)")
    page, body, window = tab.js(widths)
    assert page <= window and body <= window, (page, body)
    # Every panel stays inside the window (wide tables scroll inside their own box).
    rights = tab.js(
        "[...document.querySelectorAll('.panel, .step')].map(p => p.getBoundingClientRect().right)"
    )
    assert rights and max(rights) <= 390
    tab.screenshot(tmp_path / "phone.png")
    assert tab.problems() == []


def test_hostile_tokens_stay_text_in_the_new_views(tab: Tab, tmp_path: Path) -> None:
    path = tmp_path / "hostile.html"
    render.html(hostile_trace(), path)
    tab.open(path)
    tab.js("document.getElementById('qkv-edit').click()")
    tab.js(
        "(() => { const e = document.querySelector(\"input[data-edit='embeddings:0:1:1']\");"
        " e.value = '3'; e.dispatchEvent(new Event('input')); })()"
    )
    tab.js("qkvPage.decode.go(3)")
    tab.choose("qkv-sum-key", 1)
    tab.choose("qkv-heads", 1)
    tab.browser.pump(0.3)
    assert tab.problems() == []
    assert tab.events("Page.javascriptDialogOpening") == []
    assert tab.js("window.qkvInjected === undefined")
    assert tab.js("document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert tab.js("document.scripts.length") == 2
    decode = tab.js("document.querySelector('.decode').innerText")
    assert SCRIPT in decode and IMAGE in decode
    assert f"k_{IMAGE}" in tab.js("document.querySelector('.sums .eq').textContent")
    labels = tab.js(
        "[...document.querySelectorAll('input.cell-edit')].map(i => i.getAttribute('aria-label'))"
    )
    assert any(SCRIPT in label for label in labels)


def test_inputs_and_panels_keep_contrast(tab: Tab, tmp_path: Path) -> None:
    path = tmp_path / "two-heads.html"
    render.html(examples.run(examples.builtin("two-heads")), path)
    tab.open(path)
    tab.js("document.getElementById('qkv-edit').click()")
    ratios = tab.js(
        """(() => {
      const lum = (css) => {
        const rgb = css.match(/[\\d.]+/g).slice(0, 3).map((c) => Number(c) / 255);
        const lin = rgb.map((c) => (c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4)));
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2];
      };
      const back = (e) => {
        for (let n = e; n; n = n.parentElement) {
          const c = getComputedStyle(n).backgroundColor;
          if (c && !c.startsWith('rgba(0, 0, 0, 0)')) return c;
        }
        return 'rgb(255, 255, 255)';
      };
      const nodes = [...document.querySelectorAll(
        'input.cell-edit, .lab button, .lab label, .sums td, .sums th, .decode td, ' +
        '.decode th, .sqrt-dk td, .sqrt-dk th, .note')];
      return nodes.filter((e) => (e.value || e.textContent).trim()).map((e) => {
        const a = lum(getComputedStyle(e).color), b = lum(back(e));
        return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
      });
    })()"""
    )
    assert len(ratios) > 50 and min(ratios) >= 4.5, min(ratios)
    assert tab.problems() == []
