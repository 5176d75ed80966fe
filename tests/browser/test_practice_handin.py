"""The practice page hands in: the learner types rows, names the file and presses "Hand in"
(keyboard only); Chromium saves NAME.yaml, and ``qkv grade --inputs`` grades it like any
worked example, naming the same slip the page named."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest

from qkv.check._pipeline import Setup, Slip, forward
from qkv.cli import main
from qkv.examples import builtin
from tests.browser.test_page_access import key, tab_to
from tests.browser.test_practice import enter_row, fresh, numbers, practice_page
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

INPUTS = """\
name: I love statistics
tokens: [I, love, statistics]
embeddings: [[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]]
weights:
  W_q: [[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]]
  W_k: [[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]]
  W_v: [[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]]
"""


def _wait_for(folder: Path, name: str) -> Path:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = folder / name
        if done.is_file() and done.stat().st_size > 0:
            return done
        time.sleep(0.1)
    raise AssertionError(f"Chromium saved no {name} in {folder}: {list(folder.iterdir())}")


def test_hand_in_saves_the_typed_rows_and_qkv_grade_reads_them(tab: Tab, tmp_path: Path) -> None:
    fresh(tab, practice_page(tmp_path, builtin("i-love-statistics")))
    handins = tmp_path / "handins"
    handins.mkdir()
    tab.browser.call(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(handins)}
    )
    # nothing typed yet: nothing to hand in, and the page says so
    tab.js("document.getElementById('qkv-handin').click()")
    status = tab.js("document.querySelector('.practice [role=status]').textContent")
    assert status.startswith("Type at least one whole row")
    setup = Setup.of(builtin("i-love-statistics"))
    right = forward(setup)
    slipped = forward(setup, Slip("unscaled"))
    assert enter_row(tab, "Q", 1, numbers(right["Q"][1], 2)).startswith("✓ Right")
    assert enter_row(tab, "scores", 1, numbers(right["scores"][0, 1])).startswith("✓ Right")
    said = enter_row(tab, "weights", 1, numbers(slipped["weights"][0, 1]))
    assert said.startswith("✗ Slip: unscaled")
    # the learner's name and the button, by keyboard
    tab_to(tab, "e.id === 'qkv-handin-name'")
    tab.call("Input.insertText", {"text": "Zoë O'Brien"})
    key(tab, "Tab")
    assert tab.js("document.activeElement.id") == "qkv-handin"
    key(tab, "Enter")
    saved = _wait_for(handins, "Zoë_O_Brien.yaml")
    text = saved.read_text(encoding="utf-8")
    assert "claimed:\n  Q:\n    1: [0.50, 0.80]\n  scores:\n    1: [" in text
    status = tab.js("document.querySelector('.practice [role=status]').textContent")
    assert status == "Saved 3 rows as Zoë_O_Brien.yaml: hand that file to your teacher."
    assert tab.problems() == []
    # the teacher grades the class's hand-ins on the example the page was made from
    inputs = tmp_path / "inputs.yaml"
    inputs.write_text(INPUTS)
    out = tmp_path / "grades"
    argv = ["grade", str(handins), "-o", str(out), "--kind", "example", "--inputs", str(inputs)]
    assert main(argv) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    # projections and scores right, scaling slipped, the softmax of the unscaled scores right
    # (follow-through), the weighted sum not shown
    assert rows[1] == ["Zoë_O_Brien", "3", "5", "slip", "unscaled", "unscaled"]
