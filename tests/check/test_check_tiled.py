"""Hand-worked tiled (FlashAttention) examples in ``qkv check`` (issue 37, item 3).

The numbers of ``flash-by-hand`` are pinned by hand: W_q = W_k = I, so Q = K = X, d_k = 4
and the scores are divided by 2. The query "sat" = [2, 0, 0, 2] scores [2, 0, 8, 2] / 2 =
[1, 0, 4, 1] against the, cat, sat, down: key block 0 = {the, cat}, key block 1 = {sat, down}.
Every slip of the hand-worker is made on purpose on that example and must be named.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from qkv.check import DIAGNOSES, Finding, check
from qkv.cli import main
from qkv.examples import ExampleError, builtin, loads

E = math.e

# "sat": after key block 0 (scores 1, 0) and after key block 1 (scores 4, 1).
SAT_M = [1.0, 4.0]
SAT_ALPHA = [0.0, E**-3]
SAT_L0 = 1 + E**-1
SAT_L1 = E**-3 * SAT_L0 + 1 + E**-3
SAT_O0 = np.array([2.0, 0.0]) + E**-1 * np.array([0.0, 2.0])  # v_the = [2, 0], v_cat = [0, 2]
SAT_O1 = E**-3 * SAT_O0 + np.array([2.0, 2.0]) + E**-3 * np.array([1.0, 1.0])


# O_old + e^0·v_sat + e^-3·v_down: the old accumulator added without α = e^-3.
_NO_RESCALE = SAT_O0 + np.array([2.0, 2.0]) + E**-3 * np.array([1.0, 1.0])


def _with(claims: str, *, extra: str = "") -> str:
    """The flash-by-hand inputs with these tiled claims (YAML lines under ``claimed:``)."""
    body = "\n".join("    " + line for line in claims.strip().splitlines())
    return f"""format: 2
tokens: [the, cat, sat, down]
embeddings: [[1, 0, 1, 0], [0, 2, 0, 0], [2, 0, 0, 2], [0, 0, 1, 1]]
weights:
  W_q: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
  W_k: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
  W_v: [[1, 0], [0, 1], [1, 0], [0, 1]]
{extra}tiled:
  block_size: 2
  claimed:
{body}
"""


def _findings(claims: str, **kw: str) -> dict[tuple[str, int | None], Finding]:
    report = check(loads(_with(claims, **kw)))
    return {(f.step, f.key_block): f for f in report.findings if f.token == "sat"}


def test_builtin_numbers_are_the_hand_computed_ones() -> None:
    report = check("flash-by-hand")
    assert report.ok and len(report.findings) == 28
    assert all(f.status == "ok" and f.tiled for f in report.findings)
    sat = {(f.step, f.key_block): f.expected for f in report.findings if f.token == "sat"}
    assert [sat["running_max", j][0] for j in (0, 1)] == SAT_M
    assert [sat["rescale", j][0] for j in (0, 1)] == pytest.approx(SAT_ALPHA, abs=1e-15)
    assert sat["running_sum", 0][0] == pytest.approx(SAT_L0, abs=1e-14)
    assert sat["running_sum", 1][0] == pytest.approx(SAT_L1, abs=1e-14)
    np.testing.assert_allclose(sat["accumulator", 1], SAT_O1, atol=1e-14)
    np.testing.assert_allclose(sat["output", None], SAT_O1 / SAT_L1, atol=1e-14)
    assert sat["lse", None][0] == pytest.approx(4 + math.log(SAT_L1), abs=1e-14)
    # The tiled output is the plain softmax's: weights exp(s)/Σ exp(s) times V.
    scores = np.array([1.0, 0.0, 4.0, 1.0])
    weights = np.exp(scores) / np.exp(scores).sum()
    v = np.array([[2.0, 0.0], [0.0, 2.0], [2.0, 2.0], [1.0, 1.0]])
    np.testing.assert_allclose(sat["output", None], weights @ v, atol=1e-14)


def test_seeded_example_names_both_slips_and_follows_through() -> None:
    report = check("flash-forgot-rescale")
    assert not report.ok
    wrong = [
        (f.step, f.token, f.key_block, f.status, f.diagnosis, f.cause)
        for f in report.findings
        if f.wrong
    ]
    assert wrong == [
        ("running_sum", "sat", 1, "mismatch", "flash-sum-not-rescaled", None),
        ("accumulator", "down", 1, "mismatch", "flash-no-rescale", None),
        ("output", "sat", None, "consequential", None, ("running_sum", 2)),
        ("output", "down", None, "consequential", None, ("accumulator", 3)),
        ("lse", "sat", None, "consequential", None, ("running_sum", 2)),
    ]
    first = report.first_wrong
    assert first is not None and "not rescaled" in first.message and "1.1179" in first.message


@pytest.mark.parametrize(
    ("claims", "step", "key_block", "code"),
    [
        ("tile_max: {sat: [2, 8]}", "tile_max", 1, "unscaled"),
        ("running_max: {sat: [1, 1]}", "running_max", 1, "flash-max-not-updated"),
        (
            f"running_sum: {{sat: [1.3679, {SAT_L0 + 1 + E**-3:.4f}]}}",
            "running_sum",
            1,
            "flash-sum-not-rescaled",
        ),
        (
            f"accumulator: {{sat: [[2, 0.7358], [{_NO_RESCALE[0]:.4f}, {_NO_RESCALE[1]:.4f}]]}}",
            "accumulator",
            1,
            "flash-no-rescale",
        ),
        (
            f"output: {{sat: [{SAT_O1[0]:.4f}, {SAT_O1[1]:.4f}]}}",
            "output",
            None,
            "flash-final-divide-missing",
        ),
        (f"lse: {{sat: {4 + math.log2(SAT_L1):.4f}}}", "lse", None, "flash-lse-wrong-base"),
        (
            f"lse: {{sat: {(4 + math.log(SAT_L1)) / math.log(2):.4f}}}",
            "lse",
            None,
            "flash-lse-wrong-base",
        ),
        (f"lse: {{sat: {math.log(SAT_L1):.4f}}}", "lse", None, "flash-lse-without-max"),
        ("running_sum: {sat: [1.3679, 1.5]}", "running_sum", 1, "arithmetic"),
    ],
)
def test_each_slip_made_on_purpose_is_named(
    claims: str, step: str, key_block: int | None, code: str
) -> None:
    found = _findings(claims)
    finding = found[step, key_block]
    assert finding.status == "mismatch"
    assert finding.diagnosis == code
    assert code in DIAGNOSES
    # The message gives the correct value.
    correct = finding.expected
    assert f"{correct[0]:.{finding.decimals}f}" in finding.message


def test_a_max_not_updated_carries_through_and_cancels_in_o_over_l() -> None:
    # m stays 1 after key block 1: α = e^0 = 1, the tile's terms e^(4-1), e^(1-1) are not
    # shrunk: l = 1.3679 + e^3 + 1, O = O_0 + e^3·[2, 2] + [1, 1]. Those follow from the
    # wrong m. O / l and L = m + ln l are right again: the shift cancels (softmax does not
    # depend on it; only overflow would show it).
    l1 = SAT_L0 + E**3 + 1
    o1 = SAT_O0 + E**3 * np.array([2.0, 2.0]) + np.array([1.0, 1.0])
    claims = f"""
running_max: {{sat: [1, 1]}}
rescale: {{sat: [0, 1]}}
running_sum: {{sat: [1.3679, {l1:.4f}]}}
accumulator: {{sat: [[2, 0.7358], [{o1[0]:.4f}, {o1[1]:.4f}]]}}
output: {{sat: [{o1[0] / l1:.4f}, {o1[1] / l1:.4f}]}}
lse: {{sat: {1 + math.log(l1):.4f}}}
"""
    found = _findings(claims)
    assert found["running_max", 1].diagnosis == "flash-max-not-updated"
    for key in [("rescale", 1), ("running_sum", 1), ("accumulator", 1)]:
        f = found[key]
        assert (f.status, f.cause) == ("consequential", ("running_max", 2)), key
    assert found["output", None].status == found["lse", None].status == "ok"
    # The rows before the mistake are right.
    assert found["running_sum", 0].status == "ok"


def test_rounding_in_the_last_digit_is_a_note_not_an_error() -> None:
    found = _findings(f"running_sum: {{sat: [1.3679, {SAT_L1 - 0.00006:.4f}]}}")
    assert (found["running_sum", 1].status, found["running_sum", 1].diagnosis) == (
        "note",
        "rounding",
    )


def test_a_whole_number_is_exact_not_a_half_unit_of_slack() -> None:
    # "2" for the accumulator's 2.1494 is wrong, not a rounding of 2.
    found = _findings("accumulator: {sat: [[2, 0.7358], [2, 2.0864]]}")
    assert found["accumulator", 1].status == "mismatch"


def test_causal_skipped_tiles_are_not_claimed() -> None:
    # Causal: "the" (query block 0) visits key block 0 only; a second number is refused.
    extra = "options: {causal: true}\n"
    with pytest.raises(ExampleError) as caught:
        loads(_with("running_max: {the: [1, 1]}", extra=extra))
    message = str(caught.value)
    assert "tiled.claimed.running_max.the" in message and "expected 1 to 1 numbers" in message
    assert "\n" not in message
    report = check(loads(_with("running_max: {the: [1], sat: [1, 4]}", extra=extra)))
    assert report.ok and len(report.findings) == 3


@pytest.mark.parametrize(
    ("tiled", "fragment"),
    [
        ("tiled: {claimed: {}}", "tiled.block_size: missing"),
        ("tiled: {block_size: 0}", "expected a whole number ≥ 1"),
        ("tiled: {block_size: 2, claimed: {runing_max: {sat: [1]}}}", "running_max"),
        ("tiled: {block_size: 2, claimed: {output: {sat: [1]}}}", "expected 2 numbers"),
        ("tiled: {block_size: 2, claimed: {lse: {sat: [1, 2]}}}", "expected 1 number"),
    ],
)
def test_format_errors_are_one_line(tiled: str, fragment: str) -> None:
    text = _with("tile_max: {sat: [1]}").split("tiled:")[0] + tiled + "\n"
    with pytest.raises(ExampleError) as caught:
        loads(text)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_format_1_refuses_tiled() -> None:
    text = _with("tile_max: {sat: [1]}").replace("format: 2", "format: 1")
    with pytest.raises(ExampleError, match="format 2"):
        loads(text)


def test_cli_names_the_slip_and_json_carries_the_tile(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["check", "--example", "flash-forgot-rescale"])
    out = capsys.readouterr().out
    assert status == 1
    assert "flash-sum-not-rescaled" in out and "sat, key block 1" in out
    assert re.search(r"consequential, follows from running_sum of sat", out)
    main(["check", "--example", "flash-forgot-rescale", "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    first = next(f for f in data["findings"] if f["status"] == "mismatch")
    assert (first["step"], first["token"], first["key_block"], first["tiled"]) == (
        "running_sum",
        "sat",
        1,
        True,
    )


def test_builtin_tiled_examples_also_explain_plainly() -> None:
    # The tiled claims live beside the plain steps: the example still runs as attention.
    from qkv import examples

    trace = examples.run(builtin("flash-by-hand"))
    np.testing.assert_allclose(trace["weights"].value.sum(axis=-1), 1.0, atol=1e-12)


def test_docs_show_the_tiled_report_as_qkv_prints_it() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "check.md").read_text("utf-8")
    section = doc[doc.index("## Tiled (FlashAttention) examples") :]
    block = re.findall(r"```text\n(.*?)```", section, flags=re.DOTALL)[0]
    assert block in check("flash-forgot-rescale").text(width=80)


_MASKED = """format: 2
inputs:
  Q: [[1, 0], [0, 1], [1, 1]]
  K: [[1, 0], [0, 1], [1, 1]]
  V: [[1, 0], [0, 1], [1, 1]]
options: {scale: false, mask: [[0, 0, 1], [0, 1, 1], [1, 1, 1]]}
tiled:
  block_size: 2
  claimed:
    running_max: {t1: [-inf, 1]}
    running_sum: {t1: [0, 1]}
    output: {t1: [1, 1]}
"""


def test_a_row_with_no_allowed_key_in_a_tile_keeps_m_minus_infinity() -> None:
    # t1 sees no key of block 0: m = −∞ and l = 0 there, no NaN; then key t3 alone: m = 1.
    report = check(loads(_MASKED))
    assert report.ok, report.text()
    from qkv.render._practice_tiled import tiled_practice_data

    with pytest.raises(ValueError, match="no allowed key in a tile"):
        tiled_practice_data(loads(_MASKED))
