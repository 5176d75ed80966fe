"""``qkv grade`` on the kinds and codes ``qkv check`` gained with issue 26: grouped-query
functions (``--kind gqa``), attention classes (``--kind module``), and every new slip code
credited to the part of the mechanism it names.

The buggy functions are the ones ``tests/check/test_function_codes.py`` writes from each bug's
pattern; here each becomes a student's file (its source, with the helpers it calls), so the
grade runs them as a class: in the sandbox, from files."""

from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from qkv.check import FUNCTION_DIAGNOSES
from qkv.cli import main
from qkv.grade._parts import CODE_PARTS, PART_TITLES, PARTS
from tests.check import test_function_codes as codes

_HEADER = """\
import math
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
"""
_HELPERS = (codes.softmax, codes.masked_softmax, codes.heads, codes.mh, codes.gqa)


def _file(fn: object) -> str:
    parts = [_HEADER, *(inspect.getsource(h) for h in _HELPERS), inspect.getsource(fn)]  # type: ignore[arg-type]
    return "\n\n".join(parts) + f"\nattention = {fn.__name__}\n"  # type: ignore[attr-defined]


def _grade(folder: Path, files: dict[str, str], *options: str) -> dict[str, list[str]]:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    out = folder.parent / f"{folder.name}-out"
    assert main(["grade", str(folder), "-o", str(out), "--jobs", "2", *options]) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        return {r[0]: r[1:] for r in list(csv.reader(handle))[1:]}


def test_every_code_of_qkv_check_names_a_part_of_the_rubric() -> None:
    """A code without a part would cost the last part of the mechanism, whatever it names."""
    named = set(FUNCTION_DIAGNOSES) - {"unrecognised"}
    assert named <= set(CODE_PARTS)
    assert set(CODE_PARTS.values()) <= set(PARTS)


_EXPECTED_PART = {  # read apart from the codes' declarations; the class test reads those
    "scaled-by-ndim": "scaling",
    "scaled-by-num-heads": "scaling",
    "causal-off-by-one": "mask",
    "mask-after-softmax": "mask",
    "mask-inverted": "mask",
    "dropout-at-inference": "softmax",
    "heads-split-without-transpose": "heads",
    "heads-merged-without-transpose": "heads",
    "heads-averaged": "heads",
    "transposed-weights": "projections",
    "kv-heads-wrong-order": "heads",
    "kv-heads-not-repeated": "heads",
}


def _one_student_per_kind_and_code() -> dict[tuple[str, str], Any]:
    """The first bug function of each (kind, code) of ``NEW_SLIPS``: the grade credits a
    slip by its code and kind, whichever way the student wrote it; every function's own
    code is asserted in tests/check/test_function_codes.py (so a second way to hide the
    diagonal, or to draw dropout, adds a sandboxed student of a second and no code path)."""
    chosen: dict[tuple[str, str], Any] = {}
    for kind, fn, code, _ in codes.NEW_SLIPS:
        # the 4-D-only function needs --batched's probes; the masked one --mask-means
        if fn is codes.scaled_by_ndim_4d_only or fn is codes.mask_after_softmax:
            continue
        chosen.setdefault((kind, code), fn)
    return chosen


@pytest.mark.slow
def test_a_class_with_every_new_slip_is_graded_slip_by_slip(tmp_path: Path) -> None:
    students = _one_student_per_kind_and_code()
    by_kind: dict[str, dict[str, str]] = {}
    for (kind, _code), fn in students.items():
        by_kind.setdefault(kind, {})[f"{fn.__name__}.py"] = _file(fn)
    right = {
        "attention": "import numpy as np\n\ndef attention(Q, K, V):\n"
        "    s = Q @ K.T / np.sqrt(Q.shape[-1])\n"
        "    e = np.exp(s - s.max(-1, keepdims=True))\n"
        "    return e / e.sum(-1, keepdims=True) @ V\n",
        "gqa": _file(codes.gqa).replace("attention = gqa\n", "")
        + "def attention(X, W_q, W_k, W_v, W_o, h, h_kv):\n"
        "    return gqa(X, W_q, W_k, W_v, W_o, h, h_kv)\n",
    }
    found: dict[str, str] = {}
    no_mask = tmp_path / "no-mask.yaml"  # these functions take no mask: nor does the assignment
    no_mask.write_text("points:\n  mask: 0\n", encoding="utf-8")
    for kind, files in by_kind.items():
        if kind in right:
            files["right.py"] = right[kind]
        rubric = ("--rubric", str(no_mask)) if kind == "attention" else ()
        table = _grade(tmp_path / kind, files, "--kind", kind, *rubric)
        for student, (score, max_score, status, first, slips) in table.items():
            if student == "right":
                assert (status, score) == ("ok", max_score), (kind, table[student])
                continue
            found[student] = first
            assert status == "slip" and slips.split(";")[0] == first, (student, table[student])
            # the slip costs exactly the points of its part (one point each by default),
            # the part its code declares
            assert float(max_score) - float(score) == 1.0, (student, table[student])
            graded = json.loads((tmp_path / f"{kind}-out" / f"{student}.json").read_text())
            lost = [t["name"] for t in graded["tests"] if t["status"] == "failed"]
            assert lost == [PART_TITLES[CODE_PARTS[first]]], (student, lost)
    expected = {fn.__name__: code for (_, code), fn in students.items()}
    assert found == expected
    assert {code for _, code in students} == {code for _, _, code, _ in codes.NEW_SLIPS}
    assert all(CODE_PARTS[c] == part for c, part in _EXPECTED_PART.items())


_MODULE_RIGHT = """\
import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1):
        super().__init__()
        self.h = num_heads
        self.query = nn.Linear(embed_dim, embed_dim)
        self.key = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (
            f(x).view(b, n, self.h, -1).transpose(1, 2)
            for f in (self.query, self.key, self.value)
        )
        w = torch.softmax(q @ k.transpose(-2, -1) / SCALE, dim=-1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, n, e))
"""


@pytest.mark.slow
def test_attention_classes_are_graded_with_kind_module(tmp_path: Path) -> None:
    files = {
        "right.py": _MODULE_RIGHT.replace("SCALE", "q.shape[-1] ** 0.5"),
        "unscaled.py": _MODULE_RIGHT.replace(" / SCALE", ""),
        "no_class.py": "def attention(Q, K, V):\n    return V\n",
    }
    no_mask = tmp_path / "no-mask.yaml"  # forward(x): the assignment has no mask part
    no_mask.write_text("points:\n  mask: 0\n", encoding="utf-8")
    table = _grade(
        tmp_path / "modules",
        files,
        *("--kind", "module", "--class", "MultiHeadAttention", "--rubric", str(no_mask)),
    )
    assert table["right"] == ["6", "6", "ok", "", ""]
    assert table["unscaled"] == ["5", "6", "slip", "unscaled", "unscaled"]
    score, max_score, status, first, _ = table["no_class"]
    assert (score, max_score, status, first) == ("0", "6", "error", "")


def test_the_class_option_must_be_a_python_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in").mkdir()
    code = main(
        [
            "grade",
            str(tmp_path / "in"),
            "-o",
            str(tmp_path / "o"),
            "--kind",
            "module",
            "--class",
            "no-such name",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--class must be a Python name" in err
