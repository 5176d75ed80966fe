"""``--kind flash`` in the test's process (``qkv.testing.check_flash``): each slip of a
FlashAttention forward and backward, made by a student-style submission
(``tests/check/flash_students.py``, which cites what was studied), is named by its code;
a right one passes, in both conventions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from qkv.check._flash import flash_probes
from qkv.check._flash_codes import FLASH_DIAGNOSES
from qkv.testing import check_flash
from tests.check import flash_students as students

torch = pytest.importorskip("torch")

_SLIPS = sorted(code for code in students.SUBMISSIONS if code)


def test_every_code_has_a_submission_that_makes_it() -> None:
    assert set(_SLIPS) == set(FLASH_DIAGNOSES) - {"flash-unrecognised"}


@pytest.mark.parametrize("code", ["", *_SLIPS])
def test_each_submission_is_named_by_its_slip(code: str) -> None:
    report = check_flash(students.load(code))
    assert [f.diagnosis for f in report.findings if f.wrong] == ([code] if code else [])
    assert report.ok is (code == "")


@pytest.mark.parametrize("code", [c for c in _SLIPS if not c.startswith("flash-backward")])
def test_each_forward_slip_is_wrong_by_our_own_reference(code: str) -> None:
    """The truth, without qkv: somewhere the submission's O (or its L) is not attention's."""
    entry = students.load(code)
    wrong = False
    for p in flash_probes():
        want, want_lse = students.reference(p.q, p.k, p.v, p.causal)
        try:
            got, got_lse = students.run(entry, p.q, p.k, p.v, p.causal)
        except Exception:
            wrong = True
            continue
        wrong |= not np.allclose(got, want, atol=1e-3)
        wrong |= got_lse is not None and not np.allclose(got_lse, want_lse, atol=1e-3)
    assert wrong
    right, right_lse = students.run(students.load(""), p.q, p.k, p.v, p.causal)
    assert right_lse is not None
    assert np.allclose(right, want, atol=1e-3) and np.allclose(right_lse, want_lse, atol=1e-3)


def test_the_message_names_the_probe_and_the_shape() -> None:
    report = check_flash(students.load("flash-raised"))
    (finding,) = report.findings
    assert "n_q = 20, n_k = 100, Q (2, 20, 16), K (2, 100, 16)" in finding.message
    assert "AssertionError" in finding.message


def test_the_cs336_contract_marks_nothing_outside_it() -> None:
    """Part (a) lets is_causal be ignored and promises power-of-2 lengths: the course's
    own test shape passes, and what is outside it is not marked."""
    for code in ("flash-causal-ignored", "flash-raised"):
        assert check_flash(students.load(code), contract="cs336").ok
    assert not check_flash(students.load("flash-no-rescale"), contract="cs336").ok


def test_a_function_returning_o_only_is_checked_on_o() -> None:
    def attention(Q, K, V, is_causal=False):
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=is_causal)

    assert check_flash(attention).ok


def test_a_function_that_always_raises_is_one_error() -> None:
    from qkv.check import FunctionError

    def attention(Q, K, V, is_causal=False):
        raise RuntimeError("not yet")

    with pytest.raises(FunctionError, match="RuntimeError: not yet on every probe"):
        check_flash(attention)


def test_a_split_kv_merge_names_the_nan_of_an_empty_split() -> None:
    """A hand-written split-KV merge (keys in splits of 64, each split's softmax and
    log-sum-exp, merged by their log-sum-exps): a causal split with no allowed key has
    L = −inf and O = NaN, and exp(−inf − L)·NaN is NaN."""

    def merged(Q, K, V, is_causal=False):
        scale = Q.shape[-1] ** -0.5
        n_q, n_k = Q.shape[-2], K.shape[-2]
        outs, lses = [], []
        for start in range(0, n_k, 64):
            s = Q @ K[..., start : start + 64, :].transpose(-1, -2) * scale
            if is_causal:
                cols = torch.arange(start, start + s.shape[-1])
                s = s.masked_fill(cols > torch.arange(n_q)[:, None], float("-inf"))
            outs.append(torch.softmax(s, -1) @ V[..., start : start + 64, :])
            lses.append(torch.logsumexp(s, -1))
        lse = torch.logsumexp(torch.stack(lses), 0)
        out = sum(torch.exp(x - lse)[..., None] * o for x, o in zip(lses, outs, strict=True))
        return out, lse

    report = check_flash(merged)
    assert [f.diagnosis for f in report.findings] == ["flash-empty-tile-nan"]
    assert report.findings[0].printed[0] == "nan"


def _ring(guard: bool) -> Any:
    """Ring attention as one process plays it: the keys and values in 4 shards, one per
    rank; each step attends the shard that arrives and merges its (O_i, L_i) into the running
    (O, L) in ring-flash-attention's form: O -= σ(L_i − L)·(O − O_i), L -= log σ(L − L_i).
    Under the causal rule a shard can hold no allowed key for some rows (L_i = −inf, O_i =
    NaN); ``guard`` keeps those rows as they are."""

    def ring(Q, K, V, is_causal=False):
        scale = Q.shape[-1] ** -0.5
        n_q = Q.shape[-2]
        out = lse = None
        start = 0
        for k, v in zip(K.chunk(4, dim=-2), V.chunk(4, dim=-2), strict=True):
            s = Q @ k.transpose(-1, -2) * scale
            if is_causal:
                cols = torch.arange(start, start + k.shape[-2])
                s = s.masked_fill(cols > torch.arange(n_q)[:, None], float("-inf"))
            start += k.shape[-2]
            block_out, block_lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
            if out is None or lse is None:
                out, lse = block_out, block_lse
                continue
            weight = torch.sigmoid(block_lse - lse)[..., None]
            step = weight * (out - block_out)
            if guard:
                empty = torch.isneginf(block_lse)
                step = torch.where(empty[..., None], 0.0, step)
                lse = torch.where(empty, lse, lse - torch.nn.functional.logsigmoid(lse - block_lse))
            else:
                lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
            out = out - step
        return out, lse

    return ring


def test_a_ring_attention_step_is_checked_like_a_kernel() -> None:
    """The merge of a ring attention step, with the float64 oracle: right when a shard with
    no allowed key leaves its rows alone, and the NaN named when it does not."""
    assert check_flash(_ring(guard=True)).ok
    report = check_flash(_ring(guard=False))
    assert [f.diagnosis for f in report.findings][:1] == ["flash-empty-tile-nan"]


def test_a_kernel_with_a_base_2_log_sum_exp_is_named() -> None:
    """A kernel returning (O, L) with L from exp2/log2 (FlashInfer's convention) where
    flash-attn's natural log is expected: named, not 'not close'."""

    def kernel(Q, K, V, is_causal=False):
        s = Q @ K.transpose(-1, -2) * (Q.shape[-1] ** -0.5 * 1.4426950408889634)
        if is_causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse2 = torch.logsumexp(s * 0.6931471805599453, -1) * 1.4426950408889634
        return torch.softmax(s * 0.6931471805599453, -1) @ V, lse2

    report = check_flash(kernel)
    assert [(f.diagnosis, f.step) for f in report.findings] == [("flash-lse-wrong-base", "lse")]


def test_every_code_has_its_row_in_the_docs() -> None:
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "check-function.md"
    text = page.read_text(encoding="utf-8")
    for code in FLASH_DIAGNOSES:
        assert f"| `{code}` |" in text or f"`{code}`" in text.split("## FlashAttention")[1], code


@pytest.mark.parametrize("index", range(len(flash_probes())))
def test_the_slips_algorithm_done_right_is_qkv_tiled_kernel(index: int) -> None:
    """The float64 FlashAttention the slips are made from, done right, gives the numbers of
    qkv's own tiled steps (``qkv explain --tiled``), forward and backward, on every probe."""
    from qkv.attention._tiled_steps import tiled_steps
    from qkv.check._flash_slips import FlashSlip, backward, tiled

    p = flash_probes()[index]
    out, lse = tiled(p.q, p.k, p.v, p.causal, FlashSlip(), 32, 32)
    d_q, d_k, d_v = backward(p.q, p.k, p.v, p.d_out, causal=p.causal)
    lead = p.q.shape[:-2]
    for at in np.ndindex(*lead):
        steps = tiled_steps(
            p.q[at], p.k[at], p.v[at], block_size=32, causal=p.causal, d_out=p.d_out[at]
        )
        np.testing.assert_allclose(out[at], steps.output, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(lse[at], steps.lse, rtol=1e-9, atol=1e-9)
        for mine, theirs in ((d_q, steps.dq), (d_k, steps.dk), (d_v, steps.dv)):
            np.testing.assert_allclose(mine[at], theirs, rtol=1e-7, atol=1e-7)


def test_what_a_submission_gives_nothing_to_check_of_is_said() -> None:
    """O alone gives no L to check, and a function no backward: the report says so, and
    qkv grade gives those parts nothing (tests/grade/test_flash_class.py)."""

    def o_only(Q, K, V, is_causal=False):
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=is_causal)

    def o_and_l(Q, K, V, is_causal=False):
        s = Q @ K.transpose(-1, -2) * Q.shape[-1] ** -0.5
        if is_causal:
            n_q, n_k = s.shape[-2:]
            s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)

    report = check_flash(o_only)
    assert report.ok and report.untaken == ("lse", "backward")
    assert "no log-sum-exp returned or saved" in report.text()
    report = check_flash(o_and_l)
    assert report.ok and report.untaken == ("backward",)
