"""Practice mode on a worked example that gives Q, K and V directly (format 2, issue 18).

The page is written by ``qkv explain FILE --html PAGE --practice`` itself, as a teacher would,
and opened in headless Chromium (``tests/support/browser.py``). The learner starts from Q, K
and V, so the first card is the scores; a correct scores row is judged right, and a weights
row computed without dividing by √d_k is named as the ``unscaled`` slip, as ``qkv check``
names it (docs/check.md). The rows typed are made here with qkv check's own pipeline
(``qkv.check._pipeline.forward``), not read back from the page.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv import examples
from qkv.check._pipeline import Setup, Slip, forward
from qkv.cli import main
from tests.browser.test_practice import enter_row, fresh, numbers
from tests.support.browser import Tab
from tests.support.given import QKV_GIVEN

pytestmark = pytest.mark.slow


def test_a_practice_run_on_q_k_and_v_given(
    tab: Tab, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "given.yaml"
    source.write_text(QKV_GIVEN, encoding="utf-8")
    page = tmp_path / "practice.html"
    assert main(["explain", "--example", str(source), "--html", str(page), "--practice"]) == 0
    capsys.readouterr()
    fresh(tab, page)
    cards = tab.js("[...document.querySelectorAll('.practice-step')].map(c => c.dataset.practice)")
    assert cards == ["scores", "scaled", "weights", "context"]
    setup = Setup.of(examples.loads(QKV_GIVEN))
    right = forward(setup)["scores"][0, 2]  # sat: [1, 1, 2]
    said = enter_row(tab, "scores", 2, numbers(right, 1))
    assert said.startswith("✓ Right"), said
    unscaled = forward(setup, Slip("unscaled"))["weights"][0, 2]
    said = enter_row(tab, "weights", 2, numbers(unscaled))
    assert said.startswith("✗ Slip: unscaled") and "√d_k = √2" in said, said
    right = forward(setup)["weights"][0, 2]  # [0.2483, 0.2483, 0.5035]
    said = enter_row(tab, "weights", 2, numbers(right))
    assert said.startswith("✓ Right"), said
    assert tab.problems() == []
