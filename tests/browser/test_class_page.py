"""The teacher's class page (``class.html`` of ``qkv grade``) in a real Chromium: the numbers a
teacher reads, every student's feedback one click (or one key) away, and hostile text from a
submission shown as text, never run; nothing requested from the network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv.check import check, check_function
from qkv.examples import builtin
from qkv.grade import Rubric, class_page
from qkv.grade._credit import Grade, credit_example, credit_function, failed
from tests.browser.test_page_access import key, tab_to
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

IMAGE = '"><img src=x onerror="window.qkvInjected=1">'


def _softmax(s: Any) -> Any:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def right(Q: Any, K: Any, V: Any) -> Any:
    return _softmax(Q @ K.T / np.sqrt(Q.shape[-1])) @ V


def unscaled(Q: Any, K: Any, V: Any) -> Any:
    return _softmax(Q @ K.T) @ V


def wrong_axis(Q: Any, K: Any, V: Any) -> Any:
    e = np.exp(Q @ K.T / np.sqrt(Q.shape[-1]))
    return (e / e.sum(axis=0, keepdims=True)) @ V


def _grades() -> list[Grade]:
    rubric = Rubric()
    made = []
    for name, fn in (("ada", right), ("bob", unscaled), ("cy", unscaled), ("di", wrong_axis)):
        report = check_function(fn, "attention", name=f"attention in {name}.py")
        made.append(credit_function(name, report, rubric, batched=False, hidden=False))
    parts = tuple(p.part for p in made[0].parts)
    made.append(
        failed("eve", "error", f"eve.py: importing it raised ValueError: {IMAGE}", parts,
               rubric, kind="attention", title=f"attention in {IMAGE}.py")
    )  # fmt: skip
    made.append(failed("fay", "timeout", "fay.py: did not finish", parts, rubric,
                       kind="attention", title="attention in fay.py"))  # fmt: skip
    seed = credit_example("seed", check("i-love-statistics"), builtin("i-love-statistics"), rubric)
    return [*made, seed]


def test_the_class_page_shows_what_the_class_gets_wrong(tab: Tab, tmp_path: Path) -> None:
    page = tmp_path / "class.html"
    page.write_text(class_page(_grades(), title=f"Week 3 {IMAGE}"), encoding="utf-8")
    tab.open(page)
    assert tab.problems() == []
    assert tab.js("typeof window.qkvInjected") == "undefined"
    assert tab.js("document.querySelectorAll('img').length") == 0
    assert tab.js("document.title").startswith('Week 3 "><img')
    summary = tab.js("document.getElementById('summary').textContent")
    assert summary.startswith("7 submissions: 1 ok, 4 slip, 1 error, 1 timeout.")
    # the distribution: one meter per score, its count as its value
    meters = tab.js(
        "[...document.querySelectorAll('#distribution + table tr')].slice(1).map(r => "
        "[r.cells[0].textContent, Number(r.cells[1].textContent), r.querySelector('meter').value])"
    )
    assert meters == [["0 / 4", 2, 2], ["3 / 4", 3, 3], ["4 / 4", 1, 1], ["1 / 5", 1, 1]]
    # how often each slip occurred, the most frequent first
    slips = tab.js(
        "[...document.querySelectorAll('#slips + table tbody tr')].map(r => "
        "[r.cells[0].textContent, Number(r.cells[1].textContent)])"
    )
    assert slips[0] == ["unscaled", 2]
    assert ["softmax-wrong-axis", 1] in slips and ["context-not-summed", 1] in slips
    first = tab.js(
        "[...document.querySelectorAll('#first-wrong ~ table tbody tr')].map(r => "
        "[r.cells[0].textContent, Number(r.cells[1].textContent)])"
    )
    assert first[:2] == [["projections: Q = X·W_q, K = X·W_k, V = X·W_v", 1],
                         ["scaling: scores / √d_k", 2]]  # fmt: skip
    # the worked example's numbers beside the correct ones
    assert tab.js("document.getElementById('numbers') !== null")
    # every student's feedback is one click away, closed until then
    assert tab.js("document.querySelectorAll('details[id^=student-]').length") == 7
    assert tab.js("document.querySelectorAll('details[id^=student-][open]').length") == 0
    tab.js("document.querySelector('#student-bob summary').click()")
    assert tab.js("document.getElementById('student-bob').open") is True
    text = tab.js("document.getElementById('student-bob').innerText")
    assert "The scores are not divided by √d_k before the softmax" in text
    # a link from the table of slips opens that student's feedback
    tab.js("document.querySelector('#slips + table a[href=\"#student-di\"]').click()")
    tab.browser.pump(0.2)
    assert tab.js("document.getElementById('student-di').open") is True
    assert tab.problems() == []


def test_the_class_page_with_the_keyboard_alone(tab: Tab, tmp_path: Path) -> None:
    page = tmp_path / "class.html"
    page.write_text(class_page(_grades(), title="Week 3"), encoding="utf-8")
    tab.open(page)
    tab_to(tab, "e.parentElement && e.parentElement.id === 'student-cy'")
    key(tab, "Enter")
    assert tab.js("document.getElementById('student-cy').open") is True
    key(tab, " ")
    assert tab.js("document.getElementById('student-cy').open") is False
    # the "who" list of a slip, then a student's link in it, by keyboard
    tab.js("window.scrollTo(0, 0); document.activeElement.blur()")
    tab_to(tab, "e.tagName === 'SUMMARY' && e.textContent === 'who'")
    key(tab, "Enter")
    tab_to(tab, "e.tagName === 'A' && e.getAttribute('href') === '#student-bob'")
    key(tab, "Enter")
    tab.browser.pump(0.2)
    assert tab.js("document.getElementById('student-bob').open") is True
    assert tab.js("document.activeElement.parentElement.id") == "student-bob"
    assert json.loads(json.dumps(tab.problems())) == []
