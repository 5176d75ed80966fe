"""Worked examples: the built-ins, the format's conventions, and running an example."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.examples import (
    CLAIMABLE,
    Claimed,
    Example,
    ExampleError,
    builtin,
    builtin_names,
    load,
    loads,
    resolve,
    run,
)
from qkv.examples._model import decimals_of

# -- the built-in examples --------------------------------------------------------------------


def test_builtin_names_in_order() -> None:
    assert builtin_names() == [
        "i-love-statistics",
        "the-cat-sat-on-the-mat",
        "two-heads",
        "flash-by-hand",
        "flash-forgot-rescale",
    ]


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_loads_and_runs(name: str) -> None:
    example = builtin(name)
    assert example.slug == name
    assert example.source == f"<built-in {name}>"
    assert example.name and example.description
    assert not example.embeddings.flags.writeable
    trace = run(example)
    assert trace.tokens == list(example.tokens)
    assert trace.meta["example"] == name
    assert trace.meta["name"] == example.name
    weights = trace["weights"].value
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-12)


def test_builtin_name_forms() -> None:
    assert builtin("I love statistics") == builtin("i-love-statistics")
    assert builtin("Two_Heads").slug == "two-heads"


def test_builtin_unknown() -> None:
    pattern = (
        r"unknown built-in example 'i-love-stats'. Hint: did you mean 'i-love-statistics'\? "
        r"the built-in examples are: i-love-statistics, the-cat-sat-on-the-mat, two-heads, "
        r"flash-by-hand, flash-forgot-rescale"
    )
    with pytest.raises(ExampleError, match=pattern):
        builtin("i-love-stats")


def test_i_love_statistics_numbers() -> None:
    """Seed 000 computed correctly: the query "love", scores divided by √2."""
    example = builtin("i-love-statistics")
    assert example.tokens == ("I", "love", "statistics")
    assert example.queries == (1,)
    trace = run(example)
    assert trace.meta["queries"] == [1]
    love = 1
    np.testing.assert_allclose(trace["Q"].select()[love], [0.50, 0.80], atol=1e-12)
    np.testing.assert_allclose(trace["scores"].select()[love], [1.116, 1.266, 1.339], atol=1e-12)
    np.testing.assert_allclose(trace["weights"].select()[love], [0.3046, 0.3387, 0.3567], atol=5e-5)
    np.testing.assert_allclose(trace["context"].select()[love], [0.5385, 0.8193], atol=5e-5)
    assert trace.meta["scale"] == pytest.approx(1 / np.sqrt(2))


def test_i_love_statistics_claims_are_the_seeds() -> None:
    claimed = builtin("i-love-statistics").claimed
    assert list(claimed) == ["Q", "K", "V", "scores", "weights", "context"]
    assert claimed["Q"][1].values == (0.59, 0.78)
    assert claimed["scores"][1].texts == ("0.5152", "0.7178", "0.8934")
    assert claimed["weights"][1].decimals() == (4, 4, 4)
    assert sorted(claimed["context"]) == [0, 1, 2]


def test_claimed_keeps_printed_digits() -> None:
    row = builtin("i-love-statistics").claimed["V"][1]
    assert row.texts == ("1.02", "1.10")
    assert row.values == (1.02, 1.1)
    assert row.decimals() == (2, 2)
    assert row.line is not None


@pytest.mark.parametrize(
    ("text", "decimals"),
    [("0.5152", 4), ("1.10", 2), ("3", 0), ("-0.5", 1), ("+.25", 2), ("1.5e-3", 4), ("2E2", 0),
     ("1_000.25", 2), ("0x1A", 0)],
)  # fmt: skip
def test_decimals(text: str, decimals: int) -> None:
    assert decimals_of(text) == decimals


def test_cat_weights_reproduce_the_seed() -> None:
    """The chosen W_q, W_k, W_v give exactly seed 002's Q, K, V for "The" and "cat"."""
    example = builtin("the-cat-sat-on-the-mat")
    assert example.tokens == ("The", "cat", "sat", "on", "the", "mat")
    seed = {
        "Q": ([0.2, 0.3, 0.1], [0.3, 0.1, 0.4]),
        "K": ([0.4, 0.2, 0.3], [0.5, 0.1, 0.6]),
        "V": ([0.1, 0.2, 0.3], [0.4, 0.1, 0.2]),
    }
    weights = {"Q": example.W_q, "K": example.W_k, "V": example.W_v}
    for step, rows in seed.items():
        computed = example.embeddings[:2] @ weights[step]
        np.testing.assert_allclose(computed, rows, rtol=0, atol=1e-12)
        assert [example.claimed[step][i].values for i in (0, 1)] == [tuple(r) for r in rows]
    for matrix in weights.values():  # one decimal each
        np.testing.assert_allclose(matrix * 10, np.round(matrix * 10), atol=1e-12)


def test_cat_seed_notes() -> None:
    example = builtin("the-cat-sat-on-the-mat")
    notes = " ".join(example.extras["x-seed-notes"])
    assert "0.19" in notes and "0.95" in notes
    trace = run(example, scale=False)
    np.testing.assert_allclose(trace["scores"].select()[0, 1], 0.19, atol=1e-12)  # Q_The·K_cat
    # The facts the notes state about the seed's softmax row.
    printed = [0.18, 0.21, 0.17, 0.20, 0.19]
    assert sum(printed) == pytest.approx(0.95)
    scores = np.array([0.19, 0.22, 0.18, 0.21, 0.20])
    softmax = np.exp(scores) / np.exp(scores).sum()
    np.testing.assert_allclose(softmax, [0.198, 0.204, 0.196, 0.202, 0.200], atol=5e-4)
    np.testing.assert_allclose(
        trace["scores"].select()[0], [0.17, 0.19, 0.508, 0.182, 0.17, 0.424], atol=1e-12
    )


def test_two_heads() -> None:
    example = builtin("two-heads")
    assert (example.heads, example.queries) == (2, None)
    trace = run(example)
    assert trace.meta["num_heads"] == 2
    assert trace.meta["queries"] is None
    weights = trace["weights"].value.reshape(2, 4, 4)  # (H, Lq, Lk)
    assert not np.allclose(weights[0], weights[1])  # the heads attend differently
    assert weights[0, 0].argmax() == 1 and weights[1, 2].argmax() == 0  # time→flies, like→time
    assert trace["output"].value.shape[-2:] == (4, 4)


# -- run's options ----------------------------------------------------------------------------


def test_run_query_by_name_index_and_digits() -> None:
    example = builtin("i-love-statistics")
    assert run(example, query="statistics").meta["queries"] == [2]
    assert run(example, query=0).meta["queries"] == [0]
    assert run(example, query="2").meta["queries"] == [2]


def test_run_overrides_scale_causal_heads() -> None:
    example = builtin("two-heads")
    unscaled = run(example, scale=False)
    assert unscaled.meta["scale"] == 1.0
    half = run(example, scale=0.5)
    assert half.meta["scale"] == 0.5
    causal = run(example, causal=True)
    weights = causal["weights"].value.reshape(2, 4, 4)
    assert np.all(np.triu(weights, k=1) == 0)
    one = run(example, heads=1)
    assert one.meta["num_heads"] == 1


def test_run_records_into_the_given_trace() -> None:
    trace = qkv.Trace()
    assert run(builtin("i-love-statistics"), trace=trace) is trace
    assert "weights" in trace


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"query": "hate"}, r"query: unknown token 'hate'. Hint: "
                            r"the tokens are: 0 I, 1 love, 2 statistics"),
        ({"query": "Love"}, r"did you mean 'love'"),
        ({"query": 3}, r"query: token position 3 is out of range.*numbered from 0 to 2"),
        ({"query": -1}, r"query: token position -1 is out of range"),
        ({"heads": 3}, r"heads must divide d_k = 2 \(the columns of W_q and W_k\) and d_v = 2.*"
                       r"got 3. Hint: this example can run with heads = 1, 2"),
        ({"heads": 0}, r"heads must divide .* got 0"),
        ({"scale": -2.0}, r"scale must be True \(divide by √d_k\), False \(no scaling\) or a "
                          r"positive number .*got -2.0"),
    ],
)  # fmt: skip
def test_run_bad_arguments(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        run(builtin("i-love-statistics"), **kwargs)  # type: ignore[arg-type]


def test_run_ambiguous_query() -> None:
    example = builtin("the-cat-sat-on-the-mat")
    assert run(example, query="the").meta["queries"] == [4]  # names are case-sensitive
    twice = loads("tokens: [a, b, a]\nembeddings: [[1], [2], [3]]\n"
                  "weights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"query: token 'a' appears 2 times \(positions 0, 2\)"):
        run(twice, query="a")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"query": 1.5}, r"query must be a token \(its text or 0-based position\), got float"),
        ({"causal": "yes"}, r"causal must be True or False, got 'yes'"),
    ],
)
def test_run_bad_types(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        run(builtin("i-love-statistics"), **kwargs)  # type: ignore[arg-type]


# -- the format -------------------------------------------------------------------------------

YAML_TEXT = """\
format: 1
name: Tiny
description: Two tokens.
tokens: [a, "on"]
embeddings: [[1.0, 0.5], [0.25, 2]]
weights:
  W_q: [[1, 0], [0, 1]]
  W_k: [[0.5, 0], [0, 0.5]]
  W_v: [[1, 2], [3, 4]]
  W_o: [[1], [1]]
heads: 2
options: {scale: 0.5, causal: true, queries: [1]}
claimed:
  V: {0: [1.10, 2.00]}
  output: {on: [1e-3]}
x-notes: {by: me, list: [1, 2.5, true, null]}
"""

JSON_TEXT = """\
{
\t"format": 1,
\t"name": "Tiny",
\t"description": "Two tokens.",
\t"tokens": ["a", "on"],
\t"embeddings": [[1.0, 0.5], [0.25, 2]],
\t"weights": {
\t\t"W_q": [[1, 0], [0, 1]], "W_k": [[0.5, 0], [0, 0.5]],
\t\t"W_v": [[1, 2], [3, 4]], "W_o": [[1], [1]]
\t},
\t"heads": 2,
\t"options": {"scale": 0.5, "causal": true, "queries": ["1"]},
\t"claimed": {"V": {"0": [1.10, 2.00]}, "output": {"on": [1e-3]}},
\t"x-notes": {"by": "me", "list": [1, 2.5, true, null]}
}
"""


def test_yaml_and_json_give_the_same_example(tmp_path) -> None:
    (tmp_path / "ex.yaml").write_text(YAML_TEXT)
    (tmp_path / "ex.json").write_text(JSON_TEXT)
    (tmp_path / "ex.txt").write_text(JSON_TEXT)
    from_yaml = load(tmp_path / "ex.yaml")
    from_json = load(tmp_path / "ex.json")
    assert from_yaml == from_json == load(tmp_path / "ex.txt") == loads(JSON_TEXT)
    assert json.loads(JSON_TEXT)["tokens"] == list(from_json.tokens)
    assert from_yaml.source == str(tmp_path / "ex.yaml")
    assert from_yaml.scale == 0.5 and from_yaml.causal and from_yaml.queries == (1,)
    assert from_json.claimed["V"][0].texts == ("1.10", "2.00")
    assert from_json.claimed["output"][1] == Claimed(values=(0.001,), texts=("1e-3",))
    assert from_json.claimed["output"][1].decimals() == (3,)


def test_x_keys_are_kept() -> None:
    example = loads(YAML_TEXT)
    assert example.extras == {"x-notes": {"by": "me", "list": [1, 2.5, True, None]}}


def test_defaults() -> None:
    example = loads("tokens: [a]\nembeddings: [[1]]\nweights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}")
    assert (example.name, example.description, example.heads) == ("worked example", "", 1)
    assert (example.scale, example.causal, example.queries) == (True, False, None)
    assert (example.W_o, example.slug, example.source) == (None, None, "<string>")
    assert example.claimed == {} and example.extras == {}
    assert example.d_model == 1


def test_name_defaults_to_the_file_name(tmp_path) -> None:
    path = tmp_path / "my-example.yaml"
    path.write_text("tokens: [a]\nembeddings: [[1]]\nweights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}")
    assert load(path).name == "my-example"


def test_tokens_are_taken_as_written() -> None:
    """YAML 1.1 reads a bare on/yes/null/3 as true/None/3; a token is the text as written."""
    example = loads(
        "tokens: [on, yes, null, 3]\nembeddings: [[1], [2], [3], [4]]\n"
        "weights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}\noptions: {queries: [on, 3]}\n"
        "claimed: {Q: {yes: [2], '3': [4], 2: [3]}}"
    )
    assert example.tokens == ("on", "yes", "null", "3")
    assert example.queries == (0, 3)  # a bare 3 is a position
    assert sorted(example.claimed["Q"]) == [1, 2, 3]  # a quoted '3' is the token "3"


def test_example_equality() -> None:
    a, b = loads(YAML_TEXT), loads(YAML_TEXT, source="other")
    assert a == b
    assert a != loads(YAML_TEXT.replace("[1.0, 0.5]", "[1.0, 0.6]"))
    assert a != loads(YAML_TEXT.replace("scale: 0.5", "scale: 1"))
    assert loads(YAML_TEXT.replace("scale: 0.5", "scale: true")) != loads(
        YAML_TEXT.replace("scale: 0.5", "scale: 1")
    )
    assert a != "not an example"
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


def test_claimable_steps() -> None:
    assert CLAIMABLE == ("Q", "K", "V", "scores", "scaled", "weights", "context", "output")


def test_example_is_frozen() -> None:
    example = builtin("two-heads")
    with pytest.raises(AttributeError):
        example.heads = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        example.W_q[0, 0] = 1.0
    assert isinstance(example, Example)


# -- resolve ----------------------------------------------------------------------------------


def test_resolve_builtin_and_path(tmp_path) -> None:
    assert resolve("two-heads").slug == "two-heads"
    path = tmp_path / "ex.yaml"
    path.write_text(YAML_TEXT)
    assert resolve(str(path)).name == "Tiny"
    assert resolve(path).name == "Tiny"


def test_resolve_prefers_builtin_names(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "two-heads").write_text(YAML_TEXT)
    assert resolve("two-heads").slug == "two-heads"
    assert resolve("./two-heads").name == "Tiny"


def test_resolve_neither() -> None:
    pattern = (
        r"'two-head' is neither a built-in example nor an existing file. Hint: did you mean "
        r"'two-heads'\? the built-in examples are: .*; or give the path of a YAML or JSON"
    )
    with pytest.raises(ExampleError, match=pattern):
        resolve("two-head")


# -- the error type ---------------------------------------------------------------------------


def test_example_error_parts_and_pickle() -> None:
    error = ExampleError("bad", source="f.yaml", line=3, field="heads", hint="fix it")
    assert str(error) == "f.yaml, line 3: heads: bad. Hint: fix it"
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.line, copy.field) == (str(error), 3, "heads")
    assert str(ExampleError("bad", line=2)) == "line 2: bad"
    assert str(ExampleError("bad")) == "bad"


# -- the user documentation -------------------------------------------------------------------


def _doc_blocks(language: str) -> list[str]:
    doc = Path(__file__).resolve().parents[2] / "docs" / "example-format.md"
    return re.findall(rf"```{language}\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)


def test_documented_examples_load() -> None:
    """The YAML and JSON examples of docs/example-format.md are valid, and match the built-in."""
    yaml_text = _doc_blocks("yaml")[0]  # the format-1 example; format 2's are tested apart
    (json_text,) = _doc_blocks("json")
    documented, seed = loads(yaml_text), builtin("i-love-statistics")
    assert documented.extras == {"x-source": "seed 000"}
    for field in ("tokens", "queries", "heads", "scale", "causal", "claimed"):
        assert getattr(documented, field) == getattr(seed, field)
    for field in ("embeddings", "W_q", "W_k", "W_v"):
        np.testing.assert_array_equal(getattr(documented, field), getattr(seed, field))
    from_json = loads(json_text)
    assert from_json.queries == (1,) and from_json.claimed["V"][1].texts == ("1.02", "1.10")
