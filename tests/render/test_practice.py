"""Practice mode's data (render/_practice.py): the rows each slip gives, as qkv check makes them.

The page compares typed rows with these candidates only, so they must be exactly what
``qkv check`` reproduces and says: the correct row equals the reference core's, each slip's
row equals the check pipeline's row with that slip, each sentence is the one ``qkv check``
writes for that row, and each consequential row assumes the earlier rows its slip gives.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv import examples, render
from qkv.check import check
from qkv.check._pipeline import Setup, Slip, forward
from qkv.cli import main
from qkv.examples import Claimed
from qkv.render._practice import MAX_TOKENS, practice_data
from tests.support.given import QKV_GIVEN

ROOT = Path(__file__).resolve().parents[2]
Data = dict[str, Any]


@pytest.fixture(scope="module")
def love() -> Data:
    return practice_data(examples.builtin("i-love-statistics"))


@pytest.fixture(scope="module")
def heads() -> Data:
    return practice_data(examples.builtin("two-heads"))


def step(data: Data, key: str) -> Data:
    found: list[Data] = [s for s in data["steps"] if s["key"] == key]
    assert len(found) == 1
    return found[0]


def candidates(data: Data, key: str, t: int, kind: str) -> list[Data]:
    return [c for c in step(data, key)["rows"][t]["candidates"] if c["kind"] == kind]


def test_the_steps_of_one_head_and_of_two(love: Data, heads: Data) -> None:
    one, two = love, heads
    assert [s["key"] for s in one["steps"]] == [
        "Q", "K", "V", "scores", "scaled", "weights", "context"
    ]  # fmt: skip
    assert [s["key"] for s in two["steps"]] == [
        "Q", "K", "V", "scores/0", "scaled/0", "weights/0", "scores/1", "scaled/1",
        "weights/1", "context", "output",
    ]  # fmt: skip
    assert step(two, "context")["title"] == "Concatenated context vectors"
    # heads counted from 0 as in qkv explain (issue 25 §2; before: "head 2", "h1.d1")
    assert step(two, "weights/1")["title"] == "Attention weights, head 1"
    assert step(two, "context")["cols"][:3] == ["h0.d1", "h0.d2", "h1.d1"]


@pytest.mark.parametrize(("name", "causal"), [("i-love-statistics", True), ("two-heads", False)])
def test_correct_rows_equal_the_reference(name: str, causal: bool, heads: Data) -> None:
    example = dataclasses.replace(examples.builtin(name), causal=causal)
    data = heads if name == "two-heads" else practice_data(example)
    trace = examples.run(example)
    assert [s["causal"] for s in data["steps"]].count(True) == (1 if causal else 0)
    for s in data["steps"]:
        name_, head = s["step"], s["head"]
        reference = np.asarray(
            trace[name_ if name_ != "context" or example.heads == 1 else "concat"].value
        )
        if head is not None:
            reference = reference[head]
        elif reference.ndim == 3:  # (H, L, n): the heads side by side, (L, H·n)
            reference = reference.transpose(1, 0, 2).reshape(reference.shape[1], -1)
        for row in s["rows"]:
            np.testing.assert_allclose(row["correct"], reference[row["t"]], rtol=0, atol=1e-12)


def test_each_slip_row_is_the_check_pipelines_row(love: Data) -> None:
    setup = Setup.of(examples.builtin("i-love-statistics"))
    expected = {
        ("scaled", "unscaled"): forward(setup, Slip("unscaled"))["scaled"][0, 1],
        ("scaled", "scaled-by-dk"): forward(setup, Slip("scaled-by-dk"))["scaled"][0, 1],
        ("weights", "unscaled"): forward(setup, Slip("unscaled"))["weights"][0, 1],
        ("weights", "softmax-wrong-axis"): forward(setup, Slip("softmax-wrong-axis"))["weights"][
            0, 1
        ],
        ("scores", "query-key-swapped"): forward(setup, Slip("query-key-swapped"))["scores"][0, 1],
    }
    for (key, code), row in expected.items():
        (found,) = [c for c in candidates(love, key, 1, "slip") if c["code"] == code]
        np.testing.assert_allclose(found["values"], row, rtol=0, atol=1e-15)
    by_sum = forward(setup, Slip("sum-normalised"))["weights"][0, 1]
    (found,) = [c for c in candidates(love, "weights", 1, "slip") if c["code"] == "sum-normalised"]
    np.testing.assert_allclose(found["values"], by_sum, rtol=0, atol=1e-15)
    scaled = np.asarray(step(love, "scaled")["rows"][1]["correct"])
    np.testing.assert_allclose(found["values"], scaled / scaled.sum(), rtol=1e-12)
    wrong_axis = next(
        c for c in candidates(love, "weights", 1, "slip") if c["code"] == "softmax-wrong-axis"
    )
    assert not math.isclose(sum(wrong_axis["values"]), 1.0, abs_tol=1e-3)  # not a softmax row


def test_every_slip_row_is_reproduced_by_a_slip_and_named_as_qkv_check_names_it(
    love: Data,
) -> None:
    example = dataclasses.replace(examples.builtin("i-love-statistics"), format=2)
    setup = Setup.of(example)  # format 2: every slip qkv check knows
    from qkv.check._diagnose import slips_for

    count = 0
    for s in love["steps"]:
        for row in s["rows"]:
            t = row["t"]
            for c in (c for c in row["candidates"] if c["kind"] == "slip"):
                made = [
                    (slip, forward(setup, slip)[s["step"]])
                    for slip in slips_for(setup, s["step"], t)
                ]
                codes = {
                    slip.code
                    for slip, r in made
                    if np.allclose(
                        r[t] if r.ndim == 2 else r[0, t], c["values"], rtol=0, atol=1e-12
                    )
                }
                assert codes, (s["key"], t, c["code"])  # some slip gives this row
                if c["code"] not in codes:  # then it is qkv check that names it otherwise
                    texts = tuple(f"{x:.4f}" for x in c["values"])
                    row_claim = Claimed(values=tuple(map(float, texts)), texts=texts)
                    claimed = {s["step"]: {t: row_claim}}
                    (finding,) = check(dataclasses.replace(example, claimed=claimed)).findings
                    assert finding.diagnosis == c["code"]
                count += 1
    assert count > 30


def test_sentences_are_what_qkv_check_says(love: Data) -> None:
    example = examples.builtin("i-love-statistics")
    (unscaled,) = [c for c in candidates(love, "weights", 1, "slip") if c["code"] == "unscaled"]
    texts = tuple(f"{x:.4f}" for x in unscaled["values"])
    claimed = {"weights": {1: Claimed(values=tuple(map(float, texts)), texts=texts)}}
    (finding,) = check(dataclasses.replace(example, claimed=claimed)).findings
    assert finding.diagnosis == "unscaled"
    row = step(love, "weights")["rows"][1]
    assert finding.message == f"{unscaled['says']} {row['says']}"
    assert "√d_k" in unscaled["says"]
    assert row["says"].endswith("[0.3046, 0.3387, 0.3567].")


def test_a_consequential_row_assumes_the_slipped_earlier_row(love: Data) -> None:
    setup = Setup.of(examples.builtin("i-love-statistics"))
    slipped = forward(setup, Slip("unscaled"))
    (after,) = [
        c for c in candidates(love, "weights", 1, "consequential") if c["code"] == "unscaled"
    ]
    np.testing.assert_allclose(after["values"], slipped["weights"][0, 1], atol=1e-15)
    assert [(k, t) for k, t, _ in after["inputs"]] == [("scaled", 1)]
    np.testing.assert_allclose(after["inputs"][0][2], slipped["scaled"][0, 1], atol=1e-15)
    assert after["says"].startswith('Follows from the wrong scaled scores of "love"')


def test_heads_take_the_slips_of_each_head_and_carry_those_of_q_and_k(
    heads: Data,
) -> None:
    example = examples.builtin("two-heads")
    setup = Setup.of(example)
    unscaled = forward(setup, Slip("unscaled"))
    for h in (0, 1):
        (found,) = [
            c for c in candidates(heads, f"weights/{h}", 2, "slip") if c["code"] == "unscaled"
        ]
        np.testing.assert_allclose(found["values"], unscaled["weights"][h, 2], atol=1e-15)
    # a transposed W_q (a slip of Q for all heads) is carried into each head's scores; the
    # learner's Q row is the whole row, all heads side by side
    carried = [
        c for c in candidates(heads, "scores/1", 0, "consequential")
        if c["code"] == "transposed-weights"
    ]  # fmt: skip
    transposed = forward(setup, Slip("transposed-weights", weights=("W_q",)))
    assert carried
    np.testing.assert_allclose(carried[0]["values"], transposed["scores"][1, 0], atol=1e-12)
    key, t, q_row = carried[0]["inputs"][0]
    assert (key, t) == ("Q", 0)
    np.testing.assert_allclose(q_row, transposed["Q"][0], atol=1e-15)
    assert any(c["code"] == "context-not-summed" for c in candidates(heads, "context", 1, "slip"))
    # the heads' context side by side follows from each head's own weights
    (after,) = [
        c for c in candidates(heads, "context", 1, "consequential") if c["code"] == "unscaled"
    ]
    assert {(k, t) for k, t, _ in after["inputs"]} >= {("weights/0", 1), ("weights/1", 1)}
    np.testing.assert_allclose(after["values"], unscaled["context"][1], atol=1e-15)


def test_sensitivities_carry_the_learners_rounding(love: Data) -> None:
    example = examples.builtin("i-love-statistics")
    scaled = step(love, "scaled")["rows"][1]
    np.testing.assert_allclose(scaled["sens"]["scores"], [1 / math.sqrt(2)] * 3, rtol=1e-6)
    scores = step(love, "scores")["rows"][1]
    keys = example.embeddings @ example.W_k  # ∂(q·k_j)/∂q_i = k_j,i, summed over i
    np.testing.assert_allclose(scores["sens"]["Q"], np.abs(keys).sum(axis=1), rtol=1e-6)
    assert set(step(love, "context")["inputs"]) == {"weights", "V"}
    assert step(love, "Q")["rows"][0]["sens"] == {}


def test_the_page_holds_the_practice_data_and_its_id(love: Data) -> None:
    example = examples.builtin("i-love-statistics")
    page = render.html(examples.run(example), practice=love)
    assert '"practice":{' in page and love["id"] in page
    assert practice_data(example)["id"] == love["id"]  # the same page, the same saved progress
    other = dataclasses.replace(example, scale=False)
    assert practice_data(other)["id"] != love["id"]
    json.dumps(love, allow_nan=False)  # plain JSON, no NaN


def test_too_many_tokens_is_one_clear_error() -> None:
    example = examples.builtin("the-cat-sat-on-the-mat")
    tokens = tuple(f"t{i}" for i in range(MAX_TOKENS + 1))
    rng = np.random.default_rng(0)
    big = dataclasses.replace(example, tokens=tokens, embeddings=rng.normal(size=(len(tokens), 3)))
    with pytest.raises(ValueError, match=r"9 tokens, more than 8.*Hint: pick a smaller"):
        practice_data(big)


def test_cli_writes_a_practice_page(tmp_path: Path) -> None:
    path = tmp_path / "practice.html"
    assert main(["explain", "--html", str(path), "--practice", "--no-scale"]) == 0
    page = path.read_text(encoding="utf-8")
    assert '"practice":{' in page and "scaling: leave the scores as they are" in page


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "--practice"], "--practice: it makes a practice page, which needs --html"),
        (
            ["explain", "--trace", "t.json", "--html", "a.html", "--practice"],
            "--trace cannot be used with --practice",
        ),
        (["explain", "--decode", "--practice"], "--practice cannot be used with --decode"),
        (
            ["explain", "--hf", "m", "--text", "hi", "--html", "a.html", "--practice"],
            "--hf cannot be used with --practice",
        ),
    ],
)
def test_cli_refuses_practice_without_an_example_page(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_commands_of_docs_page_md_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "page.md").read_text(encoding="utf-8")
    commands = [
        line.split("#")[0].split()
        for block in page.split("```sh\n")[1:]
        for line in block.split("```")[0].splitlines()
        if line.startswith("qkv explain")
    ]
    assert len(commands) == 5
    monkeypatch.chdir(tmp_path)
    source = ROOT / "src" / "qkv" / "examples" / "data" / "i-love-statistics.yaml"
    (tmp_path / "my-example.yaml").write_text(source.read_text(encoding="utf-8"))
    for argv in commands:
        assert main(argv[1:]) == 0, argv
        html = argv[argv.index("--html") + 1]
        assert '"practice":{' in (tmp_path / html).read_text(encoding="utf-8")
    assert "out/practice.html" in page
    assert "qkv explain --html out/practice.html --practice" in (ROOT / "Makefile").read_text()


def test_an_example_given_by_q_k_and_v_starts_at_the_scores() -> None:
    example = examples.loads(QKV_GIVEN)
    data = practice_data(example)
    assert [s["key"] for s in data["steps"]] == ["scores", "scaled", "weights", "context"]
    assert [m["name"] for m in data["inputs"]] == ["Q", "K", "V"]
    assert data["inputs"][2]["values"] == [[1, 2], [3, 4], [5, 6]]
    scores = step(data, "scores")
    assert scores["inputs"] == [] and scores["rows"][2]["correct"] == [1.0, 1.0, 2.0]
    weights = step(data, "weights")["rows"][2]
    np.testing.assert_allclose(weights["correct"], [0.2483, 0.2483, 0.5035], atol=5e-5)
    assert all(k not in ("Q", "K", "V") for k, _ in weights["feeds"])
    kinds = {(c["kind"], c["code"]) for c in weights["candidates"]}
    assert ("slip", "sum-normalised") in kinds and ("consequential", "unscaled") in kinds


def test_an_example_given_by_its_scores_is_refused() -> None:
    text = QKV_GIVEN.replace(
        QKV_GIVEN[QKV_GIVEN.index("  Q:") :],
        "  scores: [[1, 0, 1], [0, 1, 1], [1, 1, 2]]\noptions: {scale: false}\n",
    )
    with pytest.raises(ValueError, match=r"starts from its scores\. Hint: give Q, K and V"):
        practice_data(examples.loads(text))
