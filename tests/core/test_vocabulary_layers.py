"""One step vocabulary (qkv.steps) below render and check, and check without the renderers.

Issue 13: the words of a step are written once, so the titles of ``qkv explain``, the headings
of ``qkv check`` and the words a trace records cannot drift apart; ``qkv check`` runs without
importing the trace renderers (the layer order puts check below render).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import qkv
from qkv import render
from qkv.steps import WORDS, meaning


def test_checking_an_example_loads_no_renderer() -> None:
    code = (
        "import sys\n"
        "from qkv.check import check\n"
        "check('i-love-statistics').text()\n"
        "print(sorted(m for m in sys.modules if m.startswith('qkv.render')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


def test_a_step_without_its_own_words_reads_like_a_recorded_one() -> None:
    """A trace file whose steps lost their formula and description (written by hand) is
    explained with the words the reference records, not with a second, drifted table."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(3, 2)) for _ in range(3))
    with qkv.tracing() as recorded:
        qkv.scaled_dot_product_attention(q, k, v, scale=0.5)
    data = recorded.to_dict()
    for step in data["steps"]:
        step.pop("formula", None)
        step.pop("description", None)
    bare = qkv.Trace.from_dict(data)
    for name in ("weights", "context"):
        assert recorded[name].description == WORDS[name].description
    kept = render.text(recorded, width=100).splitlines()
    lost = render.text(bare, width=100).splitlines()
    for name in ("scores", "weights", "context"):
        sentence = meaning(name)
        assert sentence in kept and sentence in lost
