"""The tiled practice page (``qkv explain --tiled --practice --html``, issue 37 item 2) in a
real browser: the learner types m, l and O tile by tile and each row is judged as ``qkv
check`` judges it. The rows typed are computed here by hand (``flash-by-hand``: the query
"sat" scores [1, 0 | 4, 1] after scaling), not read back from the page; the sentences the
page shows are checked against ``qkv check`` on the same rows.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from qkv import examples
from qkv.check import check
from qkv.cli import main
from qkv.examples import Claimed
from tests.support.browser import Tab

pytestmark = pytest.mark.slow

E = math.e
L0 = 1 + E**-1  # "sat" after key block 0: e^(1-1) + e^(0-1)
L1 = E**-3 * L0 + 1 + E**-3  # after key block 1, m = 4: α = e^-3


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("tiled-practice") / "practice.html"
    argv = ["explain", "--tiled", "--practice", "--example", "flash-by-hand", "--html", str(target)]
    assert main(argv) == 0
    return target


def enter(tab: Tab, key: str, values: list[float], digits: int = 4) -> str:
    texts = json.dumps([f"{v:.{digits}f}" for v in values])
    return str(
        tab.js(
            f"""(() => {{
        const inputs = [...document.querySelectorAll('input[data-key="{key}"]')];
        const texts = {texts};
        inputs.forEach((input, i) => {{ input.value = texts[i]; }});
        document.querySelector('button[data-key="{key}"]').click();
        return document.querySelector('td.verdict[data-key="{key}"]').textContent;
    }})()"""
        )
    )


def test_the_tiles_ask_m_l_and_o_of_each_query(tab: Tab, page: Path) -> None:
    tab.open(page)
    assert tab.problems() == []
    captions = tab.js(
        "[...document.querySelectorAll('#qkv-tiled-practice caption')].map(c => c.textContent)"
    )
    assert captions[0] == "Query block 0 (the, cat) × key block 0 (the, cat)"
    assert captions[3] == "Query block 1 (sat, down) × key block 1 (sat, down)"
    labels = tab.js(
        "[...document.querySelectorAll('#qkv-tiled-practice table')[3].querySelectorAll('th')]"
        ".map(c => c.textContent)"
    )
    assert labels == ["m of sat", "l of sat", "O of sat", "m of down", "l of down", "O of down"]


def test_rows_are_judged_right_slipped_or_following(tab: Tab, page: Path) -> None:
    tab.open(page)
    assert enter(tab, "running_max/2/0", [1]).startswith("✓ Right")
    assert enter(tab, "running_sum/2/0", [L0]).startswith("✓ Right")
    said = enter(tab, "running_sum/2/1", [L0 + 1 + E**-3])  # l_old not rescaled
    assert said.startswith("✗ Slip: flash-sum-not-rescaled"), said
    assert "1.1179" in said
    # O / l computed right on that wrong l: follows from it.
    o1 = [(2 + 0.0) * E**-3 + 2 + E**-3, (2 * E**-1) * E**-3 + 2 + E**-3]
    said = enter(tab, "output/2", [o1[0] / (L0 + 1 + E**-3), o1[1] / (L0 + 1 + E**-3)])
    assert said.startswith("↪ Follows from your earlier numbers"), said
    said = enter(tab, "output/2", list(o1))  # the final division missing
    assert said.startswith("✗ Slip: flash-final-divide-missing"), said
    said = enter(tab, "running_sum/2/1", [L1])
    assert said.startswith("✓ Right"), said
    said = enter(tab, "running_sum/2/1", [1.5])
    assert said.startswith("✗ Arithmetic"), said
    bad = tab.js(
        """(() => {
        const input = document.querySelector('input[data-key="running_max/3/0"]');
        input.value = 'abc';
        document.querySelector('button[data-key="running_max/3/0"]').click();
        return document.querySelector('td.verdict[data-key="running_max/3/0"]').textContent;
    })()"""
    )
    assert bad.startswith("? Not a number")
    assert tab.problems() == []


def test_the_page_says_what_qkv_check_says_on_the_same_rows(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', html, re.S)
    assert block is not None
    practice = json.loads(block.group(1))["practice"]
    row = next(
        r for tile in practice["tiles"] for r in tile["rows"] if r["key"] == "running_sum/2/1"
    )
    slip = next(c for c in row["candidates"] if c["code"] == "flash-sum-not-rescaled")
    example = examples.builtin("flash-by-hand")
    claimed = {
        "running_max": {2: Claimed((1.0, 4.0), ("1", "4"))},
        "running_sum": {
            2: Claimed((L0, slip["values"][0]), (f"{L0:.4f}", f"{slip['values'][0]:.4f}"))
        },
    }
    import dataclasses

    report = check(dataclasses.replace(example, tiled_claimed=claimed))
    finding = next(f for f in report.findings if f.step == "running_sum" and f.key_block == 1)
    assert (finding.diagnosis, finding.message) == (slip["code"], slip["says"])
    assert row["correct"][0] == pytest.approx(L1, abs=1e-14)
