"""``qkv grade`` on a class of real students' attention classes (issue 35, "Done when": every
correct one full marks, every buggy one a slip, the real mask and projection bugs named).

The submissions are those of ``tests/check/corpus_real_classes.py`` (each in the style of
an implementation seen in a public repository, cited there; their truth is decided there by
a float64 reference that does not use qkv), each handed in as its own file, plus the
CS231n-style mask slips of ``tests/check/test_module.py`` written out as files. Every file
runs sandboxed, in a process that cannot import qkv: the corpus never imports it.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from qkv.cli import main
from tests.check import corpus_real_classes as corpus

_CORPUS = Path(corpus.__file__).read_text(encoding="utf-8")

# CS231n's MultiHeadAttention(embed_dim, num_heads, dropout) with forward(query, key, value,
# attn_mask), 1 = may attend (transformer_layers.py's convention); SCORES and MASKED are the
# two lines a student writes, right or with the slip named beside each variant below.
_CS231N = """\
import math

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1):
        super().__init__()
        self.key = nn.Linear(embed_dim, embed_dim)
        self.query = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_drop = nn.Dropout(dropout)
        self.n_head = num_heads

    def forward(self, query, key, value, attn_mask=None):
        n, s, e = query.shape
        _, t, _ = value.shape
        h = self.n_head
        q = self.query(query).view(n, s, h, e // h).transpose(1, 2)
        k = self.key(key).view(n, t, h, e // h).transpose(1, 2)
        v = self.value(value).view(n, t, h, e // h).transpose(1, 2)
        SCORES
        if attn_mask is not None:
            MASKED
        y = self.attn_drop(torch.softmax(scores, dim=-1)) @ v
        return self.proj(y.transpose(1, 2).reshape(n, s, e))
"""
_RIGHT_SCORES = "scores = q @ k.transpose(-2, -1) / math.sqrt(e // h)"
_RIGHT_MASK = "scores = scores.masked_fill(attn_mask == 0, float('-inf'))"
_CS231N_SUBMISSIONS = {
    "cs231n_right": (_RIGHT_SCORES, _RIGHT_MASK, None),
    "cs231n_fill_zero": (
        _RIGHT_SCORES,
        _RIGHT_MASK.replace("float('-inf')", "0"),
        "mask-filled-with-zero",
    ),
    "cs231n_fill_plus_inf": (
        _RIGHT_SCORES,
        _RIGHT_MASK.replace("'-inf'", "'inf'"),
        "mask-filled-with-inf",
    ),
    "cs231n_not_assigned": (  # masked_fill's result thrown away
        _RIGHT_SCORES,
        _RIGHT_MASK.replace("scores = scores.", "scores."),
        "mask-not-applied",
    ),
    "cs231n_qk": (
        _RIGHT_SCORES.replace(".transpose(-2, -1)", ""),
        _RIGHT_MASK,
        "qk-not-transposed",
    ),
}


# A decoder's causal attention that takes the keys and values apart, its triangular buffer
# sliced from the top-left corner (PyTorch's is_causal) or, the slip, from the bottom-right.
_CAUSAL_CROSS = """\
import math

import torch
from torch import nn


class Student(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.h = num_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.register_buffer("tril", torch.tril(torch.ones(16, 16)))

    def forward(self, query, key, value):
        (b, t, e), s = query.shape, key.shape[1]
        q = self.q_proj(query).view(b, t, self.h, -1).transpose(1, 2)
        k = self.k_proj(key).view(b, s, self.h, -1).transpose(1, 2)
        v = self.v_proj(value).view(b, s, self.h, -1).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(self.tril[ROWS, :s] == 0, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(b, t, e))
"""
_CAUSAL_CROSS_SUBMISSIONS = {
    "cross_top_left": ("0:t", None),
    "cross_bottom_right": ("s - t:s", "cross-mask-misaligned"),
}


def _cs231n(scores: str, masked: str) -> str:
    return _CS231N.replace("SCORES", scores).replace("MASKED", masked)


def _grade(folder: Path, files: dict[str, str], *options: str) -> dict[str, list[str]]:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / f"{name}.py").write_text(text, encoding="utf-8")
    out = folder.parent / f"{folder.name}-out"
    assert main(["grade", str(folder), "-o", str(out), "--jobs", "2", *options]) == 0
    with (out / "grades.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return {r["student"]: [r["score"], r["max_score"], r["status"], r["first_slip"]] for r in rows}


def _as_student(cls: type) -> str:
    """The corpus as one student's file, with ``cls`` under the name the teacher asks for."""
    return _CORPUS + f"\n\nStudent = {cls.__name__}\n"


GRADED_CODES = frozenset(
    {e.code for e in corpus.CLASSES if e.code}
    | {c for *_, c in _CS231N_SUBMISSIONS.values() if c}
    | {c for _, c in _CAUSAL_CROSS_SUBMISSIONS.values() if c}
)
"""The codes this class test grades (``test_kinds.py`` checks every code is graded somewhere)."""


def _check(table: dict[str, list[str]], expected: dict[str, str | None]) -> None:
    assert set(table) == set(expected)
    for student, code in expected.items():
        score, max_score, status, first = table[student]
        if code is None:
            assert (status, score) == ("ok", max_score), (student, table[student])
        else:
            assert (status, first) == ("slip", code), (student, table[student])
            assert 0 < float(score) < float(max_score), (student, table[student])


@pytest.mark.slow
def test_a_class_of_real_multi_head_classes_is_graded_right(tmp_path: Path) -> None:
    many = [e for e in corpus.CLASSES if e.heads > 1]
    files = {e.cls.__name__: _as_student(e.cls) for e in many}
    files |= {name: _cs231n(s, m) for name, (s, m, _) in _CS231N_SUBMISSIONS.items()}
    for name in _CS231N_SUBMISSIONS:
        files[name] += "\n\nStudent = MultiHeadAttention\n"
    files |= {
        n: _CAUSAL_CROSS.replace("ROWS", r) for n, (r, _) in _CAUSAL_CROSS_SUBMISSIONS.items()
    }
    table = _grade(tmp_path / "mha", files, "--kind", "module", "--class", "Student")
    expected = {e.cls.__name__: e.code for e in many}
    expected |= {name: code for name, (_, _, code) in _CS231N_SUBMISSIONS.items()}
    expected |= {name: code for name, (_, code) in _CAUSAL_CROSS_SUBMISSIONS.items()}
    _check(table, expected)


@pytest.mark.slow
def test_a_class_of_real_single_heads_is_graded_right(tmp_path: Path) -> None:
    single = [e for e in corpus.CLASSES if e.heads == 1]
    files = {e.cls.__name__: _as_student(e.cls) for e in single}
    table = _grade(tmp_path / "heads", files, "--kind", "attention", "--class", "Student")
    _check(table, {e.cls.__name__: e.code for e in single})
