"""Exponentials rounded to 0.00 and carried on: the sum is 0 and the weights 0/0.

The rounding a learner carries from earlier steps lets each weight move by the derivative
of w = e / Σe, which has no bound near Σe = 0; such weights must not pass as "following from
their own numbers". Found by the format-2 property test (a causal example, Lq > Lk, whose
first row's only exponential, e⁻⁷ = 0.000912, was printed 0.00).
"""

from __future__ import annotations

from qkv.check import check
from qkv.examples import loads

CARRIED = """format: 2
inputs: {scores: [[-9, -10, -12]]}
options: {scale: false}
claimed:
  exp: {q1: [0.00, 0.00, 0.00]}
  exp_sum: {q1: [0]}
  weights: {q1: [%s]}
"""


def test_weights_of_a_zero_sum_are_a_mistake_named_for_it() -> None:
    report = check(loads(CARRIED % "0.00, 0.00, 0.00"))
    (wrong,) = [f for f in report.findings if f.status == "mismatch"]
    assert wrong.step == "weights" and wrong.diagnosis == "exps-rounded-to-zero"
    assert "their sum is 0 and the weights 0/0" in wrong.message
    assert "[0.71, 0.26, 0.04]" in wrong.message  # the correct weights
    assert [f.status for f in report.findings if f.step != "weights"] == ["ok", "ok"]


def test_right_weights_after_exponentials_printed_as_zero_still_pass() -> None:
    # e.g. computed with the row's largest score subtracted first
    assert check(loads(CARRIED % "0.71, 0.26, 0.04")).ok


def test_the_example_the_property_test_found() -> None:
    text = """format: 2
inputs: {Q: [[-1.0, 2.0, -2.0], [0.0, -2.0, -2.0], [2.0, 2.0, 0.0], [-2.0, -2.0, 0.0]],
  K: [[1.0, -2.0, 1.0], [-1.0, 1.0, -1.0]], V: [[1.0], [-2.0]]}
options: {scale: false, causal: top-left}
claimed:
  scores: {q1: [-7, -inf]}
  scaled: {q1: [-7, -inf]}
  exp: {q1: [0.00, 0]}
  exp_sum: {q1: [0]}
  weights: {q1: [0, 0]}
"""
    report = check(loads(text))
    assert [f.diagnosis for f in report.findings if f.status == "mismatch"] == [
        "exps-rounded-to-zero"
    ]
