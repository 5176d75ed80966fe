"""The page's panels "Why divide by √d_k?" and "A score as a sum", in a real browser.

Peer expectations ported (in our words, no code copied): Vaswani et al. 2017, section 3.2.1
(footnote 4): for q and k of independent entries with mean 0 and variance 1, q·k has variance
d_k, so large d_k pushes the softmax into regions of tiny gradients; dividing by √d_k undoes
it. The seeds' tutorials call the unscaled row "greedy". Jay Alammar's "The Illustrated
Transformer" computes a score as the dot product of one query and one key, term by term.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qkv import examples, render
from tests.browser.lab_helpers import python_steps, set_options
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

TOL = 1e-12

ROW_512 = (
    "(() => { const tr = document.querySelector('.sqrt-dk tr[data-dk=\"512\"]'); "
    "return [Number(tr.querySelector('.unscaled').dataset.value), "
    "Number(tr.querySelector('.scaled').dataset.value)]; })()"
)

TERMS = (
    "[...document.querySelectorAll('.sums tr[data-d] .term-value')]"
    ".map((td) => Number(td.dataset.value))"
)


def open_example(tab: Tab, tmp_path: Path, name: str) -> examples.Example:
    example = examples.builtin(name)
    path = tmp_path / f"{name}.html"
    render.html(examples.run(example), path)
    tab.open(path)
    return example


def test_the_unscaled_row_turns_greedy_as_d_k_grows(tab: Tab, tmp_path: Path) -> None:
    open_example(tab, tmp_path, "i-love-statistics")
    assert tab.js("document.querySelector('.sqrt-dk h2').textContent") == "Why divide by √d_k?"
    dks = tab.js("[...document.querySelectorAll('.sqrt-dk tr[data-dk]')].map(t => t.dataset.dk)")
    assert dks == ["2", "4", "8", "16", "32", "64", "128", "256", "512"]
    unscaled, scaled = [], []
    for seed in range(1, 11):  # the button draws new random q and k
        assert tab.js("document.querySelector('.sqrt-dk').dataset.seed") == str(seed)
        top, kept = tab.js(ROW_512)
        unscaled.append(top)
        scaled.append(kept)
        tab.js("document.getElementById('qkv-sqrt-again').click()")
    # Without scaling one key takes almost everything; divided by √d_k it does not.
    assert float(np.median(unscaled)) > 0.99, unscaled
    assert max(scaled) < 0.6, scaled
    # The numbers are written, not only drawn: the row of d_k = 512, both ways.
    lines = tab.js("[...document.querySelectorAll('.sqrt-dk .eq')].map(p => p.textContent)")
    assert lines[0].startswith("d_k = 512, not scaled: [") and "1.000" in lines[0]
    labels = tab.js(
        "[...document.querySelectorAll('.sqrt-dk .row-bars')]"
        ".map(b => b.getAttribute('aria-label'))"
    )
    assert len(labels) == 18 and labels[0].count(",") >= 8
    tab.choose("qkv-sqrt-dk", 2)
    assert tab.js("document.querySelector('.sqrt-dk .eq').textContent").startswith("d_k = 2,")
    assert tab.problems() == []


def test_the_panel_s_weights_are_a_softmax_of_scaled_random_scores(
    tab: Tab, tmp_path: Path
) -> None:
    open_example(tab, tmp_path, "i-love-statistics")
    rows = tab.js("qkvPage.panels.sqrtRows(7)")
    for row in rows:
        scores = np.array(row["scores"])
        for scale, key in ((1.0, "unscaled"), (1 / np.sqrt(row["dK"]), "scaled")):
            e = np.exp(scores * scale - np.max(scores * scale))
            assert np.allclose(row[key], e / e.sum(), atol=1e-12)
    assert tab.js("JSON.stringify(qkvPage.panels.sqrtRows(7))") == tab.js(
        "JSON.stringify(qkvPage.panels.sqrtRows(7))"
    )  # seeded: the same numbers every time
    assert tab.problems() == []


def test_a_score_is_shown_as_a_sum_of_python_s_terms(tab: Tab, tmp_path: Path) -> None:
    example = open_example(tab, tmp_path, "two-heads")
    steps = python_steps(example, heads=2, scale="sqrt_dk", causal=False)
    for head, query, key in ((0, 0, 0), (0, 3, 1), (1, 2, 3)):
        tab.choose("qkv-head", head)
        tab.choose("qkv-query", query)
        tab.choose("qkv-sum-key", key)
        q, k = steps[("Q", head)][query], steps[("K", head)][key]
        terms = tab.js(TERMS)
        assert np.max(np.abs(np.array(terms) - q * k)) <= TOL
        score = tab.js("Number(document.querySelector('.sums .score').dataset.value)")
        assert abs(score - steps[("scores", head)][query, key]) <= TOL
        text = tab.js("document.querySelector('.sums .eq').textContent")
        tokens = example.tokens
        assert text.startswith(f"q_{tokens[query]}·k_{tokens[key]} = Σ_d q_d·k_d = ")
        assert text.endswith(f" = {steps[('scores', head)][query, key]:.4f}")
        widths = tab.js(
            "[...document.querySelectorAll('.sums .term')].map(b => parseFloat(b.style.width))"
        )
        assert widths.index(max(widths)) == int(np.argmax(np.abs(q * k)))  # drawn to size
    # Clicking a key in the head view chooses it here too; an edit moves the sum.
    tab.js("document.querySelector(\".hv-col.k .tok[data-index='2']\").click()")
    assert tab.js("document.getElementById('qkv-sum-key').value") == "2"
    set_options(tab, scale="none")
    assert "Scaled: " in tab.js("document.querySelector('.sums').textContent")
    assert tab.problems() == []
