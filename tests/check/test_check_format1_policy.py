"""Format-1 files get the precision policy and the codes of forward slips; ``other-weights``
comes last, in both formats.

Issue 15's held-out corpus of 19 published examples was written in format 1, and its three
misses were an unscaled softmax of whole-number scores passing as correct (the text states
the scaled formula), a context off by 0.68 with whole-number inputs passing as correct, and
slips outside format 1's codes. The three whole-number examples below were "all rows
match" while the policy was format 2's alone (checked against commit 280b72d's rules); they
are mistakes now. Every test here but the format-1 wrong-query one failed on those rules.

The expected numbers come from the small NumPy softmax below, independent of qkv.
"""

from __future__ import annotations

import numpy as np

from qkv.check import Report, check
from qkv.examples import loads

EYE = [[1, 0], [0, 1]]

X3 = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]])
W_Q3 = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]])
W_K3 = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]])
W_V3 = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]])


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def row(values: np.ndarray, decimals: int = 2) -> str:
    return "[" + ", ".join(f"{v:.{decimals}f}" for v in values) + "]"


def whole(values: np.ndarray) -> str:
    return str(np.asarray(values).astype(int).tolist())


def verdicts(report: Report) -> list[tuple[str, str, str | None]]:
    return [(f.step, f.status, f.diagnosis) for f in report.findings]


# -- the precision policy in format 1 -----------------------------------------------------------


def test_unscaled_softmax_of_whole_scores_is_unscaled_in_format1() -> None:
    """Scores 1, 1, 2 from whole inputs are exact, not "anything in 0.5–2.5"; the weights are
    the softmax of the unscaled scores, though the file (scale: true) divides by √2."""
    x = np.array([[1, 0], [0, 1], [1, 1]])
    scores = x @ x.T
    unscaled = softmax(scores[2].astype(float))
    text = (
        f"tokens: [a, b, c]\nembeddings: {whole(x)}\n"
        f"weights: {{W_q: {EYE}, W_k: {EYE}, W_v: {EYE}}}\noptions: {{scale: true}}\n"
        f"claimed:\n  scores: {{c: {whole(scores[2])}}}\n  weights: {{c: {row(unscaled)}}}\n"
    )
    report = check(loads(text))
    assert verdicts(report) == [("scores", "ok", None), ("weights", "mismatch", "unscaled")]
    assert not report.ok
    right = softmax(scores[2] / np.sqrt(2.0))
    assert row(right) in report.findings[1].message  # what the weights should have been


def test_scaled_scores_printed_then_an_unscaled_softmax_in_format1() -> None:
    """The text prints the scaled scores right (÷√3) and then takes the softmax of the raw
    whole-number scores, with d_k = 3 and weights to 2 decimals."""
    q, k = X3 @ W_Q3, X3 @ W_K3
    scores = (q @ k.T)[0]
    text = (
        f"tokens: [a, b, c]\nembeddings: {whole(X3)}\n"
        f"weights: {{W_q: {whole(W_Q3)}, W_k: {whole(W_K3)}, W_v: {whole(W_V3)}}}\n"
        f"claimed:\n  scores: {{a: {whole(scores)}}}\n"
        f"  scaled: {{a: {row(scores / np.sqrt(3.0))}}}\n"
        f"  weights: {{a: {row(softmax(scores.astype(float)))}}}\n"
    )
    report = check(loads(text))
    assert verdicts(report) == [
        ("scores", "ok", None),
        ("scaled", "ok", None),
        ("weights", "mismatch", "unscaled"),
    ]


def test_context_off_by_068_with_whole_inputs_is_a_mismatch_in_format1() -> None:
    """Whole embeddings and weights: Q, K, V and the scores are exact, the weights are right
    to 2 decimals, and one number of the context is 0.68 too large."""
    q, k, v = X3 @ W_Q3, X3 @ W_K3, X3 @ W_V3
    weights = softmax((q @ k.T) / np.sqrt(3.0))
    context = weights @ v
    wrong = context[0].copy()
    wrong[1] += 0.68
    keys = ", ".join(f"{t}: {whole(k[j])}" for j, t in enumerate("abc"))
    values = ", ".join(f"{t}: {whole(v[j])}" for j, t in enumerate("abc"))
    text = (
        f"tokens: [a, b, c]\nembeddings: {whole(X3)}\n"
        f"weights: {{W_q: {whole(W_Q3)}, W_k: {whole(W_K3)}, W_v: {whole(W_V3)}}}\n"
        f"claimed:\n  Q: {{a: {whole(q[0])}}}\n  K: {{{keys}}}\n  V: {{{values}}}\n"
        f"  scores: {{a: {whole((q @ k.T)[0])}}}\n  weights: {{a: {row(weights[0])}}}\n"
        f"  context: {{a: {row(wrong)}}}\n"
    )
    report = check(loads(text))
    assert [f.status for f in report.findings] == ["ok"] * 9 + ["mismatch"]
    last = report.findings[-1]
    assert last.marks == ("ok", "wrong", "ok")
    assert f"{wrong[1]:.2f} should be {context[0, 1]:.2f}" in last.message


def test_one_digit_wrong_in_an_answer_key_is_a_digit_slip_in_format1() -> None:
    """An exercise's expected weights with one digit wrong (the issue's held-out kind)."""
    q, k = X3 @ W_Q3, X3 @ W_K3
    weights = softmax((q @ k.T) / np.sqrt(3.0))[1]
    printed = [f"{w:.4f}" for w in weights]
    right = printed[2]
    printed[2] = right[:3] + str((int(right[3]) + 3) % 10) + right[4:]
    text = (
        f"tokens: [a, b, c]\nembeddings: {whole(X3)}\n"
        f"weights: {{W_q: {whole(W_Q3)}, W_k: {whole(W_K3)}, W_v: {whole(W_V3)}}}\n"
        f"claimed:\n  weights: {{b: [{', '.join(printed)}]}}\n"
    )
    (finding,) = check(loads(text)).findings
    assert (finding.status, finding.diagnosis) == ("mismatch", "digit-slip")
    assert f"{printed[2]} should be {right}" in finding.message


def test_a_masked_score_printed_as_minus_1e9_matches_in_format1() -> None:
    """Format 1 prints finite numbers only: a causal tutorial writes −10⁹ for a masked key."""
    x = np.array([[1, 0], [0, 1], [1, 1]])
    scaled = (x @ x.T)[1] / np.sqrt(2.0)
    text = (
        f"tokens: [a, b, c]\nembeddings: {whole(x)}\n"
        f"weights: {{W_q: {EYE}, W_k: {EYE}, W_v: {EYE}}}\noptions: {{causal: true}}\n"
        f"claimed:\n  scaled: {{b: [{scaled[0]:.4f}, {scaled[1]:.4f}, -1e9]}}\n"
    )
    assert verdicts(check(loads(text))) == [("scaled", "ok", None)]


def test_format1_causal_row_without_the_mask_is_mask_ignored() -> None:
    x = np.array([[1, 0], [0, 1], [1, 1]])
    scaled = (x @ x.T) / np.sqrt(2.0)
    text = (
        f"tokens: [a, b, c]\nembeddings: {whole(x)}\n"
        f"weights: {{W_q: {EYE}, W_k: {EYE}, W_v: {EYE}}}\noptions: {{causal: true}}\n"
        f"claimed:\n  weights: {{a: {row(softmax(scaled[0]), 4)}}}\n"
    )
    (finding,) = check(loads(text)).findings
    assert (finding.status, finding.diagnosis) == ("mismatch", "mask-ignored")
    assert "[1.0000, 0.0000, 0.0000]" in finding.message


# -- other-weights only when no named slip explains the row -------------------------------------

X = np.array([[1.0, 0.2], [0.4, 0.9], [0.3, 0.5]])
W_Q = np.array([[0.8, 0.1], [0.3, 0.6]])
W_K = np.array([[0.2, 0.7], [0.9, 0.4]])
W_V = np.array([[1.0, 0.5], [0.2, 0.8]])


def format1(claimed: str) -> str:
    return (
        f"tokens: [cat, dog, fish]\nembeddings: {X.tolist()}\n"
        f"weights: {{W_q: {W_Q.tolist()}, W_k: {W_K.tolist()}, W_v: {W_V.tolist()}}}\n"
        f"claimed:\n{claimed}"
    )


def format2(claimed: str) -> str:
    q, k, v = X @ W_Q, X @ W_K, X @ W_V
    return (
        f"format: 2\ntokens: [cat, dog, fish]\ninputs:\n  Q: {q.tolist()}\n"
        f"  K: {k.tolist()}\n  V: {v.tolist()}\nclaimed:\n{claimed}"
    )


def _context_of_another_query() -> tuple[np.ndarray, np.ndarray]:
    q, k, v = X @ W_Q, X @ W_K, X @ W_V
    contexts = softmax(q @ k.T / np.sqrt(2.0)) @ v
    return contexts[1], contexts


def test_a_context_made_with_another_query_is_wrong_query_in_format1() -> None:
    """With two values and three keys, weights solved from the row reproduce it exactly;
    the named slip (the query of "dog" used for "cat") must still win."""
    slipped, _ = _context_of_another_query()
    (finding,) = check(loads(format1(f"  context: {{cat: {row(slipped, 4)}}}\n"))).findings
    assert (finding.status, finding.diagnosis) == ("mismatch", "wrong-query")
    assert 'the query vector of "dog"' in finding.message


def test_a_context_made_with_another_query_is_wrong_query_in_format2() -> None:
    """Q, K, V given directly and no weights printed (H18p's case)."""
    slipped, _ = _context_of_another_query()
    (finding,) = check(loads(format2(f"  context: {{cat: {row(slipped, 4)}}}\n"))).findings
    assert (finding.status, finding.diagnosis) == ("mismatch", "wrong-query")


def test_other_weights_remains_when_no_named_slip_explains_the_row() -> None:
    """Weights rounded to one decimal before the weighted sum: no forward slip gives that,
    so other-weights is still the answer, in both formats."""
    q, k, v = X @ W_Q, X @ W_K, X @ W_V
    weights = softmax(q @ k.T / np.sqrt(2.0))[0]
    rounded = np.round(weights, 1)
    claimed = row(weights, 4), row(rounded @ v, 4)
    for text in (
        format1(f"  weights: {{cat: {claimed[0]}}}\n  context: {{cat: {claimed[1]}}}\n"),
        format2(f"  weights: {{cat: {claimed[0]}}}\n  context: {{cat: {claimed[1]}}}\n"),
    ):
        report = check(loads(text))
        assert verdicts(report) == [
            ("weights", "ok", None),
            ("context", "mismatch", "other-weights"),
        ], report.text()
        assert row(rounded, 4) in report.findings[1].message
        assert row(weights @ v, 4) in report.findings[1].message  # the correct context


# -- digit-slip: the rest of the row must be right ----------------------------------------------


def test_a_digit_slip_needs_the_rest_of_the_row_right() -> None:
    """One digit wrong and another number one unit off is not "one digit wrong, the rest
    right": arithmetic, in both formats (seed 000's key vector of "statistics" in format 1)."""
    q, k = X @ W_Q, X @ W_K
    scores = q @ k.T
    printed = [f"{s:.3f}" for s in scores[0]]
    printed[0] = printed[0][:2] + str((int(printed[0][2]) + 2) % 10) + printed[0][3:]
    printed[2] = next(  # off by less than one unit of the last digit, more than half
        f"{scores[0, 2] + d:.3f}"
        for d in (0.001, -0.001)
        if 0.0005 < abs(round(scores[0, 2] + d, 3) - scores[0, 2]) <= 0.001
    )
    claimed = f"  scores: {{cat: [{', '.join(printed)}]}}\n"
    for text in (format1(claimed), format2(claimed)):
        (finding,) = check(loads(text)).findings
        assert finding.marks[1:] == ("ok", "rounding"), text
        assert (finding.status, finding.diagnosis) == ("mismatch", "arithmetic")
    one_digit = claimed.replace(printed[2], f"{scores[0, 2]:.3f}")
    (finding,) = check(loads(format2(one_digit))).findings
    assert finding.diagnosis == "digit-slip"
