"""``qkv check --function`` and ``qkv.testing``: each slip a student's attention code makes is
named by its code, a correct function gets no finding, and a file that cannot be loaded, loops
forever or crashes is a one-line error with exit status 2.

The buggy functions below are written the way students write them (one slip each), not taken
from the slip table they are diagnosed against (``qkv.check._function_codes.CODES``).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.check import FUNCTION_DIAGNOSES, FunctionError
from qkv.cli import main
from qkv.testing import assert_attention, check_attention

Fn = Callable[..., Any]


def softmax(s: Any, axis: int = -1) -> Any:
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(Q: Any, K: Any, V: Any, mask: Any = None) -> Any:
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    w = softmax(s)
    return w @ V, w


def attention_context_only(Q: Any, K: Any, V: Any) -> Any:
    return attention(Q, K, V)[0]


def attention_fill(Q: Any, K: Any, V: Any, mask: Any) -> Any:
    """masked_fill with -1e9: a fully masked row attends uniformly, no NaN."""
    s = np.where(mask, Q @ K.T / np.sqrt(Q.shape[-1]), -1e9)
    return softmax(s) @ V


def torch_attention(Q: Any, K: Any, V: Any, mask: Any = None) -> Any:
    s = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def torch_context_only(Q: Any, K: Any, V: Any) -> Any:
    return torch.softmax(Q @ K.T / Q.shape[-1] ** 0.5, dim=-1) @ V


def torch_float32(Q: Any, K: Any, V: Any) -> Any:
    """Computes in float32, as most torch code does."""
    Q, K, V = (torch.as_tensor(x, dtype=torch.float32) for x in (Q, K, V))
    return torch.softmax(Q @ K.T / Q.shape[-1] ** 0.5, dim=-1) @ V


def causal(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    return attention(Q, K, V, np.tril(np.ones((lq, lk), dtype=bool)))


def torch_causal(Q: Any, K: Any, V: Any) -> Any:
    return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=True)


def multi_head(
    X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int, *, scale: Any = None,
    average: bool = False,
) -> Any:  # fmt: skip
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    d_head = q.shape[1] // h
    contexts, weights = [], []
    for i in range(h):
        c = slice(i * d_head, (i + 1) * d_head)
        w = softmax(q[:, c] @ k[:, c].T / (scale or np.sqrt(d_head)))
        weights.append(w)
        contexts.append(w @ v[:, c])
    if average:
        return np.mean(weights, axis=0) @ v @ W_o
    return np.concatenate(contexts, axis=-1) @ W_o, np.stack(weights)


def torch_multi_head(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    L, d = X.shape
    q, k, v = ((X @ W).reshape(L, h, d // h).transpose(0, 1) for W in (W_q, W_k, W_v))
    c = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return c.transpose(0, 1).reshape(L, d) @ W_o


# one buggy function per code -------------------------------------------------------------


def unscaled(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ K.T) @ V


def scaled_by_dk(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ K.T / Q.shape[-1]) @ V


def wrong_axis(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ K.T / np.sqrt(Q.shape[-1]), axis=0) @ V


def swapped(Q: Any, K: Any, V: Any) -> Any:
    return softmax(K @ Q.T / np.sqrt(Q.shape[-1])) @ V


def sum_normalised(Q: Any, K: Any, V: Any) -> Any:
    s = Q @ K.T / np.sqrt(Q.shape[-1])
    return (s / s.sum(axis=-1, keepdims=True)) @ V


def no_max_subtraction(Q: Any, K: Any, V: Any) -> Any:
    e = np.exp(Q @ K.T / np.sqrt(Q.shape[-1]))
    return (e / e.sum(axis=-1, keepdims=True)) @ V


def mask_ignored(Q: Any, K: Any, V: Any, mask: Any) -> Any:
    return attention(Q, K, V)[0]


def mask_inverted(Q: Any, K: Any, V: Any, mask: Any) -> Any:
    return attention(Q, K, V, ~mask)[0]


def causal_ignored(Q: Any, K: Any, V: Any) -> Any:
    return attention(Q, K, V)


def causal_inverted(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    return attention(Q, K, V, np.triu(np.ones((lq, lk), dtype=bool), k=1))[0]


def causal_bottom_right(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    return attention(Q, K, V, np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq))


def causal_unscaled(Q: Any, K: Any, V: Any) -> Any:
    lq, lk = Q.shape[0], K.shape[0]
    s = np.where(np.tril(np.ones((lq, lk), dtype=bool)), Q @ K.T, -np.inf)
    return softmax(s) @ V


def mh_by_dmodel(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    return multi_head(X, W_q, W_k, W_v, W_o, h, scale=np.sqrt(X.shape[1]))[0]


def mh_averaged(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    return multi_head(X, W_q, W_k, W_v, W_o, h, average=True)


def mh_transposed(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    return multi_head(X, W_q.T, W_k.T, W_v.T, W_o.T, h)


def mh_unscaled(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    return multi_head(X, W_q, W_k, W_v, W_o, h, scale=1.0)


def mh_scaled_by_dk(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    return multi_head(X, W_q, W_k, W_v, W_o, h, scale=X.shape[1] // h)


def mh_wrong_axis(X: Any, W_q: Any, W_k: Any, W_v: Any, W_o: Any, h: int) -> Any:
    q, k, v = X @ W_q, X @ W_k, X @ W_v
    d = q.shape[1] // h
    parts = [
        softmax(q[:, i * d : (i + 1) * d] @ k[:, i * d : (i + 1) * d].T / np.sqrt(d), axis=0)
        @ v[:, i * d : (i + 1) * d]
        for i in range(h)
    ]
    return np.concatenate(parts, axis=-1) @ W_o


def relu_normalised(Q: Any, K: Any, V: Any) -> Any:
    """A normalisation that is no softmax: negative scores cut to 0, then divided by the sum."""
    s = np.maximum(Q @ K.T / np.sqrt(Q.shape[-1]), 0.0) + 1e-9
    return (s / s.sum(axis=-1, keepdims=True)) @ V


def garbage(Q: Any, K: Any, V: Any) -> Any:
    return attention(Q, K, V)[0] + 0.1


def qk_not_transposed(Q: Any, K: Any, V: Any) -> Any:
    return softmax(Q @ K / np.sqrt(Q.shape[-1])) @ V  # K.T meant: runs only where Lk = d_k


def torch_qk_not_transposed(Q: Any, K: Any, V: Any) -> Any:
    import torch

    s = torch.matmul(Q, K) / Q.shape[-1] ** 0.5
    return torch.softmax(s, dim=-1) @ V


def mask_filled_with_zero(Q: Any, K: Any, V: Any, mask: Any) -> Any:
    s = np.where(mask, Q @ K.T / np.sqrt(Q.shape[-1]), 1e-9)  # "a tiny number"
    return softmax(s) @ V


def mask_filled_with_inf(Q: Any, K: Any, V: Any, mask: Any) -> Any:
    s = np.where(mask, Q @ K.T / np.sqrt(Q.shape[-1]), np.inf)
    return softmax(s) @ V


SLIPPED = [
    ("attention", unscaled, "unscaled"),
    ("attention", scaled_by_dk, "scaled-by-dk"),
    ("attention", wrong_axis, "softmax-wrong-axis"),
    ("attention", swapped, "query-key-swapped"),
    ("attention", sum_normalised, "sum-normalised"),
    ("attention", relu_normalised, "not-softmax"),
    ("attention", no_max_subtraction, "no-max-subtraction"),
    ("attention", mask_ignored, "mask-ignored"),
    ("attention", mask_inverted, "mask-inverted"),
    ("attention", garbage, "unrecognised"),
    ("attention", qk_not_transposed, "qk-not-transposed"),
    ("attention", torch_qk_not_transposed, "qk-not-transposed"),
    ("attention", mask_filled_with_zero, "mask-filled-with-zero"),
    ("attention", mask_filled_with_inf, "mask-filled-with-inf"),
    ("causal", causal_ignored, "mask-ignored"),
    ("causal", causal_inverted, "mask-inverted"),
    ("causal", causal_bottom_right, "causal-misaligned"),
    ("causal", causal_unscaled, "unscaled"),
    ("multi-head", mh_by_dmodel, "scaled-by-dmodel"),
    ("multi-head", mh_averaged, "heads-averaged"),
    ("multi-head", mh_transposed, "transposed-weights"),
    ("multi-head", mh_unscaled, "unscaled"),
    ("multi-head", mh_scaled_by_dk, "scaled-by-dk"),
    ("multi-head", mh_wrong_axis, "softmax-wrong-axis"),
]


@pytest.mark.parametrize(("kind", "fn", "code"), SLIPPED, ids=[f.__name__ for _, f, _ in SLIPPED])
def test_each_slip_is_named_by_its_code(kind: str, fn: Fn, code: str) -> None:
    report = check_attention(fn, kind=kind)
    assert not report.ok
    assert [f.diagnosis for f in report.findings if f.wrong] == [code]
    assert code in FUNCTION_DIAGNOSES


def test_every_function_code_has_a_buggy_function_here() -> None:
    # unbatched and batched inputs: test_function_probes.py; the bugs of issue 26 and
    # grouped-query attention: test_function_codes.py
    from tests.check.test_function_codes import NEW_SLIPS

    tested = {code for _, _, code in SLIPPED} | {"masked-row-nan", "unbatched"}
    tested |= {code for _, _, code, _ in NEW_SLIPS}
    # the slips of attention classes (issue 35): test_module.py and test_real_classes.py
    from tests.check.test_module import MODULE_SLIPS

    tested |= {code for _, code in MODULE_SLIPS}
    assert tested == set(FUNCTION_DIAGNOSES)


CORRECT = [
    ("attention", attention),
    ("attention", attention_context_only),
    ("attention", attention_fill),
    ("attention", torch_attention),
    ("attention", torch_context_only),
    ("attention", torch_float32),
    ("causal", causal),
    ("causal", torch_causal),
    ("multi-head", multi_head),
    ("multi-head", torch_multi_head),
]


@pytest.mark.parametrize(("kind", "fn"), CORRECT, ids=[f.__name__ for _, f in CORRECT])
def test_a_correct_function_has_no_mistake(kind: str, fn: Fn) -> None:
    report = check_attention(fn, kind=kind)
    assert report.ok
    assert [f for f in report.findings if f.wrong] == []
    torch_only = fn.__name__.startswith("torch") and fn is not torch_float32
    assert report.array == ("torch" if torch_only else "numpy")
    assert_attention(fn, kind=kind)


def test_a_fully_masked_row_giving_nan_is_a_note_with_the_policy() -> None:
    report = check_attention(attention, kind="attention")
    assert report.ok
    [note] = report.findings
    assert (note.status, note.diagnosis) == ("note", "masked-row-nan")
    assert "zero weights" in note.message


def test_weights_that_disagree_with_the_context_are_named() -> None:
    def bad_weights(Q: Any, K: Any, V: Any) -> Any:
        context, _ = attention(Q, K, V)
        return context, softmax(Q @ K.T)  # prints the unscaled weights

    report = check_attention(bad_weights, kind="attention")
    assert [(f.step, f.diagnosis) for f in report.findings] == [("weights", "unscaled")]


@pytest.mark.parametrize(
    ("mask_means", "convert"),
    [("ignore", lambda m: ~m), ("additive", lambda m: np.where(m == 0, 0.0, -np.inf))],
)
def test_mask_means_gives_the_mask_in_the_functions_convention(
    mask_means: str, convert: Callable[[Any], Any]
) -> None:
    def with_own_mask(Q: Any, K: Any, V: Any, mask: Any) -> Any:
        if mask_means == "ignore":
            return attention(Q, K, V, ~mask)
        s = Q @ K.T / np.sqrt(Q.shape[-1]) + mask
        return softmax(s) @ V

    assert check_attention(with_own_mask, mask_means=mask_means).ok
    assert not check_attention(with_own_mask, mask_means="allow").ok


def test_bottom_right_alignment_when_asked() -> None:
    assert check_attention(causal_bottom_right, kind="causal", alignment="bottom-right").ok
    report = check_attention(causal, kind="causal", alignment="bottom-right")
    assert [f.diagnosis for f in report.findings] == ["causal-misaligned"]


def test_raising_only_at_large_scores_is_a_mistake() -> None:
    def refuses_large(Q: Any, K: Any, V: Any) -> Any:
        if np.abs(Q).max() > 100:
            raise OverflowError("scores too large")
        return attention(Q, K, V)

    report = check_attention(refuses_large)
    [finding] = report.findings
    assert (finding.diagnosis, finding.token) == ("unrecognised", "large scores")
    assert "raised OverflowError: scores too large" in finding.message


def test_assert_attention_message_says_what_to_fix() -> None:
    with pytest.raises(AssertionError) as caught:
        assert_attention(unscaled, kind="attention")
    message = str(caught.value)
    assert "unscaled" in message and "√d_k" in message and "row 0" in message


def test_a_function_that_cannot_be_called_is_a_function_error() -> None:
    def two_arguments(Q: Any, K: Any) -> Any:
        return Q

    with pytest.raises(FunctionError, match="first probe the function raised TypeError"):
        check_attention(two_arguments)

    def prints(Q: Any, K: Any, V: Any) -> None:
        print(Q @ K.T)

    with pytest.raises(FunctionError, match="the function returned NoneType, not an array"):
        check_attention(prints)
    with pytest.raises(ValueError, match="kind must be one of"):
        check_attention(attention, kind="self")


@settings(max_examples=20, deadline=None)
@given(shift=st.floats(-50, 50), exponent=st.sampled_from([np.exp, np.exp2]))
def test_any_softmax_written_differently_is_still_right_and_base_2_is_not(
    shift: float, exponent: Callable[[Any], Any]
) -> None:
    """softmax(s) = softmax(s + c): a correct function stays correct whatever constant it
    subtracts; exp2 instead of exp is not attention."""

    def shifted(Q: Any, K: Any, V: Any) -> Any:
        s = Q @ K.T / np.sqrt(Q.shape[-1])
        e = exponent(s - s.max(axis=-1, keepdims=True) + shift * 0.01)
        return (e / e.sum(axis=-1, keepdims=True)) @ V

    assert check_attention(shifted).ok == (exponent is np.exp)


# the command line: files run in a separate process -------------------------------------


def write(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "student.py"
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return path


STUDENT = """
    import numpy as np

    def attention(Q, K, V, mask=None):
        s = Q @ K.T{scale}
        if mask is not None:
            s = np.where(mask, s, -1e9)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True) @ V
"""


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exit_0_for_a_right_function(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, STUDENT.format(scale=" / np.sqrt(Q.shape[-1])"))
    code, out, _ = run(["check", "--function", f"{path}:attention", "-f", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data.pop("isolation") in ("bubblewrap", "namespaces", "process")
    assert data == {"ok": True, "findings": []}


def test_cli_exit_1_names_the_slip_in_the_json_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, STUDENT.format(scale=""))
    code, out, _ = run(["check", "--function", f"{path}:attention", "--format", "json"], capsys)
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False
    [finding] = data["findings"]
    assert set(finding) == {
        "step", "token", "claimed", "expected", "status", "diagnosis", "message",
    }  # fmt: skip
    assert (finding["status"], finding["diagnosis"]) == ("mismatch", "unscaled")
    code, out, _ = run(["check", "--function", f"{path}:attention"], capsys)
    assert code == 1 and "mismatch: unscaled" in out
    code, out, _ = run(["check", "--function", f"{path}:attention", "-f", "markdown"], capsys)
    assert code == 1 and "`unscaled`" in out


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("def attention(Q, K, V):\n    while True:\n        pass\n", "did not finish within 3 s"),
        ("import os\ndef attention(Q, K, V):\n    os.abort()\n", "signal SIGABRT"),
        ("raise RuntimeError('boom')\n", "running it: line 1: RuntimeError: boom"),
        ("x = 1\n", "no function named 'attention'"),
        ("def attention(Q):\n    return Q\n", "first probe the function raised TypeError"),
    ],
    ids=["infinite-loop", "crash", "import-error", "no-function", "wrong-signature"],
)
def test_cli_exit_2_one_line_for_a_function_that_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], code: str, message: str
) -> None:
    path = write(tmp_path, code)
    limit = "3" if "finish" in message else "120"  # only the loop needs to meet the limit
    status, out, err = run(["check", "--function", f"{path}:attention", "--timeout", limit], capsys)
    assert status == 2
    assert out == ""
    assert err.startswith("qkv: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_target_and_help_warns_that_the_file_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(["check", "--function", "no-colon.py"], capsys)
    assert status == 2 and "FILE.py:NAME" in err
    status, _, err = run(["check", "--function", f"{tmp_path}/missing.py:f"], capsys)
    assert status == 2 and "no such file" in err
    assert main(["check", "--help"]) == 0
    assert "runs its" in " ".join(capsys.readouterr().out.split())


def test_check_attention_of_a_file_runs_it_in_a_process(tmp_path: Path) -> None:
    path = write(tmp_path, STUDENT.format(scale=" / Q.shape[-1]"))
    report = check_attention(f"{path}:attention")
    assert [f.diagnosis for f in report.findings] == ["scaled-by-dk"]
