"""Every way a worked-example file can be wrong gives an ExampleError with its field and line."""

from __future__ import annotations

import re

import pytest

from qkv.examples import ExampleError, _nodes, load, loads

# A valid example; each case below breaks one line of it. Line numbers are 1-based.
BASE = """\
name: tiny
tokens: [a, b, c]
embeddings:
  - [1.0, 0.0]
  - [0.0, 1.0]
  - [1.0, 1.0]
weights:
  W_q: [[1.0, 0.0], [0.0, 1.0]]
  W_k: [[0.5, 0.0], [0.0, 0.5]]
  W_v: [[1.0, 2.0], [3.0, 4.0]]
options:
  queries: [b]
claimed:
  Q: {b: [0.0, 1.0]}
"""

# (id, old text, new text, field, line, message pattern)
CASES = [
    # top level
    ("unknown-key", "name: tiny", "nmae: tiny", "nmae", 1,
     r"unknown key 'nmae'.*did you mean 'name'"),
    ("misplaced", "name: tiny", "name: tiny\nscale: false", "scale", 2,
     r"unknown key 'scale'.*did you mean 'options'.*must start with 'x-'"),
    ("duplicate-key", "name: tiny", "name: tiny\nname: again", "name", 2,
     r"duplicate key 'name' \(it is already given on line 1\).*keep one"),
    ("duplicate-in-x", "name: tiny", "name: tiny\nx-notes: {a: 1, a: 2}", "x-notes.a", 2,
     r"duplicate key 'a'"),
    ("missing-tokens", "tokens: [a, b, c]\n", "", "tokens", 1,
     r"missing.*every example needs tokens, embeddings and weights"),
    ("format", "name: tiny", "format: 3\nname: tiny", "format", 1,
     r"unsupported format '3'.*reads formats 1 and 2"),
    ("name-empty", "name: tiny", "name:", "name", 1, r"expected a title, got nothing"),
    ("name-list", "name: tiny", "name: [a]", "name", 1, r"expected a title, got a list"),
    ("description-list", "name: tiny", "name: tiny\ndescription: [x]", "description", 2,
     r"expected a text, got a list"),
    ("list-key", "name: tiny", "name: tiny\n? [a, b]\n: 1", None, 2, r"a key must be a name"),
    # tokens
    ("tokens-text", "tokens: [a, b, c]", "tokens: a b c", "tokens", 2,
     r"expected a list of tokens like \[I, love, statistics\], got the text 'a b c'"),
    ("tokens-empty-list", "tokens: [a, b, c]", "tokens: []", "tokens", 2, r"got an empty list"),
    ("token-empty", "tokens: [a, b, c]", 'tokens: [a, "", c]', "tokens[1]", 2,
     r"expected a token, got an empty text"),
    ("token-mapping", "tokens: [a, b, c]", "tokens: [a, {x: 1}, c]", "tokens[1]", 2,
     r"expected a token \(a word\), got a mapping"),
    # embeddings
    ("rows-vs-tokens", "  - [1.0, 1.0]\n", "", "embeddings", 3,
     r"expected 3 rows \(one per token\), got 2.*tokens has 3 entries: a, b, c"),
    ("ragged", "  - [0.0, 1.0]", "  - [0.0]", "embeddings[1]", 5,
     r"expected 2 numbers, like the rows before it, got 1"),
    ("text-number", "  - [1.0, 1.0]", "  - [1.0, abc]", "embeddings[2][1]", 6,
     r"expected a number, got the text 'abc'"),
    ("quoted-number", "  - [1.0, 1.0]", "  - [1.0, '1.0']", "embeddings[2][1]", 6,
     r"got the text '1.0' \(in quotes\).*remove the quotes"),
    ("bool-number", "  - [1.0, 1.0]", "  - [1.0, true]", "embeddings[2][1]", 6,
     r"got the truth value true.*true and false are not numbers"),
    ("inf", "  - [1.0, 1.0]", "  - [1.0, .inf]", "embeddings[2][1]", 6,
     r"expected a finite number, got \.inf"),
    ("nan", "  - [1.0, 1.0]", "  - [1.0, .nan]", "embeddings[2][1]", 6, r"finite"),
    ("null-number", "  - [1.0, 1.0]", "  - [1.0, ~]", "embeddings[2][1]", 6,
     r"expected a number, got nothing"),
    ("row-number", "  - [0.0, 1.0]", "  - 0.5", "embeddings[1]", 5,
     r"expected a row \(a list of numbers\), got the number 0\.5.*list of rows"),
    ("row-empty", "  - [0.0, 1.0]", "  - []", "embeddings[1]", 5, r"got an empty list"),
    ("embeddings-mapping", "embeddings:", "embeddings: {a: 1}\nx-old:", "embeddings", 3,
     r"expected one row per token, a list of rows.*got a mapping"),
    # weights
    ("weights-list", "weights:", "weights: [1, 2]\nx-old:", "weights", 7,
     r"expected a mapping with W_q, W_k, W_v \(and W_o\), got a list"),
    ("weights-unknown", "  W_q:", "  Wq:", "weights.Wq", 8,
     r"unknown key 'Wq'.*did you mean 'W_q'"),
    ("weights-upper", "  W_q:", "  W_Q:", "weights.W_Q", 8, r"did you mean 'W_q'"),
    ("weights-zero", "  W_v: [[1.0, 2.0], [3.0, 4.0]]", "  W_v: [[1.0, 2.0], [3.0, 4.0]]\n  W_0: 1",
     "weights.W_0", 11, r"did you mean 'W_o'"),
    ("weights-missing", "  W_v: [[1.0, 2.0], [3.0, 4.0]]\n", "", "weights.W_v", 7,
     r"missing.*W_q, W_k and W_v"),
    ("matrix-number", "  W_q: [[1.0, 0.0], [0.0, 1.0]]", "  W_q: 1.0", "weights.W_q", 8,
     r"expected the W_q matrix, a list of rows like \[\[0\.1, 0\.2\], \.\.\.\], got the number"),
    ("W_q-rows", "  W_q: [[1.0, 0.0], [0.0, 1.0]]", "  W_q: [[1.0]]", "weights.W_q", 8,
     r"expected 2 rows \(d_model = 2, one per embedding column\), got 1. Hint: Q = X·W_q "
     r"multiplies each embedding row by W_q, so it has one row per embedding column$"),
    ("W_q-transposed", "  W_q: [[1.0, 0.0], [0.0, 1.0]]", "  W_q: [[1.0, 0.0], [0.0, 1.0], [1, 1]]",
     "weights.W_q", 8,
     r"expected 2 rows.*got 3.*if this is the column-vector form \(W_q·x, 3 × 2\), write its"),
    ("W_k-columns", "  W_k: [[0.5, 0.0], [0.0, 0.5]]", "  W_k: [[0.5], [0.0]]", "weights.W_k", 9,
     r"expected 2 columns, like W_q \(d_k = 2\), got 1.*both have d_k numbers"),
    ("W_o-rows", "  W_v: [[1.0, 2.0], [3.0, 4.0]]",
     "  W_v: [[1.0, 2.0], [3.0, 4.0]]\n  W_o: [[1.0]]",
     "weights.W_o", 11, r"expected 2 rows \(d_v = 2, the columns of W_v\), got 1.*side by side"),
    # heads
    ("heads-divide", "name: tiny", "name: tiny\nheads: 3", "heads", 2,
     r"3 heads do not divide d_k = 2 \(the columns of W_q and W_k\).*heads can be 1, 2"),
    ("heads-divide-v", "  W_v: [[1.0, 2.0], [3.0, 4.0]]", "  W_v: [[1.0], [3.0]]\nheads: 2",
     "heads", 11, r"2 heads do not divide d_v = 1.*heads can be 1$"),
    ("heads-zero", "name: tiny", "name: tiny\nheads: 0", "heads", 2,
     r"expected a whole number ≥ 1, got 0"),
    ("heads-bool", "name: tiny", "name: tiny\nheads: true", "heads", 2,
     r"expected a whole number, got the truth value true"),
    ("heads-text", "name: tiny", "name: tiny\nheads: two", "heads", 2,
     r"expected a whole number, got the text 'two'"),
    # options
    ("options-list", "options:\n  queries: [b]", "options: [b]", "options", 11,
     r"expected a mapping of options, got a list"),
    ("options-unknown", "  queries: [b]", "  querys: [b]", "options.querys", 12,
     r"unknown key 'querys'.*did you mean 'queries'"),
    ("options-heads", "  queries: [b]", "  heads: 2", "options.heads", 12,
     r"did you mean 'heads \(a top-level key\)'"),
    ("scale-text", "  queries: [b]", "  scale: maybe", "options.scale", 12,
     r"expected true, false or a positive number, got the text 'maybe'.*√d_k"),
    ("scale-negative", "  queries: [b]", "  scale: -1", "options.scale", 12,
     r"expected true, false or a positive number, got the number -1"),
    ("causal-text", "  queries: [b]", "  causal: maybe", "options.causal", 12,
     r"expected true or false, got the text 'maybe'"),
    ("query-unknown", "  queries: [b]", "  queries: [z]", "options.queries[0]", 12,
     r"unknown token 'z'.*the tokens are: 0 a, 1 b, 2 c"),
    ("query-close", "  queries: [b]", "  queries: [B]", "options.queries[0]", 12,
     r"unknown token 'B'.*did you mean 'b'"),
    ("query-range", "  queries: [b]", "  queries: [7]", "options.queries[0]", 12,
     r"token position 7 is out of range.*numbered from 0 to 2"),
    ("query-ambiguous", "tokens: [a, b, c]", "tokens: [b, b, c]", "options.queries[0]", 12,
     r"token 'b' appears 2 times \(positions 0, 1\).*name it by its 0-based position"),
    ("query-twice", "  queries: [b]", "  queries: [b, 1]", "options.queries[1]", 12,
     r"token 1 \(b\) is listed twice.*line 12"),
    ("query-none", "  queries: [b]", "  queries: []", "options.queries", 12,
     r"expected at least one token.*leave 'queries' out"),
    ("query-list", "  queries: [b]", "  queries: [[b]]", "options.queries[0]", 12,
     r"expected a token, got a list"),
    # claimed
    ("claimed-list", "  Q: {b: [0.0, 1.0]}", "  - 1", "claimed", 14,
     r"expected a mapping of steps \(Q:, K:, V:, scores:, \.\.\.\), got a list"),
    ("claimed-step", "  Q:", "  softmax:", "claimed.softmax", 14,
     r"unknown key 'softmax'.*did you mean 'weights'.*Q, K, V, scores, scaled, weights"),
    ("claimed-lower", "  Q:", "  q:", "claimed.q", 14, r"did you mean 'Q'"),
    ("claimed-masked", "  Q:", "  masked:", "claimed.masked", 14, r"unknown key 'masked'"),
    ("claimed-rows-list", "  Q: {b: [0.0, 1.0]}", "  Q: [0.0, 1.0]", "claimed.Q", 14,
     r"expected a mapping of token: \[numbers\], got a list"),
    ("claimed-row-number", "  Q: {b: [0.0, 1.0]}", "  Q: {b: 0.5}", "claimed.Q.b", 14,
     r"expected a row of numbers like \[0\.1, 0\.2\], got the number 0\.5"),
    ("claimed-row-empty", "  Q: {b: [0.0, 1.0]}", "  Q: {b: []}", "claimed.Q.b", 14,
     r"expected a row of numbers, got an empty list"),
    ("claimed-Q-length", "  Q: {b: [0.0, 1.0]}", "  Q: {b: [0.0]}", "claimed.Q.b", 14,
     r"expected 2 numbers \(d_k, the columns of W_q\), got 1"),
    ("claimed-scores-length", "  Q: {b: [0.0, 1.0]}", "  scores: {b: [1, 2]}", "claimed.scores.b",
     14, r"expected 3 numbers \(one per token: this query's row over every key\), got 2"),
    ("claimed-output-length", "  Q: {b: [0.0, 1.0]}", "  output: {b: [1]}", "claimed.output.b", 14,
     r"expected 2 numbers \(d_v: no W_o\), got 1"),
    ("claimed-token", "  Q: {b: [0.0, 1.0]}", "  Q: {z: [0.0, 1.0]}", "claimed.Q.z", 14,
     r"unknown token 'z'"),
    ("claimed-same-token", "  Q: {b: [0.0, 1.0]}", "  Q: {b: [0.0, 1.0], 1: [0.0, 1.0]}",
     "claimed.Q.1", 14, r"names token 1 \(b\), already claimed on line 14"),
    ("claimed-duplicate", "  Q: {b: [0.0, 1.0]}", "  Q: {b: [0.0, 1.0], b: [0.0, 1.0]}",
     "claimed.Q.b", 14, r"duplicate key 'b'"),
    ("claimed-number", "  Q: {b: [0.0, 1.0]}", "  Q: {b: [0.0, x]}", "claimed.Q.b[1]", 14,
     r"expected a number, got the text 'x'"),
    ("claimed-multi-head", "  Q: {b: [0.0, 1.0]}", "  weights: {b: [0.2, 0.3, 0.5]}\nheads: 2",
     "claimed.weights", 14, r"claimed weights rows are defined for a single head; this example "
     r"has 2.*claim Q, K, V, context or output"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "field", "line", "pattern"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_bad_field_names_field_and_line(
    old: str, new: str, field: str | None, line: int, pattern: str
) -> None:
    assert old in BASE
    text = BASE.replace(old, new, 1)
    with pytest.raises(ExampleError, match=pattern) as info:
        loads(text, source="ex.yaml")
    error = info.value
    assert (error.source, error.line, error.field) == ("ex.yaml", line, field)
    prefix = f"ex.yaml, line {line}: " + (f"{field}: " if field else "")
    assert str(error).startswith(prefix)


def test_base_is_valid() -> None:
    example = loads(BASE)
    assert example.tokens == ("a", "b", "c")
    assert example.queries == (1,)


def test_error_names_file_line_field_and_hint(tmp_path) -> None:
    path = tmp_path / "ex.yaml"
    path.write_text(BASE.replace("  W_q: [[1.0, 0.0], [0.0, 1.0]]", "  W_q: [[1.0, 0.0]]"))
    with pytest.raises(ExampleError) as info:
        load(path)
    assert str(info.value).startswith(
        f"{path}, line 8: weights.W_q: expected 2 rows (d_model = 2, one per embedding column), "
        "got 1. Hint: "
    )
    assert isinstance(info.value, ValueError)


# -- syntax errors and unreadable files -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "pattern"),
    [
        pytest.param("tokens: [a, b\nname: x\n", 2, r"not valid YAML: .*quoting", id="flow"),
        pytest.param("tokens: [a]\n\tname: x\n", 2, r"not valid YAML.*not tabs", id="tab"),
        pytest.param("name: x\n---\nname: y\n", 2, r"more than one YAML document", id="documents"),
        pytest.param("name: x\x07\n", 1, r"not valid YAML: special characters.*control", id="ctrl"),
        pytest.param("- a\n- b\n", 1, r"expected a mapping of keys \(tokens:, .*got a list",
                     id="list"),
        pytest.param("just text\n", 1, r"expected a mapping of keys.*got the text", id="scalar"),
    ],
)  # fmt: skip
def test_syntax_errors_have_lines(text: str, line: int, pattern: str) -> None:
    with pytest.raises(ExampleError, match=pattern) as info:
        loads(text, source="ex.yaml")
    assert info.value.line == line


def test_json_text_syntax_error() -> None:
    """A string that starts like JSON and is neither JSON nor YAML gets the JSON error."""
    pattern = r"<string>, line 2: not valid JSON: Expecting ',' delimiter \(column 2\).*quotes"
    with pytest.raises(ExampleError, match=pattern):
        loads('{"tokens": [1, 2]\n "name": "x"}')


@pytest.mark.parametrize(
    "text",
    [pytest.param("", id="empty"), pytest.param("  \n\n", id="blank")],
)
def test_empty_text(text: str) -> None:
    with pytest.raises(ExampleError, match=r"the file is empty.*docs/example-format\.md"):
        loads(text)


def test_only_comments() -> None:
    with pytest.raises(ExampleError, match=r"holds no data \(only comments\)"):
        loads("# nothing here\n")


def test_json_syntax_error_has_line(tmp_path) -> None:
    path = tmp_path / "ex.json"
    path.write_text('{\n  "tokens": ["a", "b"],\n  "name": "x",\n}\n')
    with pytest.raises(ExampleError, match=r"not valid JSON: .*comma") as info:
        load(path)
    assert info.value.line == 4
    assert str(info.value).startswith(f"{path}, line 4: not valid JSON")


def test_json_validation_error_has_line(tmp_path) -> None:
    path = tmp_path / "ex.json"
    path.write_text(
        '{\n\t"tokens": ["a", "b"],\n\t"embeddings": [[1, 0], [0, 1]],\n'
        '\t"weights": {"W_q": [[1], [0]], "W_k": [[1], [1]], "W_v": [[1], ["2"]]}\n}\n'
    )
    with pytest.raises(ExampleError, match=r"in quotes") as info:
        load(path)
    assert (info.value.line, info.value.field) == (4, "weights.W_v[1][0]")


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ExampleError, match=r"nope\.yaml: no such file.*qkv examples"):
        load(tmp_path / "nope.yaml")


def test_directory(tmp_path) -> None:
    with pytest.raises(ExampleError, match=r"is a directory, not an example file"):
        load(tmp_path)


def test_not_utf8(tmp_path) -> None:
    path = tmp_path / "ex.yaml"
    path.write_bytes(b"name: x\ntokens: [caf\xe9]\n")
    with pytest.raises(
        ExampleError, match=r"not UTF-8 text \(byte 0xe9 at offset 20\).*UTF-8"
    ) as info:
        load(path)
    assert info.value.line == 2


def test_unreadable(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ex.yaml"
    path.write_text(BASE)

    def refuse(self, *args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "open", refuse)
    with pytest.raises(ExampleError, match=r"cannot be read \(Permission denied\)"):
        load(path)


def test_alias_bomb_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(_nodes, "MAX_VALUES", 10_000)
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 8)]  # fmt: skip
    text = "tokens: [a]\nembeddings: [[1]]\nweights: {W_q: [[1]], W_k: [[1]], W_v: [[1]]}\n"
    text += "x-bomb:\n" + "\n".join("  " + line for line in lines) + "\n"
    with pytest.raises(ExampleError, match=r"expands to more than 10,000 values.*aliases"):
        loads(text)


def test_messages_are_single_and_clean() -> None:
    """No raw YAML tracebacks: the message is one line."""
    with pytest.raises(ExampleError) as info:
        loads("tokens: [a, b\n")
    assert "\n" not in str(info.value)
    assert re.match(r"<string>, line \d+: not valid YAML", str(info.value))
