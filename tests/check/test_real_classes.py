"""Real students' attention classes, graded right (issue 35, item 2).

The submissions are in ``corpus_real_classes.py``, each written in the style of an
implementation seen in a public repository (cited there). Each one's truth is decided here
by a float64 NumPy reference of a few lines, independent of qkv: the class is built with
random weights, called as its author calls it (its own mask convention, cross-attention
where it takes the queries apart), and compared with the reference computed from its own
layers. Then ``check_module`` must agree: every right one without a mistake, every buggy one
with its code.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qkv.check import check_module
from qkv.testing import check_attention
from tests.check import corpus_real_classes as corpus
from tests.check.corpus_real_classes import CLASSES, Real


def _np(t: Any) -> np.ndarray:
    out: np.ndarray = t.detach().double().numpy()
    return out


def _layer(module: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    layer = dict(module.named_modules())[name]
    bias = np.zeros(layer.out_features) if layer.bias is None else _np(layer.bias)
    return _np(layer.weight).T, bias


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def reference(entry: Real, module: Any, xq: np.ndarray, xkv: np.ndarray, allow: Any) -> Any:
    """Attention of the class's own layers in float64: softmax(Q·Kᵀ/√d + mask)·V per head,
    the heads concatenated (transposed back), then the output layer."""
    w_q, b_q = _layer(module, entry.q)
    q = xq @ w_q + b_q
    if entry.kv:  # fused K|V, per head: k_h | v_h
        w_kv, b_kv = _layer(module, entry.kv)
        kv = (xkv @ w_kv + b_kv).reshape(len(xkv), entry.heads, -1)
        d = kv.shape[-1] // 2
        k = kv[..., :d].reshape(len(xkv), -1)
        v = kv[..., d:].reshape(len(xkv), -1)
    else:
        (w_k, b_k), (w_v, b_v) = _layer(module, entry.k), _layer(module, entry.v)
        k, v = xkv @ w_k + b_k, xkv @ w_v + b_v
    h = entry.heads
    d = q.shape[1] // h
    heads = []
    for i in range(h):
        cols = slice(i * d, (i + 1) * d)
        s = q[:, cols] @ k[:, cols].T / np.sqrt(d)
        if entry.causal:
            s = np.where(np.tril(np.ones(s.shape, dtype=bool)), s, -np.inf)
        if allow is not None:
            s = np.where(allow, s, -np.inf)
        heads.append(_softmax(s) @ v[:, cols])
    concat = np.concatenate(heads, axis=1)
    if not entry.o:
        return concat
    w_o, b_o = _layer(module, entry.o)
    return concat @ w_o + b_o


def run_as_its_author(entry: Real) -> tuple[np.ndarray, np.ndarray]:
    """The class's output and the reference's, on inputs and a mask of its own kind."""
    torch.manual_seed(3)
    module = entry.cls(**dict(entry.kwargs)).double().eval()
    width = dict(module.named_modules())[entry.q].in_features
    rng = np.random.default_rng(5)
    cross = entry.call in ("qkv", "kv-q")
    t, s = (4, 6) if cross else (5, 5)
    xq = rng.normal(size=(t, width))
    xkv = rng.normal(size=(s, width)) if cross else xq
    allow = None
    given = None
    if entry.mask:
        allow = rng.random((t, s)) > 0.3
        allow[:, 0] = True  # no row fully masked
        if entry.mask == "keep01":
            given = torch.from_numpy(allow.astype(np.float64))[None]  # (1, T, S)
        else:
            given = torch.from_numpy(np.where(allow, 0.0, -np.inf))
    tq, tkv = torch.from_numpy(xq)[None], torch.from_numpy(xkv)[None]
    with torch.no_grad():
        if entry.call == "x":
            out = module(tq, given) if entry.mask else module(tq)
        elif entry.call == "qkv":
            out = module(tq, tkv, tkv, given)
        else:  # forward(x, y, mask): x the keys' and values' input, y the queries'
            out = module(tkv, tq, given)
    if isinstance(out, tuple):
        out = out[0]
    return _np(out)[0], reference(entry, module, xq, xkv, allow)


@pytest.mark.parametrize("entry", CLASSES, ids=[e.cls.__name__ for e in CLASSES])
def test_the_reference_and_qkv_agree_on_each_real_class(entry: Real) -> None:
    got, want = run_as_its_author(entry)
    right = got.shape == want.shape and np.allclose(got, want, rtol=1e-9, atol=1e-12)
    assert right == (entry.code is None), "the corpus's own verdict is wrong"
    report = check_module(entry.cls)
    wrong = [f.diagnosis for f in report.findings if f.wrong]
    if entry.code is None:
        assert report.ok and wrong == [], report.text()
    else:
        assert wrong == [entry.code], report.text()


def test_the_real_interfaces_are_driven_as_their_authors_meant() -> None:
    cross = check_module(corpus.CrossAttentionRight)
    assert "forward(x, y, mask)" in cross.about and "linear_layer" in cross.about
    assert "0 or −inf, added to the scores" in cross.about
    head = check_module(corpus.GlobalWidthHead)
    assert head.kind == "module: attention, one head, causal"
    assert "(Lq, Lk)" in check_module(corpus.OneWideHead).about


def test_cs336_function_with_a_boolean_mask_is_right() -> None:
    report = check_attention(corpus.cs336_attention)
    assert report.ok and report.with_mask, report.text()
    # the reference: a row masked by the function's convention (True = may attend)
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    allow = rng.random((3, 5)) > 0.4
    allow[:, 0] = True
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    got = corpus.cs336_attention(tq, tk, tv, torch.from_numpy(allow))
    want = _softmax(np.where(allow, q @ k.T / 2.0, -np.inf)) @ v
    assert np.allclose(got.numpy(), want)


def test_the_corpus_never_imports_qkv() -> None:
    tree = ast.parse(Path(corpus.__file__).read_text(encoding="utf-8"))
    names = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [n for n in names if n.split(".")[0] == "qkv"]
