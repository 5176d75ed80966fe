"""``qkv check --function``: the bugs people really make that had no name (issue 26), and the
misnamings it fixed.

Each buggy function below is written here from the pattern of the bug, the way a student
writes it (NumPy or torch, one slip each); none is copied from anywhere. The patterns: scores
divided by √Q.ndim or by √num_heads; heads split with a reshape and no transpose, or merged
with one; a causal mask off by one; the mask applied after the softmax; dropout left on at
inference; grouped-query attention with the key/value heads repeated in the wrong order or
not at all. And what was misnamed: a causal mask built with triu, heads averaged after each
head's context, only W_q, W_k, W_v transposed, a fully masked row taken for an overflow.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from qkv.check import FUNCTION_DIAGNOSES
from qkv.cli import main
from qkv.testing import check_attention

Fn = Callable[..., Any]


def softmax(s: Any, axis: int = -1) -> Any:
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def masked_softmax(s: Any, allow: Any) -> Any:
    return softmax(np.where(allow, s, -np.inf))


# single head ------------------------------------------------------------------------------


def scaled_by_ndim(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ K.T / np.sqrt(Q.ndim)) @ V  # meant Q.shape[-1]


def scaled_by_ndim_4d_only(Q: Any, K: Any, V: Any) -> Any:
    _b, _h, _l, _d = Q.shape
    return softmax(Q @ K.transpose(0, 1, 3, 2) / math.sqrt(len(Q.shape))) @ V


def causal_diagonal_hidden(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    allow = np.tril(np.ones((lq, lk), dtype=bool), k=-1)  # k=0 was meant
    return masked_softmax(Q @ K.T / np.sqrt(Q.shape[-1]), allow) @ V


def causal_diagonal_hidden_fill(Q: Any, K: Any, V: Any) -> Any:
    """The same slip with masked_fill(-1e9): the first row attends every key evenly."""
    q, k = torch.as_tensor(Q), torch.as_tensor(K)
    s = q @ k.T / q.shape[-1] ** 0.5
    future = torch.triu(torch.ones(s.shape, dtype=torch.bool), diagonal=0)  # diagonal=1 meant
    return torch.softmax(s.masked_fill(future, -1e9), dim=-1) @ torch.as_tensor(V)


def causal_one_ahead(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    allow = np.tril(np.ones((lq, lk), dtype=bool), k=1)
    return masked_softmax(Q @ K.T / np.sqrt(Q.shape[-1]), allow) @ V


def causal_triu(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    allow = np.triu(np.ones((lq, lk), dtype=bool))  # tril was meant
    return masked_softmax(Q @ K.T / np.sqrt(Q.shape[-1]), allow) @ V


def causal_mask_after_softmax(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    w = softmax(Q @ K.T / np.sqrt(Q.shape[-1]))
    return (w * np.tril(np.ones((lq, lk)))) @ V  # no renormalising


def mask_after_softmax(Q: Any, K: Any, V: Any, mask: Any) -> Any:
    w = softmax(Q @ K.T / np.sqrt(Q.shape[-1]))
    w = np.where(mask, w, 0.0)
    return w @ V, w


def dropout_left_on(Q: Any, K: Any, V: Any) -> Any:
    q, k, v = (torch.as_tensor(x) for x in (Q, K, V))
    w = torch.softmax(q @ k.T / q.shape[-1] ** 0.5, dim=-1)
    return F.dropout(w, p=0.1) @ v  # training=True is F.dropout's default


def numpy_dropout(Q: Any, K: Any, V: Any) -> Any:
    w = softmax(Q @ K.T / np.sqrt(Q.shape[-1]))
    keep = np.random.default_rng().random(w.shape) > 0.2
    return (w * keep / 0.8) @ V


def two_slips_with_an_empty_row(Q: Any, K: Any, V: Any) -> Any:
    """Diagonal hidden and unscaled: unrecognised, and the first row is NaN at any scale."""
    lq, lk = Q.shape[0], K.shape[0]
    return masked_softmax(Q @ K.T, np.tril(np.ones((lq, lk), dtype=bool), k=-1)) @ V


# multi-head (X, W_q, W_k, W_v, W_o, num_heads), row vectors --------------------------------


def softmax_over_batch(Q: Any, K: Any, V: Any) -> Any:
    """Written for (B, H, L, d) tensors: the softmax over dim 0, the batch, not the keys."""
    s = Q @ K.transpose(2, 3) / math.sqrt(Q.shape[3])
    return torch.softmax(s, dim=0) @ V


def causal_softmax_over_batch(Q: Any, K: Any, V: Any) -> Any:
    s = Q @ K.transpose(2, 3) / math.sqrt(Q.shape[3])
    future = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
    return torch.softmax(s.masked_fill(future, float("-inf")), dim=0) @ V


def heads(x: Any, h: int) -> Any:
    """(L, h·d) -> (h, L, d)"""
    length, width = x.shape
    return x.reshape(length, h, width // h).transpose(1, 0, 2)


def mh(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, *, scale: Any = None) -> Any:
    q, k, v = heads(X @ W_q, h), heads(X @ W_k, h), heads(X @ W_v, h)
    d = q.shape[-1]
    w = softmax(q @ k.transpose(0, 2, 1) / (scale if scale is not None else np.sqrt(d)))
    c = w @ v  # (h, L, d)
    return c.transpose(1, 0, 2).reshape(X.shape[0], -1) @ W_o


def mh_scaled_by_num_heads(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    return mh(X, W_q, W_k, W_v, W_o, h, scale=np.sqrt(h))


def mh_scaled_by_dim(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    t = [torch.as_tensor(a) for a in (X, W_q, W_k, W_v, W_o)]
    q, k, v = ((t[0] @ w).view(t[0].shape[0], h, -1).transpose(0, 1) for w in t[1:4])
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.dim()), dim=-1)  # q is (h, L, d)
    return (w @ v).transpose(0, 1).reshape(t[0].shape[0], -1) @ t[4]


def mh_split_without_transpose(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    length = X.shape[0]
    q, k, v = ((X @ w).reshape(h, length, -1) for w in (W_q, W_k, W_v))  # no transpose
    c = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])) @ v
    return c.reshape(length, -1) @ W_o


def mh_merged_without_transpose(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    q, k, v = heads(X @ W_q, h), heads(X @ W_k, h), heads(X @ W_v, h)
    c = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])) @ v  # (h, L, d)
    return c.reshape(X.shape[0], -1) @ W_o  # should transpose to (L, h, d) first


def mh_outputs_averaged(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    q, k, v = heads(X @ W_q, h), heads(X @ W_k, h), heads(X @ W_v, h)
    d = q.shape[-1]
    c = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(d)) @ v
    return np.mean([c[i] @ W_o[i * d : (i + 1) * d] for i in range(h)], axis=0)


def mh_linear_habit(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    """X @ W.T for Q, K and V (as nn.Linear computes), W_o right."""
    return mh(X, W_q.T, W_k.T, W_v.T, W_o, h)


def mh_causal_triu(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    q, k, v = heads(X @ W_q, h), heads(X @ W_k, h), heads(X @ W_v, h)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    allow = np.triu(np.ones(s.shape[-2:], dtype=bool))
    c = masked_softmax(s, allow) @ v
    return c.transpose(1, 0, 2).reshape(X.shape[0], -1) @ W_o


# grouped-query attention -------------------------------------------------------------------


def gqa(
    X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, h_kv: int, *, repeat: Any = None
) -> Any:
    q, k, v = heads(X @ W_q, h), heads(X @ W_k, h_kv), heads(X @ W_v, h_kv)
    if repeat is None:
        k, v = np.repeat(k, h // h_kv, axis=0), np.repeat(v, h // h_kv, axis=0)
    else:
        k, v = repeat(k, h // h_kv), repeat(v, h // h_kv)
    c = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])) @ v
    return c.transpose(1, 0, 2).reshape(X.shape[0], -1) @ W_o


def gqa_tiled(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, h_kv: int) -> Any:
    return gqa(X, W_q, W_k, W_v, W_o, h, h_kv, repeat=lambda a, n: np.tile(a, (n, 1, 1)))


def gqa_modulo(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, h_kv: int) -> Any:
    """Query head i takes key/value head i % h_kv."""
    return gqa(
        X, W_q, W_k, W_v, W_o, h, h_kv, repeat=lambda a, n: a[np.arange(n * len(a)) % len(a)]
    )


def gqa_torch_not_repeated(
    X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, h_kv: int
) -> Any:
    t = [torch.as_tensor(a) for a in (X, W_q, W_k, W_v, W_o)]
    length = t[0].shape[0]
    q = (t[0] @ t[1]).view(length, h, -1).transpose(0, 1)
    k = (t[0] @ t[2]).view(length, h_kv, -1).transpose(0, 1)
    v = (t[0] @ t[3]).view(length, h_kv, -1).transpose(0, 1)
    w = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)  # broadcasts if 1
    return (w @ v).transpose(0, 1).reshape(length, -1) @ t[4]


def gqa_loop_not_repeated(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, h_kv: int) -> Any:
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    d = q.shape[1] // h
    parts = []
    for i in range(h):  # head i of K and V, as if there were h of them
        cols = slice(i * d, (i + 1) * d)
        parts.append(softmax(q[:, cols] @ k[:, cols].T / np.sqrt(d)) @ v[:, cols])
    return np.concatenate(parts, axis=-1) @ W_o


def gqa_as_multi_head(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    """The multi-head signature; the key/value heads counted from W_k's width."""
    h_kv = W_k.shape[1] // (W_q.shape[1] // h)
    return gqa(X, W_q, W_k, W_v, W_o, h, h_kv)


NEW_SLIPS = [
    ("attention", scaled_by_ndim, "scaled-by-ndim", None),
    ("attention", scaled_by_ndim_4d_only, "scaled-by-ndim", None),
    ("causal", causal_diagonal_hidden, "causal-off-by-one", "diagonal is hidden"),
    ("causal", causal_diagonal_hidden_fill, "causal-off-by-one", "diagonal is hidden"),
    ("causal", causal_one_ahead, "causal-off-by-one", "one future key"),
    ("causal", causal_triu, "mask-inverted", "keeps the diagonal"),
    ("causal", causal_mask_after_softmax, "mask-after-softmax", None),
    ("attention", mask_after_softmax, "mask-after-softmax", None),
    ("attention", dropout_left_on, "dropout-at-inference", "Two calls gave row"),
    ("attention", numpy_dropout, "dropout-at-inference", None),
    ("attention", softmax_over_batch, "softmax-over-batch", None),
    ("causal", causal_softmax_over_batch, "softmax-over-batch", None),
    ("multi-head", mh_scaled_by_num_heads, "scaled-by-num-heads", None),
    ("multi-head", mh_scaled_by_dim, "scaled-by-ndim", None),
    ("multi-head", mh_split_without_transpose, "heads-split-without-transpose", None),
    ("multi-head", mh_merged_without_transpose, "heads-merged-without-transpose", None),
    ("multi-head", mh_outputs_averaged, "heads-averaged", "averaged, not added"),
    ("multi-head", mh_linear_habit, "transposed-weights", "W_o as it is"),
    ("gqa", gqa_tiled, "kv-heads-wrong-order", None),
    ("gqa", gqa_modulo, "kv-heads-wrong-order", None),
    ("gqa", gqa_torch_not_repeated, "kv-heads-not-repeated", None),
    ("gqa", gqa_loop_not_repeated, "kv-heads-not-repeated", None),
]


@pytest.mark.parametrize(
    ("kind", "fn", "code", "detail"), NEW_SLIPS, ids=[f.__name__ for _, f, _, _ in NEW_SLIPS]
)
def test_each_real_bug_has_its_code_and_the_correct_numbers(
    kind: str, fn: Fn, code: str, detail: str | None
) -> None:
    report = check_attention(fn, kind=kind)
    assert not report.ok
    assert [f.diagnosis for f in report.findings if f.wrong] == [code]
    [finding] = [f for f in report.findings if f.wrong]
    assert finding.message.startswith(FUNCTION_DIAGNOSES[code][0].upper())
    assert detail is None or detail in finding.message
    assert finding.expected  # the correct numbers of the row
    if code != "kv-heads-not-repeated":
        assert finding.printed and len(finding.expected) == len(finding.printed)
    # every format carries the verdict (issue 26 §3: JSON for every function of the set)
    data = json.loads(report.to_json())
    assert [f["diagnosis"] for f in data["findings"] if f["status"] == "mismatch"] == [code]
    assert code in report.text() and code in report.markdown()


def test_a_function_for_four_axes_knows_it_was_lifted() -> None:
    report = check_attention(scaled_by_ndim_4d_only)
    assert report.array == "numpy (1, 1, L, d)"
    assert [f.diagnosis for f in report.findings] == ["scaled-by-ndim"]


def test_a_fully_masked_row_is_no_overflow() -> None:
    """The first row has no allowed key: NaN at every scale, not only at large scores."""
    report = check_attention(two_slips_with_an_empty_row, kind="causal")
    assert [f.diagnosis for f in report.findings] == ["unrecognised"]


def test_a_causal_mask_off_by_one_is_named_once() -> None:
    report = check_attention(causal_diagonal_hidden, kind="causal")
    assert [f.diagnosis for f in report.findings] == ["causal-off-by-one"]


CORRECT = [
    ("gqa", gqa),
    ("attention", lambda Q, K, V: softmax(Q @ K.T / np.sqrt(Q.shape[-1])) @ V),
]


@pytest.mark.parametrize(("kind", "fn"), CORRECT, ids=[kind for kind, _ in CORRECT])
def test_a_correct_function_makes_none_of_the_new_slips(kind: str, fn: Fn) -> None:
    report = check_attention(fn, kind=kind)
    assert report.ok and report.findings == ()


def test_gqa_with_the_multi_head_signature_and_num_kv_heads() -> None:
    for n in (1, 2, 4):
        assert check_attention(gqa_as_multi_head, kind="multi-head", num_kv_heads=n).ok

    def tiled(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
        h_kv = W_k.shape[1] // (W_q.shape[1] // h)
        return gqa_tiled(X, W_q, W_k, W_v, W_o, h, h_kv)

    report = check_attention(tiled, kind="multi-head", num_kv_heads=2)
    assert [f.diagnosis for f in report.findings] == ["kv-heads-wrong-order"]
    with pytest.raises(ValueError, match="num_kv_heads must be one of 1, 2, 4, 8"):
        check_attention(tiled, kind="multi-head", num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads goes with kind multi-head"):
        check_attention(gqa, kind="gqa", num_kv_heads=2)


# --format json with NaN and inf (issue 26, item 3) -----------------------------------------

RETURNS = {
    "nan": "np.full((Q.shape[0], V.shape[1]), np.nan)",
    "inf": "np.full((Q.shape[0], V.shape[1]), np.inf)",
    "overflow": "np.exp(Q @ K.T) / np.exp(Q @ K.T).sum(-1, keepdims=True) @ V",
}


@pytest.mark.parametrize("returned", list(RETURNS))
@pytest.mark.parametrize("fmt", ["json", "text", "markdown"])
def test_every_format_carries_a_function_that_returns_nan_or_inf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], returned: str, fmt: str
) -> None:
    path = tmp_path / "student.py"
    body = RETURNS[returned]
    path.write_text(f"import numpy as np\n\ndef attention(Q, K, V):\n    return {body}\n")
    status = main(["check", "--function", f"{path}:attention", "--format", fmt])
    out, err = capsys.readouterr()
    assert status == 1, err
    assert "Traceback" not in err
    if fmt == "json":
        data = json.loads(out)
        assert data["ok"] is False and data["findings"]
        for f in data["findings"]:
            assert all(x is None or math.isfinite(x) for x in f["claimed"] + f["expected"])


def test_cli_kind_gqa_and_num_kv_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gqa.py"
    path.write_text(
        textwrap.dedent(
            """
            import numpy as np

            def split(x, h):
                return x.reshape(x.shape[0], h, -1).transpose(1, 0, 2)

            def attention(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads):
                q = split(X @ W_q, num_heads)
                k = np.tile(split(X @ W_k, num_kv_heads), (num_heads // num_kv_heads, 1, 1))
                v = np.tile(split(X @ W_v, num_kv_heads), (num_heads // num_kv_heads, 1, 1))
                s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
                e = np.exp(s - s.max(-1, keepdims=True))
                c = e / e.sum(-1, keepdims=True) @ v
                return c.transpose(1, 0, 2).reshape(X.shape[0], -1) @ W_o
            """
        ),
        encoding="utf-8",
    )
    assert main(["check", "--function", f"{path}:attention", "--kind", "gqa"]) == 1
    out = capsys.readouterr().out
    assert "kv-heads-wrong-order" in out and "h // (H/Hkv)" in " ".join(out.split())
    status = main(
        ["check", "--function", f"{path}:attention", "--kind", "attention", "--num-kv-heads", "2"]
    )
    assert status == 2
    assert "num_kv_heads goes with kind multi-head" in capsys.readouterr().err
