"""The page's decode view ("Decoding with a KV cache"), stepped through in a real browser and
compared with ``qkv.examples.decode_step`` (what ``qkv explain --decode`` prints).

Peer expectations ported (in our words, no code copied): Hugging Face transformers' cache
tests (``tests/utils/test_cache_utils.py``) check that generating with a cache gives the
logits of the full forward pass; PyTorch's ``scaled_dot_product_attention`` documents the
bottom-right causal alignment (``torch.nn.attention.bias.causal_lower_right``) that a query
appended after the cached keys needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from qkv import examples, render
from tests.browser.lab_helpers import edited
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

TOL = 1e-12


def open_example(tab: Tab, tmp_path: Path, name: str) -> examples.Example:
    example = examples.builtin(name)
    path = tmp_path / f"{name}.html"
    render.html(examples.run(example), path)
    tab.open(path)
    return example


def check_step(tab: Tab, example: examples.Example, position: int, head: int) -> None:
    shown = tab.js("qkvPage.decode.current()")
    expected = examples.decode_step(example, query=position)
    assert shown["position"] == position and shown["head"] == head
    for mine, theirs in (
        ("weights", expected.weights[head]),
        ("context", expected.context[head]),
        ("fullWeights", expected.full_weights[head]),
        ("fullContext", expected.full_context[head]),
        ("query", expected.query[head]),
        ("keys", expected.keys[head]),
        ("values", expected.values[head]),
    ):
        got = np.array(shown[mine])
        assert got.shape == theirs.shape, mine
        assert np.max(np.abs(got - theirs)) <= TOL, mine
    assert shown["weightsDifference"] <= TOL and shown["contextDifference"] <= TOL


@pytest.mark.parametrize("name", ["i-love-statistics", "two-heads"])
def test_stepping_through_the_cache(tab: Tab, tmp_path: Path, name: str) -> None:
    example = open_example(tab, tmp_path, name)
    assert tab.js("document.querySelector('.decode').hidden") is False
    count = len(example.tokens)
    for head in range(example.heads):
        tab.choose("qkv-head", head)
        tab.choose("qkv-decode-step", 0)
        assert tab.js("document.getElementById('qkv-decode-prev').disabled") is True
        for position in range(count):
            check_step(tab, example, position, head)
            rows = tab.js(
                "document.querySelectorAll('.decode table.cache:not(.weights) tbody tr').length"
            )
            assert rows == position + 1  # the cache grows by one row of K and V a token
            new = tab.js("[...document.querySelectorAll('.decode tr.new')].map(tr => tr.innerText)")
            assert len(new) == 1 and new[0].startswith(example.tokens[position])
            assert new[0].rstrip().endswith("← added now")  # said in words, not by colour alone
            keys = tab.js("document.querySelectorAll('.decode table.weights tbody tr').length")
            assert keys == position + 1  # the new query attends every cached key
            text = tab.js("document.querySelector('.decode').innerText")
            assert "Bottom-right alignment" in text
            assert "Equal to the last row of the full causal computation" in text
            if position < count - 1:
                tab.js("document.getElementById('qkv-decode-next').click()")
        assert tab.js("document.getElementById('qkv-decode-next').disabled") is True
    assert tab.problems() == []


def test_the_decode_view_follows_an_edit(tab: Tab, tmp_path: Path) -> None:
    example = open_example(tab, tmp_path, "the-cat-sat-on-the-mat")
    tab.js("document.getElementById('qkv-edit').click()")
    tab.js(
        "(() => { const e = document.querySelector(\"input[data-edit='embeddings:0:2:1']\");"
        " e.value = '-2'; e.dispatchEvent(new Event('input')); })()"
    )
    changed = edited(example, "embeddings", 2, 1, -2.0)
    tab.choose("qkv-decode-step", 4)
    check_step(tab, changed, 4, 0)
    # Decoding is causal whatever the page's own causal switch says; heads follow the page.
    tab.choose("qkv-heads", 3)
    tab.choose("qkv-head", 2)
    check_step(tab, dataclasses.replace(changed, heads=3), 4, 2)
    assert tab.problems() == []
