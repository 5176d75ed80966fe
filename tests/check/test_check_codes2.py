"""The diagnosis codes of format 2: each is triggered by an example built here with its slip,
and names it with what the step should have been and the correct numbers.

The slips are the ones of the issue (published tutorials normalising by the sum, inventing
weights, rounding weights before the weighted sum, a digit wrong in an exercise key, masks
and heads mixed up); the correct numbers come from a small NumPy author below, independent
of qkv.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from qkv.check import DIAGNOSES, check
from qkv.check._function import FUNCTION_DIAGNOSES
from qkv.examples import loads

Q = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=float)
K = np.array([[1, 0, 0, 1], [0, 2, 1, 0], [1, 1, 1, 1]], dtype=float)
V = np.array([[1, 2], [3, 0], [0, 4]], dtype=float)
V3 = np.array([[1, 2, 0], [3, 0, 1], [0, 4, 2]], dtype=float)
S = Q @ K.T  # whole numbers: the scores of exact inputs are exact


def softmax(s: np.ndarray) -> np.ndarray:
    s = np.asarray(s, dtype=float)
    e = np.exp(s - s[np.isfinite(s)].max())
    e[~np.isfinite(s)] = 0.0
    out: np.ndarray = e / e.sum()
    return out


def row(values: np.ndarray, decimals: int = 4) -> str:
    return "[" + ", ".join(f"{v:.{decimals}f}" for v in values) + "]"


def example(claimed: str, *, v: np.ndarray = V, extra: str = "", q: np.ndarray = Q) -> str:
    return (
        "format: 2\ntokens: [a, b, c]\ninputs:\n"
        f"  Q: {q.astype(int).tolist()}\n  K: {K.astype(int).tolist()}\n"
        f"  V: {v.astype(int).tolist()}\n{extra}claimed:\n{claimed}"
    )


def diagnosis(text: str) -> tuple[str | None, str]:
    report = check(loads(text))
    wrong = [f for f in report.findings if f.status == "mismatch"]
    assert len(wrong) == 1, report.text()
    return wrong[0].diagnosis, wrong[0].message


def test_unscaled_with_exact_whole_scores_is_caught() -> None:
    """The issue's case: scores printed as whole numbers are exact, so their rounding is not
    carried, and a softmax without √d_k no longer passes."""
    text = example(
        f"  scores: {{a: {S[0].astype(int).tolist()}}}\n  weights: {{a: {row(softmax(S[0]))}}}\n"
    )
    code, message = diagnosis(text)
    assert code == "unscaled"
    assert row(softmax(S[0] / 2)) in message  # the correct weights


def test_a_printed_whole_number_is_exact() -> None:
    """A score printed 3 where the exact score is 2 is a mistake, not a rounding."""
    wrong = S[0].astype(int).tolist()
    wrong[0] += 1
    report = check(loads(example(f"  scores: {{a: {wrong}}}\n")))
    assert report.findings[0].status == "mismatch"


def test_output_off_by_a_fraction_of_a_whole_number_is_caught() -> None:
    context = softmax(S[0] / 2) @ V
    text = example(f"  scores: {{a: {S[0].astype(int).tolist()}}}\n  context: {{a: [1, 3]}}\n")
    report = check(loads(text))
    assert not np.allclose(context, [1, 3], atol=0.5)
    assert report.findings[-1].status == "mismatch"


def test_sum_normalised() -> None:
    scaled = S[0] / 2
    code, message = diagnosis(example(f"  weights: {{a: {row(scaled / scaled.sum())}}}\n"))
    assert code == "sum-normalised"
    assert "row sum instead of going through softmax" in message
    assert row(softmax(scaled)) in message


def test_not_softmax() -> None:
    scaled = S[0] / 2  # [0.5, 0.5, 1.0]
    text = example(f"  scaled: {{a: {row(scaled, 1)}}}\n  weights: {{a: [0.5, 0.2, 0.3]}}\n")
    code, message = diagnosis(text)
    assert code == "not-softmax"
    assert "a smaller weight" in message and row(softmax(scaled), 2) in message


def test_digit_slip() -> None:
    printed = [f"{w:.4f}" for w in softmax(S[1] / 2)]
    right = printed[1]
    printed[1] = right[:-2] + right[-1] + right[-2]  # two digits swapped
    assert printed[1] != right
    code, message = diagnosis(example(f"  weights: {{b: [{', '.join(printed)}]}}\n"))
    assert code == "digit-slip"
    assert f"{printed[1]} should be {right}" in message


def test_digit_slip_one_digit_wrong() -> None:
    printed = [f"{w:.4f}" for w in softmax(S[1] / 2)]
    printed[2] = printed[2][:3] + str((int(printed[2][3]) + 4) % 10) + printed[2][4:]
    code, _ = diagnosis(example(f"  weights: {{b: [{', '.join(printed)}]}}\n"))
    assert code == "digit-slip"


def test_other_weights_rounded() -> None:
    weights = softmax(S[0] / 2)
    rounded = np.round(weights, 1)
    text = example(f"  weights: {{a: {row(weights)}}}\n  context: {{a: {row(rounded @ V)}}}\n")
    code, message = diagnosis(text)
    assert code == "other-weights"
    assert "[0.3000, 0.3000, 0.5000]" in message and row(weights @ V) in message


def test_other_weights_assumed() -> None:
    text = example(f"  context: {{a: {row(np.array([0.5, 0.25, 0.25]) @ V3)}}}\n", v=V3)
    code, message = diagnosis(text)
    assert code == "other-weights"
    assert "[0.5000, 0.2500, 0.2500]" in message


def test_assumed_weights_are_not_checked_and_feed_the_context() -> None:
    assumed = np.array([0.5, 0.25, 0.25])
    text = example(
        f"  context: {{a: {row(assumed @ V)}}}\n",
        extra=f"assumed:\n  weights: {{a: {assumed.tolist()}}}\n",
    )
    report = check(loads(text))
    assert report.ok and [f.step for f in report.findings] == ["context"]


def test_mask_ignored() -> None:
    text = example(
        f"  weights: {{a: {row(softmax(S[0] / 2))}}}\n", extra="options: {causal: true}\n"
    )
    code, message = diagnosis(text)
    assert code == "mask-ignored"
    assert "[1.0000, 0.0000, 0.0000]" in message


def test_mask_inverted() -> None:
    padded = np.array([False, False, True])  # key_length: 2 masks c
    weights = softmax(np.where(padded, S[1] / 2, -np.inf))
    text = example(f"  weights: {{b: {row(weights)}}}\n", extra="options: {key_length: 2}\n")
    code, _ = diagnosis(text)
    assert code == "mask-inverted"


def test_mask_inverted_seen_in_printed_minus_infinity() -> None:
    scaled = S[0] / 2
    text = example(
        f"  scaled: {{a: [-inf, {scaled[1]:.1f}, {scaled[2]:.1f}]}}\n",
        extra="options: {causal: true}\n",
    )
    code, message = diagnosis(text)
    assert code == "mask-inverted"
    assert "wrong keys" in message


def test_causal_misaligned() -> None:
    q = Q[:2]
    scaled = q @ K.T / 2
    top_left = np.arange(3)[None] <= np.arange(2)[:, None]
    weights = softmax(np.where(top_left[1], scaled[1], -np.inf))
    text = example(
        f"  weights: {{q2: {row(weights)}}}\n", q=q, extra="options: {causal: bottom-right}\n"
    )
    code, message = diagnosis(text)
    assert code == "causal-misaligned"
    assert row(softmax(scaled[1])) in message  # bottom-right: the last query sees every key


def _heads(factor: float, averaged: bool = False) -> np.ndarray:
    weights = [
        np.array(
            [
                softmax(Q[i, 2 * h : 2 * h + 2] @ K[:, 2 * h : 2 * h + 2].T * factor)
                for i in range(3)
            ]
        )
        for h in range(2)
    ]
    if averaged:
        out: np.ndarray = (weights[0] + weights[1]) / 2 @ V
        return out
    return np.concatenate([weights[h] @ V[:, h : h + 1] for h in range(2)], axis=1)


def test_scaled_by_dmodel() -> None:
    context = _heads(1 / np.sqrt(4))  # √d_model = √4 instead of √d_head = √2
    text = example(f"  context: {{a: {row(context[0])}}}\n", extra="heads: 2\n")
    code, message = diagnosis(text)
    assert code == "scaled-by-dmodel"
    assert row(_heads(1 / np.sqrt(2))[0]) in message


def test_heads_averaged() -> None:
    context = _heads(1 / np.sqrt(2), averaged=True)
    code, message = diagnosis(example(f"  context: {{a: {row(context[0])}}}\n", extra="heads: 2\n"))
    assert code == "heads-averaged"
    assert row(_heads(1 / np.sqrt(2))[0]) in message


def test_per_head_weights_are_checked_per_head() -> None:
    right = softmax(Q[0, 2:] @ K[:, 2:].T / np.sqrt(2))
    text = example(
        f"  per_head:\n    - {{}}\n    - weights: {{a: {row(right)}}}\n", extra="heads: 2\n"
    )
    report = check(loads(text))
    assert report.ok and report.findings[0].head == 1
    assert report.to_dict()["findings"][0]["head"] == 1


def test_heads_are_counted_from_0_in_every_format() -> None:
    """The second ``per_head`` mapping is head 1 in text, Markdown and JSON, as in ``qkv
    explain`` and traces (issue 25 §2; before: head 2 in all three)."""
    wrong = softmax(Q[0, 2:] @ K[:, 2:].T)  # head 1 not scaled
    text = example(
        f"  per_head:\n    - {{}}\n    - weights: {{a: {row(wrong)}}}\n", extra="heads: 2\n"
    )
    report = check(loads(text))
    (finding,) = report.findings
    assert finding.head == 1 and finding.diagnosis == "unscaled"
    assert report.to_dict()["findings"][0]["head"] == 1
    assert "weights · Attention weights, head 1" in report.text()
    assert "head 2" not in report.text() + report.markdown()
    assert "Attention weights, head 1" in report.markdown()


@pytest.mark.parametrize("stable", [False, True])
def test_exponentials_plain_or_max_subtracted(stable: bool) -> None:
    scaled = S[0] / 2
    e = np.exp(scaled - (scaled.max() if stable else 0.0))
    text = example(f"  exp: {{a: {row(e)}}}\n  exp_sum: {{a: {e.sum():.4f}}}\n")
    assert check(loads(text)).ok


def test_wrong_exponential_is_caught() -> None:
    e = np.exp(S[0] / 2) * 1.1
    report = check(loads(example(f"  exp: {{a: {row(e)}}}\n")))
    assert report.findings[0].status == "mismatch"


def test_products() -> None:
    weights = softmax(S[2] / 2)
    terms = weights[:, None] * V
    rows = "[" + ", ".join(row(t) for t in terms) + "]"
    assert check(loads(example(f"  products: {{c: {rows}}}\n"))).ok
    terms[1, 0] += 0.5
    rows = "[" + ", ".join(row(t) for t in terms) + "]"
    assert not check(loads(example(f"  products: {{c: {rows}}}\n"))).ok


def test_declared_precision_widens_by_the_true_effect() -> None:
    """A notebook prints inputs to 2 decimals and computes with the full values."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4))
    w_q, w_k, w_v = (rng.normal(size=(4, 2)) for _ in range(3))
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    weights = softmax(q[0] @ k.T / np.sqrt(2))

    def m(a: np.ndarray) -> str:
        return str(np.round(a, 2).tolist())

    text = (
        f"format: 2\ntokens: [a, b, c]\nembeddings: {m(x)}\nweights:\n  W_q: {m(w_q)}\n"
        f"  W_k: {m(w_k)}\n  W_v: {m(w_v)}\n{{precision}}claimed:\n  Q: {{{{a: {row(q[0])}}}}}\n"
        f"  weights: {{{{a: {row(weights)}}}}}\n  context: {{{{a: {{context}}}}}}\n"
    )
    right = row(weights @ v)
    assert not check(loads(text.format(precision="", context=right))).ok
    assert check(loads(text.format(precision="precision: 2\n", context=right))).ok
    off = row(weights @ v + 0.3)
    assert not check(loads(text.format(precision="precision: 2\n", context=off))).ok


def test_one_vocabulary_with_check_function() -> None:
    """Codes that --function also reports are described in the same words."""
    for code in (
        "scaled-by-dmodel",
        "sum-normalised",
        "mask-ignored",
        "mask-inverted",
        "causal-misaligned",
        "heads-averaged",
    ):
        assert DIAGNOSES[code] == FUNCTION_DIAGNOSES[code]


def test_format1_files_keep_their_rules() -> None:
    """not-softmax is format 2's: a format-1 file keeps its verdict there (the precision
    policy and the other codes apply to both: test_check_format1_policy.py)."""
    text = (
        "tokens: [a, b, c]\nembeddings: [[1, 0], [0, 1], [1, 1]]\n"
        "weights: {W_q: [[1, 0], [0, 1]], W_k: [[1, 0], [0, 1]], W_v: [[1, 0], [0, 1]]}\n"
        "claimed: {weights: {a: [0.5, 0.2, 0.3]}}\n"
    )
    assert check(loads(text)).findings[0].diagnosis == "arithmetic"
    assert check(loads("format: 2\n" + text)).findings[0].diagnosis == "not-softmax"


def _doc_examples() -> list[str]:
    doc = Path(__file__).resolve().parents[2] / "docs" / "check.md"
    return re.findall(r"```yaml\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)


def test_docs_show_an_example_of_each_format2_code() -> None:
    """docs/check.md has a file per format-2 code; each gives the code of its name."""
    names = [loads(text).name for text in _doc_examples()]
    assert names == list(FORMAT2_CODES)


FORMAT2_CODES = (
    "unscaled",
    "sum-normalised",
    "not-softmax",
    "exps-rounded-to-zero",
    "other-weights",
    "digit-slip",
    "mask-ignored",
    "mask-inverted",
    "causal-misaligned",
    "scaled-by-dmodel",
    "heads-averaged",
)


@pytest.mark.parametrize("k", range(len(FORMAT2_CODES)))
def test_each_documented_code_example_gives_its_code(k: int) -> None:
    example = loads(_doc_examples()[k])
    report = check(example)
    wrong = [f for f in report.findings if f.status == "mismatch"]
    assert [f.diagnosis for f in wrong] == [example.name], report.text()
    correct = [f"{x:.{wrong[0].decimals}f}" for x in wrong[0].expected]
    assert all(number in wrong[0].message for number in correct)  # the correct numbers
