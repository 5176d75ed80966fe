"""Numbers printed by float32 code (issue 26, item 1): the precision policy's ``dtype:``.

A learner who copies a framework's output must not be told the framework is wrong; a
hand-worked exercise that claims 8 exact digits keeps its strict verdict (``dtype:
float64``). The corpus files of float32 printouts (test_corpus.py) check the same on
published examples.
"""

from __future__ import annotations

import numpy as np
import pytest

from qkv.check import check
from qkv.examples import ExampleError, loads


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max())
    out: np.ndarray = e / e.sum()
    return out


SCORES = [0.25, -0.5, 1.125, 0.0625]
EXACT = _softmax(np.array(SCORES))


def example(weights: list[str], dtype: str = "") -> str:
    return (
        "format: 2\n"
        f"{f'dtype: {dtype}' if dtype else ''}\n"
        f"inputs: {{scores: [{SCORES}]}}\n"
        "options: {scale: false}\n"
        f"claimed: {{weights: {{q1: [{', '.join(weights)}]}}}}\n"
    )


def printed(values: np.ndarray, last_off: float = 0.0) -> list[str]:
    texts = [f"{v:.8f}" for v in values]
    texts[-1] = f"{values[-1] + last_off:.8f}"
    return texts


def test_float32_rounding_is_a_note_without_dtype_right_with_float32_a_slip_with_float64() -> None:
    """0.15032543 for 0.15032545: two units of the 8th decimal, a float32 unit or so."""
    texts = printed(EXACT, 2e-8)
    plain = check(loads(example(texts)))
    assert plain.ok
    [row] = plain.findings
    assert (row.status, row.diagnosis) == ("note", "rounding")
    assert "float32" in row.message and "dtype: float32" in row.message
    declared = check(loads(example(texts, "float32")))
    assert declared.ok and declared.findings[0].status == "ok"
    strict = check(loads(example(texts, "float64")))
    assert not strict.ok
    assert strict.findings[0].diagnosis == "digit-slip"


def test_a_real_slip_in_a_float32_printout_is_still_a_mistake() -> None:
    texts = printed(EXACT, 3e-5)  # the 5th decimal: far beyond float32's rounding
    for dtype in ("", "float32"):
        report = check(loads(example(texts, dtype)))
        assert not report.ok
        assert report.findings[0].status == "mismatch"


def test_a_hand_worked_example_with_four_decimals_keeps_its_verdict() -> None:
    """float32 rounding is far below half a unit of the 4th decimal: no number changes."""
    texts = [f"{v:.4f}" for v in EXACT]
    last = int(texts[0][-1])
    texts[0] = texts[0][:-1] + str((last + 3) % 10)  # one digit wrong
    for dtype in ("", "float32", "float64"):
        report = check(loads(example(texts, dtype)))
        assert [f.diagnosis for f in report.findings] == ["digit-slip"], dtype


def test_float16_allows_more_than_float32() -> None:
    texts = printed(EXACT, 4e-5)
    assert not check(loads(example(texts, "float32"))).ok
    assert check(loads(example(texts, "float16"))).ok


def test_a_float32_value_printed_short_is_that_value() -> None:
    """TensorFlow prints 2.46 for the float32 nearest 2.46: no rounding of the last digit is
    carried from it (a slip in a later step is not hidden by it)."""
    text = (
        "format: 2\ndtype: float32\n"
        "embeddings: [[0.1, 0.2], [0.3, 0.4]]\n"
        "weights: {W_q: [[1.5, 0.5], [0.25, 2]], W_k: [[1.5, 0.5], [0.25, 2]], "
        "W_v: [[1, 0], [0, 1]]}\n"
        "claimed:\n"
        "  Q: {t1: [0.2, 0.45000002], t2: [0.55, 0.95]}\n"
        "  K: {t1: [0.2, 0.45000002], t2: [0.55, 0.95]}\n"
        "  weights: {t2: [W1, W2]}\n"
    )
    q = np.array([[0.1, 0.2], [0.3, 0.4]]) @ np.array([[1.5, 0.5], [0.25, 2]])
    w = _softmax(q[1] @ q.T / np.sqrt(2))
    right = text.replace("W1", f"{w[0]:.7f}").replace("W2", f"{w[1]:.7f}")
    assert check(loads(right)).ok
    off = text.replace("W1", f"{w[0] + 4e-4:.7f}").replace("W2", f"{w[1] - 4e-4:.7f}")
    assert not check(loads(off)).ok


@pytest.mark.parametrize("value", ["float", "double", "32"])
def test_an_unknown_dtype_is_one_line_with_a_hint(value: str) -> None:
    with pytest.raises(ExampleError, match=r"dtype: expected one of float64, float32") as caught:
        loads(example([f"{v:.4f}" for v in EXACT], value))
    assert "hint" in str(caught.value).lower() and "\n" not in str(caught.value)
    with pytest.raises(ExampleError, match=r"dtype: expected a floating-point format, got a list"):
        loads(example([f"{v:.4f}" for v in EXACT], "[float32]"))


def test_dtype_is_a_key_of_format_2() -> None:
    text = (
        "dtype: float32\ntokens: [a]\nembeddings: [[1]]\n"
        "weights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}\n"
    )
    with pytest.raises(ExampleError, match="dtype is a key of format 2"):
        loads(text)
