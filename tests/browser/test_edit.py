"""Edit and watch, in a real browser: the page recomputes attention in JavaScript from the
example's inputs, and its numbers equal qkv's float64 reference to 1e-12.

Peer expectation ported (in our words, no code copied): Transformer Explainer (Cho et al.,
CHI 2026 / arXiv 2408.04619) lets a learner change the input and watch every stage of the
model recompute; here every step must also equal the Python core's numbers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qkv
from qkv import examples, masks, render
from tests.browser.lab_helpers import (
    assert_same,
    edited,
    page_steps,
    python_steps,
    set_options,
)
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

TOL = 1e-12


def open_example(tab: Tab, tmp_path: Path, name: str, **options: Any) -> examples.Example:
    example = examples.builtin(name)
    path = tmp_path / f"{name}.html"
    render.html(examples.run(example), path, **options)
    tab.open(path)
    return example


def type_into(tab: Tab, selector: str, text: str) -> None:
    """Focus an input, select its text and type ``text`` as a person would."""
    tab.js(
        f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
        "e.scrollIntoView({block: 'center'}); e.focus(); e.select(); })()"
    )
    tab.call("Input.insertText", {"text": text})
    tab.browser.pump(0.05)


@pytest.mark.parametrize("name", examples.builtin_names())
def test_the_page_computes_what_python_computes(tab: Tab, tmp_path: Path, name: str) -> None:
    example = open_example(tab, tmp_path, name)
    assert tab.js("qkvPage.call().lab.kind") == "projections"
    options = tab.js("qkvPage.call().lab.headOptions")
    heads = [h for h in (1, 2) if h in options]
    compared = 0
    for count in heads:
        for scale in ("sqrt_dk", "none", "d_k"):
            for causal in (False, True):
                set_options(tab, heads=count, scale=scale, causal=causal)
                python = python_steps(example, heads=count, scale=scale, causal=causal)
                compared += assert_same(page_steps(tab), python, TOL)
    assert compared >= 6 * len(heads) * 10
    tab.js("qkvPage.lab.reset()")
    assert tab.js("qkvPage.edited()") is False
    assert tab.problems() == []


def test_editing_one_weight_changes_every_dependent_step(tab: Tab, tmp_path: Path) -> None:
    example = open_example(tab, tmp_path, "two-heads")
    tab.js("window.edits = 0; qkvPage.extend({ edit: () => { window.edits += 1; } })")
    before = python_steps(example, heads=2, scale="sqrt_dk", causal=False)
    tab.js("document.getElementById('qkv-edit').click()")
    assert tab.js("document.querySelectorAll('[data-step=W_k] input.cell-edit').length") == 16
    assert tab.js("qkvPage.edited()") is False
    # W_k row e2, column h0.d1: only K, the scores and what follows them depend on it.
    type_into(tab, "input[data-edit='W_k:0:1:0']", "-0.75")
    assert tab.js("window.edits") >= 1 and tab.js("qkvPage.edited()") is True
    after = python_steps(
        edited(example, "W_k", 1, 0, -0.75), heads=2, scale="sqrt_dk", causal=False
    )
    page = page_steps(tab)
    assert assert_same(page, after, TOL) >= 20
    for step in ("K", "scores", "scaled", "weights", "context"):
        assert not np.allclose(after[(step, 0)], before[(step, 0)]), step
        assert np.array_equal(after[(step, 1)], before[(step, 1)]), step  # head 1: untouched
    for step in ("concat", "output"):
        assert not np.allclose(after[(step, 0)], before[(step, 0)]), step
    assert np.array_equal(after[("Q", 0)], before[("Q", 0)])
    # What the learner reads: the table, the head view and the weighted sum all moved.
    text = tab.js("document.querySelector('[data-step=weights] tbody tr').innerText")
    first = after[("weights", 0)][0]
    assert text.split("\t")[1:5] == [f"{w:.4f}" for w in first]
    keys = tab.js("[...document.querySelectorAll('.hv-col.k .tok .w')].map(w => w.textContent)")
    assert keys == [f"{w:.4f}" for w in first]
    reading = tab.js("document.querySelector('.reading .eq').textContent")
    assert reading.startswith(f"c_time = {first[0]:.4f}·v_time")
    # The typed text stays as typed, the focus stays in the cell, worked lines are hidden.
    assert tab.js("document.activeElement.dataset.edit") == "W_k:0:1:0"
    assert tab.js("document.activeElement.value") == "-0.75"
    assert tab.js("document.querySelectorAll('.equations').length") == 0
    # The card being typed in stays (the focus with it) but shows the new colour scale.
    legend = "document.querySelector('[data-step=W_k] .legend').textContent"
    cell = "document.querySelector('[data-step=W_k] tbody td:nth-of-type(2)').style.background"
    assert "±1.0000" in tab.js(legend)
    before_colour = tab.js(cell)
    type_into(tab, "input[data-edit='W_k:0:1:0']", "-2.5")
    assert "±2.5000" in tab.js(legend) and tab.js(cell) != before_colour
    assert tab.js("document.activeElement.dataset.edit") == "W_k:0:1:0"
    tab.js("document.getElementById('qkv-reset').click()")
    assert tab.js("qkvPage.edited()") is False
    assert tab.js("document.querySelectorAll('.equations').length") > 0
    assert tab.problems() == []


def test_the_controls_change_scaling_causal_and_heads(tab: Tab, tmp_path: Path) -> None:
    example = open_example(tab, tmp_path, "two-heads")
    tab.choose("qkv-scale", "none")  # type: ignore[arg-type]
    tab.js("document.getElementById('qkv-causal').click()")
    tab.choose("qkv-heads", 1)
    python = python_steps(example, heads=1, scale="none", causal=True)
    assert assert_same(page_steps(tab), python, TOL) >= 10
    assert tab.js("document.getElementById('qkv-head').closest('label').hidden") is True
    facts = tab.js("document.querySelector('.facts').innerText")
    assert "not scaled" in facts and "causal" in facts
    titles = tab.js("[...document.querySelectorAll('.step h3')].map(h => h.textContent)")
    assert "Step 10. Masked attention scores" in titles
    assert tab.js("document.querySelector('[data-step=masked] table').innerText").count("−∞") == 6
    tab.choose("qkv-heads", 4)
    assert tab.js("document.getElementById('qkv-head').options.length") == 4
    python = python_steps(example, heads=4, scale="none", causal=True)
    assert assert_same(page_steps(tab), python, TOL) >= 30
    assert tab.problems() == []


def test_q_k_v_given_directly_can_be_edited(tab: Tab, tmp_path: Path) -> None:
    rng = np.random.default_rng(18)
    q, k, v = (rng.normal(size=(1, 2, 5, 3)) for _ in range(3))  # batch 1, 2 heads
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference")
    trace.tokens = ["a", "b", "c", "d", "e"]
    path = tmp_path / "qkv.html"
    render.html(trace, path)
    tab.open(path)
    assert tab.js("qkvPage.call().lab.kind") == "qkv"
    tab.js("document.getElementById('qkv-edit').click()")
    assert tab.js("document.querySelectorAll('[data-step=K] input.cell-edit').length") == 15
    type_into(tab, "input[data-edit='K:0:2:1']", "2.5")
    k2 = k.copy()
    k2[0, 0, 2, 1] = 2.5
    _, weights = qkv.scaled_dot_product_attention(
        q, k2, v, is_causal=True, backend="reference", return_weights=True
    )
    page = page_steps(tab)
    assert np.max(np.abs(page[("weights", 0)] - weights[0, 0])) <= TOL
    assert np.max(np.abs(page[("weights", 1)] - weights[0, 1])) <= TOL
    assert not np.allclose(page[("weights", 0)], weights[0, 1])
    assert tab.problems() == []


def test_a_trace_the_page_cannot_recompute_has_no_edit_mode(tab: Tab, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(4, 2)) for _ in range(3))
    window = masks.sliding_window(1)
    with qkv.tracing() as trace:
        qkv.scaled_dot_product_attention(q, k, v, mask=window, backend="reference")
    path = tmp_path / "window.html"
    render.html(trace, path)
    tab.open(path)
    assert tab.js("qkvPage.call().lab === undefined")
    assert tab.js("document.querySelector('.panel.lab').hidden") is True
    assert tab.js("document.querySelector('.panel.decode').hidden") is True
    assert tab.problems() == []


@pytest.mark.solo
def test_512_tokens_recompute_an_edit_exactly_and_say_how_fast(tab: Tab, tmp_path: Path) -> None:
    rng = np.random.default_rng(512)
    x = rng.normal(size=(512, 16))
    w_q, w_k, w_v, w_o = (rng.normal(size=(16, 16)) / 2 for _ in range(4))
    with qkv.tracing() as trace:
        qkv.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=2)
    trace.tokens = [f"w{i}" for i in range(512)]
    path = tmp_path / "long.html"
    started = time.monotonic()
    render.html(trace, path, steps=("W_q", "Q", "K", "V", "weights", "context", "output"))
    built = time.monotonic() - started
    tab.open(path)
    tab.js("document.getElementById('qkv-edit').click()")

    def edit(value: str) -> float:
        took: float = tab.js(
            "(() => { const e = document.querySelector(\"input[data-edit='W_q:0:0:3']\");"
            f" e.focus(); e.value = {json.dumps(value)}; const t0 = performance.now();"
            " e.dispatchEvent(new Event('input')); void document.body.offsetHeight;"
            " return performance.now() - t0; })()"
        )
        return took

    for value in ("0.7", "-0.2", "1.4"):  # the first edits also compile the page's script
        edit(value)
    timings = [edit(value) for value in ("0.9", "-1.3", "0.5", "2", "-0.4", "1.1", "0.25")]
    w_q[0, 3] = 0.25
    _, weights = qkv.multi_head_attention(
        x, w_q, w_k, w_v, w_o, num_heads=2, return_weights=True, backend="reference"
    )
    page = page_steps(tab)
    assert np.max(np.abs(page[("weights", 0)] - weights[0])) <= TOL
    assert tab.problems() == []
    typical = sorted(timings)[len(timings) // 2]
    print(f"512 tokens: page built in {built:.2f} s; edits recomputed and laid out in " + ", ".join(
        f"{t:.1f}" for t in timings) + f" ms (median {typical:.1f})")  # fmt: skip
    # The median of seven edits after three untimed ones (which also compile the script),
    # printed and never asserted: a timing depends on the machine and its load (on 2 cores
    # 100-115 ms alone, 125-146 ms beside other jobs), and the suite holds no timing
    # assertion (docs/decisions.md, "The page's edit time is printed, not asserted").


def test_a_large_input_is_edited_with_its_row_column_form(tab: Tab, tmp_path: Path) -> None:
    rng = np.random.default_rng(80)
    x = rng.normal(size=(80, 4))  # 80 rows: drawn as a picture, not a table
    w_q, w_k, w_v = (rng.normal(size=(4, 4)) for _ in range(3))
    with qkv.tracing() as trace:
        qkv.multi_head_attention(x, w_q, w_k, w_v, num_heads=2)
    path = tmp_path / "eighty.html"
    render.html(trace, path)
    tab.open(path)
    tab.js("document.getElementById('qkv-edit').click()")
    form = "document.querySelector('[data-step=embeddings] .picture-edit')"
    assert tab.js(f"{form} !== null")
    tab.js(
        f"(() => {{ const f = {form}; const [row, col, value] = f.querySelectorAll('input');"
        " row.value = '3'; row.dispatchEvent(new Event('change'));"
        " col.value = '2'; col.dispatchEvent(new Event('change'));"
        " if (Number(value.value) !== " + repr(float(x[2, 1])) + ") throw new Error(value.value);"
        " value.value = '1.5'; f.querySelector('button').click(); })()"
    )
    x[2, 1] = 1.5
    _, weights = qkv.multi_head_attention(
        x, w_q, w_k, w_v, num_heads=2, return_weights=True, backend="reference"
    )
    page = page_steps(tab)
    assert np.max(np.abs(page[("weights", 1)] - weights[1])) <= TOL
    assert np.array_equal(page[("embeddings", 0)], x)
    assert tab.problems() == []
