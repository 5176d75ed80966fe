"""Practice mode in a real browser: a learner types rows and the page names the slip.

Headless Chromium (``tests/support/browser.py``) opens a practice page from disk. The rows
typed are those a learner would write: the correct one, one left unscaled, one normalised by
the sum instead of the softmax, one normalised down the columns, one with an arithmetic
mistake, and a correct step on a slipped earlier row. Each is checked for the slip the page
names, in words. Typing goes through the keyboard (DevTools ``Input.insertText`` and key
events); progress survives a reload; nothing is requested from the network.

The expected slips are those ``qkv check`` names (docs/check.md); the rows are made here with
its pipeline (``qkv.check._pipeline.forward``), not read back from the page.

Regenerate the README's screenshot with
``.venv/bin/python -m tests.browser.test_practice docs/img/practice.png``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from qkv import examples, render
from qkv.attention import softmax
from qkv.check import check
from qkv.check._pipeline import Setup, Slip, forward
from qkv.examples import Claimed
from qkv.render._practice import practice_data
from tests.support.browser import CHROMIUM, Browser, Tab

pytestmark = pytest.mark.slow

SCRIPT = '<script>alert("token")</script>'
IMAGE = '"><img src=x onerror="window.qkvInjected=1;alert(2)">'
SVG = "<svg onload=alert(3)>"
EXAMPLE = "i-love-statistics"


def practice_page(folder: Path, example: examples.Example | None = None) -> Path:
    example = example or examples.builtin(EXAMPLE)
    path = folder / "practice.html"
    render.html(examples.run(example), path, practice=practice_data(example))
    return path


def fresh(tab: Tab, path: Path) -> None:
    """Open the page with nothing saved: the browser of this module keeps local storage, and
    every page of this example shares its key (progress belongs to the exercise)."""
    tab.open(path)
    tab.js("localStorage.clear()")
    tab.open(path)


def numbers(row: np.ndarray, decimals: int = 4) -> list[str]:
    return [f"{float(x):.{decimals}f}" for x in row]


def row_selector(key: str, t: int) -> str:
    return f'[data-practice="{key}"] tr[data-row="{t}"]'


def enter_row(tab: Tab, key: str, t: int, texts: list[str]) -> str:
    """Type a row as a learner does: each number into its cell (Tab to the next), then
    Enter; return what the page says about it."""
    first = json.dumps(row_selector(key, t) + " input")
    tab.js(f"(() => {{ const i = document.querySelector({first}); i.focus(); i.select(); }})()")
    for k, text in enumerate(texts):
        if k:
            tab.press("Tab")
            tab.js("document.activeElement.select()")
        tab.call("Input.insertText", {"text": text})
    tab.press("Enter")
    return verdict(tab, key, t)


def verdict(tab: Tab, key: str, t: int) -> str:
    selector = json.dumps(row_selector(key, t) + " + tr .practice-verdict")
    return str(tab.js(f"document.querySelector({selector}).textContent"))


@pytest.fixture
def setup() -> Setup:
    return Setup.of(examples.builtin(EXAMPLE))


def test_a_practice_run_names_each_slip(tab: Tab, tmp_path: Path, setup: Setup) -> None:
    fresh(tab, practice_page(tmp_path))
    assert tab.js("document.querySelectorAll('.practice-step').length") == 7
    right = forward(setup)["weights"][0, 1]
    said = enter_row(tab, "weights", 1, numbers(right))
    assert said.startswith("✓ Right")
    unscaled = forward(setup, Slip("unscaled"))["weights"][0, 1]
    said = enter_row(tab, "weights", 1, numbers(unscaled))
    assert said.startswith("✗ Slip: unscaled") and "√d_k = √2" in said
    wrong_axis = forward(setup, Slip("softmax-wrong-axis"))["weights"][0, 1]
    said = enter_row(tab, "weights", 1, numbers(wrong_axis))
    assert said.startswith("✗ Slip: softmax-wrong-axis") and "over the queries" in said
    said = enter_row(tab, "weights", 1, ["0.5", "0.2", "0.3"])
    assert said.startswith("✗ Arithmetic") and "Off: I = 0.5, love = 0.2." in said
    # the correct row on request, as qkv check says it
    button = json.dumps(row_selector("weights", 1) + " + tr .practice-show-row")
    tab.js(f"document.querySelector({button}).click()")
    answer = json.dumps(row_selector("weights", 1) + " + tr .practice-answer")
    shown = tab.js(f"(() => {{ const a = document.querySelector({answer}); "
                   "return a.hidden ? null : a.textContent; })()")  # fmt: skip
    assert shown is not None and shown.endswith("[0.3046, 0.3387, 0.3567].")
    # the symbol and the word say it, not only the colour; the wrong cells are marked
    invalid = tab.js(f"[...document.querySelectorAll({json.dumps(row_selector('weights', 1))} "
                     "+ ' input')].map(i => i.getAttribute('aria-invalid'))")  # fmt: skip
    assert invalid.count("true") >= 1
    assert tab.problems() == []


def test_a_row_normalised_by_the_sum_is_named(tab: Tab, tmp_path: Path, setup: Setup) -> None:
    fresh(tab, practice_page(tmp_path))
    scaled = forward(setup)["scaled"][0, 1]
    said = enter_row(tab, "weights", 1, numbers(scaled / scaled.sum()))
    assert said.startswith("✗ Slip: sum-normalised"), said
    assert tab.problems() == []


def test_a_correct_step_on_a_slipped_row_is_consequential(
    tab: Tab, tmp_path: Path, setup: Setup
) -> None:
    fresh(tab, practice_page(tmp_path))
    slipped = forward(setup, Slip("unscaled"))
    said = enter_row(tab, "scaled", 1, numbers(slipped["scaled"][0, 1]))
    assert said.startswith("✗ Slip: unscaled")
    # the learner's own unscaled row, carried on correctly, rounded to 2 decimals first
    mine = np.round(slipped["scaled"][0, 1], 2)
    enter_row(tab, "scaled", 1, numbers(mine, 2))
    said = enter_row(tab, "weights", 1, numbers(softmax(mine), 3))
    assert said.startswith("↪ Follows from your earlier numbers"), said
    assert "scaled scores of “love”" in said or 'scaled scores of "love"' in said
    assert tab.problems() == []


def test_rounding_carried_from_the_learners_own_rows_is_allowed(
    tab: Tab, tmp_path: Path, setup: Setup
) -> None:
    """Weights worked from scaled scores rounded to 2 decimals are right, as qkv check says
    of the same two printed rows; without those rows typed, the same weights are off."""
    fresh(tab, practice_page(tmp_path))
    mine = np.round(forward(setup)["scaled"][0, 1], 2)
    weights = numbers(softmax(mine), 4)
    assert enter_row(tab, "weights", 1, weights).startswith("✗")
    assert enter_row(tab, "scaled", 1, numbers(mine, 2)).startswith("✓ Right")
    assert enter_row(tab, "weights", 1, weights).startswith("✓ Right")
    rows = {"scaled": (numbers(mine, 2)), "weights": weights}
    claimed = {
        step: {1: Claimed(values=tuple(map(float, texts)), texts=tuple(texts))}
        for step, texts in rows.items()
    }
    example = dataclasses.replace(examples.builtin(EXAMPLE), claimed=claimed)
    assert [f.status for f in check(example).findings] == ["ok", "ok"]
    assert tab.problems() == []


def test_two_heads_name_the_slip_of_a_head_and_of_the_concat(tab: Tab, tmp_path: Path) -> None:
    example = examples.builtin("two-heads")
    two = Setup.of(dataclasses.replace(example, format=2))
    fresh(tab, practice_page(tmp_path, example))
    keys = tab.js("[...document.querySelectorAll('.practice-step')].map(s => s.dataset.practice)")
    assert keys[3:] == [
        "scores/0", "scaled/0", "weights/0", "scores/1", "scaled/1", "weights/1", "context",
        "output",
    ]  # fmt: skip
    unscaled = forward(two, Slip("unscaled"))["weights"][1, 2]  # head 2, "like"
    assert enter_row(tab, "weights/1", 2, numbers(unscaled)).startswith("✗ Slip: unscaled")
    right = forward(two)["context"][1]
    assert enter_row(tab, "context", 1, numbers(right)).startswith("✓ Right")
    slipped = forward(two, Slip("unscaled"))  # both heads unscaled, then a right concat
    for h in (0, 1):
        enter_row(tab, f"weights/{h}", 1, numbers(slipped["weights"][h, 1]))
    said = enter_row(tab, "context", 1, numbers(slipped["context"][1]))
    assert said.startswith("↪ Follows from your earlier numbers"), said
    averaged = forward(two, Slip("heads-averaged"))["context"][1]
    said = enter_row(tab, "context", 1, numbers(averaged))
    assert said.startswith("✗ Slip: heads-averaged"), said
    assert tab.problems() == []


def test_keyboard_only(tab: Tab, tmp_path: Path) -> None:
    fresh(tab, practice_page(tmp_path))
    label = "document.activeElement.getAttribute('aria-label')"
    for _ in range(40):
        tab.press("Tab")
        if tab.js(label) == "Query vectors, I, d1":
            break
    assert tab.js(label) == "Query vectors, I, d1"
    tab.call("Input.insertText", {"text": "0.47"})
    tab.press("Tab")
    tab.call("Input.insertText", {"text": "0.68"})
    tab.press("Enter")
    assert verdict(tab, "Q", 0).startswith("✓ Right")
    assert tab.js(label) == "Query vectors, love, d1"  # on to the next row
    # the toggle, by keyboard: back to the explanation and again to practice
    tab.js("document.getElementById('qkv-practice-toggle').focus()")
    tab.press("Enter")
    assert tab.js("document.querySelector('section.practice').hidden") is True
    assert tab.js("document.querySelector('.layout').hidden") is False
    assert (
        tab.js("document.getElementById('qkv-practice-toggle').getAttribute('aria-pressed')")
        == "false"
    )
    tab.press("Enter")
    assert tab.js("document.querySelector('section.practice').hidden") is False
    assert tab.problems() == []


def test_progress_is_kept_for_that_page(tab: Tab, tmp_path: Path, setup: Setup) -> None:
    path = practice_page(tmp_path)
    fresh(tab, path)
    unscaled = forward(setup, Slip("unscaled"))["scaled"][0, 1]
    enter_row(tab, "scaled", 1, numbers(unscaled))
    tab.js("document.querySelector('[data-practice=\"K\"] .practice-reveal').click()")
    data = practice_data(examples.builtin(EXAMPLE))
    stored = tab.js(f"localStorage.getItem({json.dumps('qkv-practice:' + data['id'])})")
    assert stored is not None and numbers(unscaled)[0] in stored
    tab.open(path)  # a reload: the numbers, the verdict and the shown step come back
    first = json.dumps(row_selector("scaled", 1) + " input")
    assert tab.js(f"document.querySelector({first}).value") == numbers(unscaled)[0]
    assert verdict(tab, "scaled", 1).startswith("✗ Slip: unscaled")
    assert tab.js("document.querySelectorAll('.practice-says').length") == 1
    assert tab.js("document.querySelectorAll('.practice-progress')[0].textContent") == (
        "0 of 21 rows right."
    )
    tab.js("[...document.querySelectorAll('.practice-bar button')][0].click()")  # start again
    assert tab.js(f"document.querySelector({first}).value") == ""
    assert tab.problems() == []


@pytest.mark.parametrize(
    "stored",
    [
        "not JSON",
        '{"typed": {"Q": {"0": "<img src=x onerror=alert(1)>"}, "weights": {"1": [1, {}]}},'
        ' "revealed": {"K": "yes", "__proto__": true}}',
    ],
)
def test_a_stored_value_that_is_not_the_pages_is_ignored(
    tab: Tab, tmp_path: Path, stored: str
) -> None:
    path = practice_page(tmp_path)
    key = "qkv-practice:" + practice_data(examples.builtin(EXAMPLE))["id"]
    fresh(tab, path)
    tab.js(f"localStorage.setItem({json.dumps(key)}, {json.dumps(stored)})")
    tab.open(path)
    assert tab.js("[...document.querySelectorAll('.practice-rows input')].every(i => !i.value)")
    assert tab.js("document.querySelectorAll('.practice-reveal:disabled').length") == 0
    assert tab.js("document.querySelector('.practice-progress').textContent") == (
        "0 of 21 rows right."
    )
    enter_row(tab, "Q", 0, ["0.47", "0.68"])  # and saving works again
    assert "0.47" in tab.js(f"localStorage.getItem({json.dumps(key)})")
    assert tab.problems() == []


def test_show_me_reveals_one_step(tab: Tab, tmp_path: Path) -> None:
    fresh(tab, practice_page(tmp_path))
    tab.js("document.querySelector('[data-practice=\"scores\"] .practice-reveal').click()")
    shown = tab.js("[...document.querySelectorAll('.practice-says li')].map(l => l.textContent)")
    assert len(shown) == 3 and all("dot products" in line for line in shown)
    assert tab.js("document.activeElement.className") == "practice-shown"
    assert tab.js("document.querySelectorAll('.practice-reveal:disabled').length") == 1


def test_editing_the_example_says_practice_judges_it_as_written(tab: Tab, tmp_path: Path) -> None:
    fresh(tab, practice_page(tmp_path))
    note = "document.querySelector('.practice-edited')"
    assert tab.js(f"{note}.hidden") is True
    tab.js("qkvPage.call().edited = true; qkvPage.notify('edit')")
    assert tab.js(f"{note}.hidden") is False
    assert "judges the example as written" in tab.js(f"{note}.textContent")


def test_hostile_tokens_stay_text(tab: Tab, tmp_path: Path) -> None:
    example = dataclasses.replace(examples.builtin(EXAMPLE), tokens=(SCRIPT, IMAGE, SVG))
    fresh(tab, practice_page(tmp_path, example))
    heads = tab.js("[...document.querySelectorAll('[data-practice=\"Q\"] tbody th')]"
                   ".map(th => th.textContent)")  # fmt: skip
    assert heads == [SCRIPT, IMAGE, SVG]
    assert tab.js("window.qkvInjected === undefined && !document.querySelector('img, svg[onload]')")
    assert tab.problems() == []


# -- the README's screenshot ------------------------------------------------------------------


def screenshot(tab: Tab, path: Path) -> None:
    """Practice mode naming a slip: the Q rows right, the weights of "love" left unscaled."""
    setup = Setup.of(examples.builtin(EXAMPLE))
    correct = forward(setup)
    for t in range(3):
        enter_row(tab, "scaled", t, numbers(correct["scaled"][0, t]))
    enter_row(tab, "weights", 0, numbers(correct["weights"][0, 0]))
    enter_row(tab, "weights", 1, numbers(forward(setup, Slip("unscaled"))["weights"][0, 1]))
    tab.js("document.activeElement.blur()")
    box = tab.js(
        "(() => { const e = document.querySelector('[data-practice=\"weights\"]'); "
        "e.scrollIntoView(); const r = e.getBoundingClientRect(); "
        "return [r.x + window.scrollX, r.y + window.scrollY, r.width, r.height]; })()"
    )
    shot = tab.call(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": False,
            "clip": {"x": box[0] - 8, "y": box[1] - 8, "width": box[2] + 16,
                     "height": box[3] + 16, "scale": 1},
        },
    )  # fmt: skip
    path.write_bytes(base64.b64decode(shot["data"]))


def test_the_screenshot_is_made_and_shown_in_the_readme(tab: Tab, tmp_path: Path) -> None:
    fresh(tab, practice_page(tmp_path))
    screenshot(tab, tmp_path / "practice.png")
    assert (tmp_path / "practice.png").read_bytes().startswith(b"\x89PNG")
    assert verdict(tab, "weights", 1).startswith("✗ Slip: unscaled")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "docs/img/practice.png" in readme and "test_practice docs/img/practice.png" in readme


def main(target: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix="qkv-practice-"))
    browser = Browser(CHROMIUM, folder)
    try:
        tab = Tab(browser)
        tab.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 820, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        )
        tab.open(practice_page(folder))
        screenshot(tab, Path(target))
        problems = tab.problems()
        if problems:
            raise SystemExit(f"the page reported problems: {problems}")
    finally:
        browser.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/practice.png")
