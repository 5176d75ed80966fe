"""A fuzz suite over every surface that reads a user's input (issue 12, "Done when").

Surfaces: worked examples, saved traces, word-vector files, checkpoints, data files, the
outputs (text, Markdown, LaTeX, JSON, HTML) and the Python API. For hostile or malformed
input each must give a result or one clear error (a ``ValueError`` subclass in the library;
exit status 2 and one line ``qkv: error: ...`` on the command line), never a traceback, a
crash, a hang or unbounded memory; and hostile tokens (``<script>``, ``<img onerror=...>``,
``</title>``, terminal escape sequences) never reach Markdown, HTML or the terminal raw.

The inputs are built here: mutations of valid files (fields replaced by values of every JSON
or YAML type, deleted, nested deeply, made huge) with hypothesis, and a few fixed hostile
files. Most checks run in-process; the ones that hung or filled the memory before the fixes
run ``qkv`` in a child process with a time limit and 2 GiB of address space.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
from qkv import examples, render
from qkv.cli import main
from qkv.embeddings import load as load_embeddings
from tests.support.isolated import run_cli_isolated

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
HOSTILE_TOKENS = (
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "</title><b>x",
    "\x1b[31mred\x1b[0m",
    "\x1b]8;;http://evil.example\x07link",
    "a|b`c*_d",
)
BASE = """tokens: [a, b, c]
embeddings: [[1, 0], [0, 1], [1, 1]]
weights: {W_q: [[1, 0], [0, 1]], W_k: [[1, 0], [0, 1]], W_v: [[1, 2], [3, 4]]}
options: {scale: true, causal: false, queries: [a]}
claimed: {V: {a: [1, 2]}}
"""

# Values of every JSON type, and some that are large, deep or odd.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from([10**400, -1, 0, 2**63, -(2**63) - 1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["nan", "inf", "-inf", "", "\u2028", "<script>", "\x1b[2J"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
YAML_SNIPPETS = st.sampled_from(
    [
        "1" + "0" * 400,
        "-1e999",
        ".nan",
        "!!python/name:os.system",
        "!!python/object/apply:os.system [ls]",
        "!!binary aGk=",
        "!!timestamp 2001-99-99",
        "!!set {a, b}",
        "!mine x",
        "&a [*a]",
        "[" * 200 + "]" * 200,
        "{a: 1, a: 2}",
        "'²'",
        "²",
        "'<script>alert(1)</script>'",
        "[]",
        "{}",
        "~",
        "yes",
        "[[1, 2], [3]]",
        "[[1, 2, 3], [4, 5, 6], [7, 8, 9]]",
        "'\\x1b[31m'",
        "? [a]\n  : 1",
        "*undefined",
        "\t1",
    ]
)


def error_of(call: Callable[[], object]) -> ValueError | None:
    """The ``ValueError`` that ``call()`` raises (a user error), or None; anything else is
    raised (a crash)."""
    try:
        call()
    except ValueError as error:
        return error
    return None


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON value (keys and list positions), the value's own first."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:3]):
            found += paths(item, (*prefix, i))
    return found


def mutate(value: Any, path: tuple[Any, ...], new: Any, delete: bool) -> Any:
    """A copy of ``value`` with the item at ``path`` replaced by ``new`` (or deleted)."""
    if not path:
        return new
    out = copy.deepcopy(value)
    node = out
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return out


def assert_one_line_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> int:
    """``qkv ARGV`` in-process: exit 0, or 2 with one line ``qkv: error: ...``; an exception
    (a traceback) fails the test."""
    code = main(argv)
    err = capsys.readouterr().err
    if code != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    return code


def assert_clean_exit(result: tuple[int, str]) -> None:
    code, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Hint:" in lines[0], lines[0]


# -- worked examples ----------------------------------------------------------------------

EXAMPLE_FIELDS = [
    "tokens",
    "embeddings",
    "weights",
    "options",
    "claimed",
    "x-extra",
    "heads",
    "format",
    "name",
]


@FUZZ
@given(field=st.sampled_from(EXAMPLE_FIELDS), snippet=YAML_SNIPPETS)
def test_fuzz_example_fields(field: str, snippet: str) -> None:
    lines = [line for line in BASE.splitlines() if not line.startswith(f"{field}:")]
    text = "\n".join([*lines, f"{field}: {snippet}"]) + "\n"
    error = error_of(lambda: examples.run(examples.loads(text, source="fuzz.yaml")))
    if error is not None:
        message = str(error)
        assert "\n" not in message and message.startswith("fuzz.yaml")
        assert len(message) < 600


@FUZZ
@given(data=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_example_bytes(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("ex") / "fuzz.json"
    path.write_bytes(data)
    with pytest.raises(examples.ExampleError):
        examples.load(path)


# -- saved traces -------------------------------------------------------------------------

TRACE = examples.run(examples.resolve("i-love-statistics")).to_dict()
TRACE_PATHS = paths(TRACE)


@FUZZ
@given(path=st.sampled_from(TRACE_PATHS), new=JSON_VALUES, delete=st.booleans())
def test_fuzz_trace_files(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    path: tuple[Any, ...],
    new: Any,
    delete: bool,
) -> None:
    data = mutate(TRACE, path, new, delete and bool(path))
    file = tmp_path_factory.mktemp("trace") / "trace.json"
    file.write_text(json.dumps(data))
    for form in ("text", "markdown"):
        assert_one_line_cli(["explain", "--trace", str(file), "--format", form], capsys)


# -- word vectors -------------------------------------------------------------------------


@FUZZ
@given(
    header=st.sampled_from(["", "3 2\n", "1000000000000 2\n", "1 1000000000\n", "2 0\n"]),
    body=st.binary(max_size=120),
    packed=st.booleans(),
    cut=st.booleans(),
)
def test_fuzz_embedding_files(
    tmp_path_factory: pytest.TempPathFactory, header: str, body: bytes, packed: bool, cut: bool
) -> None:
    raw = header.encode() + body
    if packed:
        raw = gzip.compress(raw)
    if cut:
        raw = raw[: len(raw) // 2]
    path = tmp_path_factory.mktemp("vec") / ("v.gz" if packed else "v.txt")
    path.write_bytes(raw)

    def read() -> None:
        assert np.isfinite(load_embeddings(path).vectors).all()

    error = error_of(read)
    assert error is None or ("\n" not in str(error) and str(path) in str(error))


# -- data files ---------------------------------------------------------------------------


@FUZZ
@given(
    rows=st.lists(JSON_VALUES, max_size=4),
    suffix=st.sampled_from([".jsonl", ".csv", ".tsv"]),
)
def test_fuzz_data_files(
    tmp_path_factory: pytest.TempPathFactory, rows: list[Any], suffix: str
) -> None:
    from qkv.train._text import read_labelled

    path = tmp_path_factory.mktemp("data") / f"d{suffix}"
    if suffix == ".jsonl":
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        lines.append(json.dumps({"text": "a\u2028b c", "label": "x\u2029"}, ensure_ascii=False))
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        sep = "," if suffix == ".csv" else "\t"
        cells = [str(r) for r in rows]
        path.write_text(f"text{sep}label\n" + "\n".join(f"{c}{sep}{c}" for c in cells) + "\n")
    error = error_of(lambda: read_labelled(path))
    assert error is None or ("\n" not in str(error) and str(path) in str(error))


# -- checkpoints --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-run") / "run"
    argv = ["train", "classify", "--out", str(out), "--embedding-dim", "8", "--sentences", "60"]
    assert main([*argv, "--steps", "3", "--eval-every", "3", "--quiet"]) == 0
    return out


def test_fuzz_checkpoint_manifests(trained_run: Path, tmp_path: Path) -> None:
    from qkv.train import load_trained

    step = next(trained_run.glob("best/step-*"))
    manifest = json.loads((step / "checkpoint.json").read_text())
    manifest_paths = paths(manifest)

    @FUZZ
    @given(path=st.sampled_from(manifest_paths), new=JSON_VALUES, delete=st.booleans())
    def check(path: tuple[Any, ...], new: Any, delete: bool) -> None:
        folder = tmp_path / "step"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(step, folder)
        changed = mutate(manifest, path, new, delete and bool(path))
        (folder / "checkpoint.json").write_text(json.dumps(changed))
        error = error_of(lambda: load_trained(folder))
        assert error is None or ("\n" not in str(error) and str(folder) in str(error))

    check()


# -- the Python API -----------------------------------------------------------------------


@FUZZ
@given(
    q_shape=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    k_shape=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    fill=st.sampled_from([0.0, 1.0, math.nan, math.inf, 1e308, -1e308]),
    causal=st.booleans(),
)
def test_fuzz_attention_api(
    q_shape: list[int], k_shape: list[int], fill: float, causal: bool
) -> None:
    """Shapes that fit give what the mathematics says; those that do not, and scores that
    overflow, give one line that names the argument and a hint."""
    q = np.full(q_shape, fill)
    k = np.full(k_shape, 1.0)  # the keys and values: every score of a row is the same
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # inf − inf on an infinite query
            out = qkv.scaled_dot_product_attention(q, k, k, is_causal=causal)
    except (ValueError, TypeError) as error:
        message = str(error)
        assert "\n" not in message and "Hint:" in message, message
        assert re.search(r"\b(query|key|value)\b", message), message
        return
    assert out.shape == (*q.shape[:-1], k.shape[-1])
    # Equal scores share the weight equally among the keys a row may see, and the values
    # are ones: every context vector is ones. A NaN or infinite query makes NaN scores (no
    # error: the input is not finite); a finite one that overflows was refused above.
    expected = 1.0 if math.isfinite(fill) else math.nan
    np.testing.assert_array_equal(out, np.full(out.shape, expected))


@pytest.mark.parametrize("query", ["²", "-0", "1" + "0" * 50, "", " ", "<script>", "\x1b[2J"])
def test_fuzz_query_arguments(query: str) -> None:
    example = examples.resolve("i-love-statistics")
    error = error_of(lambda: examples.run(example, query=query))
    assert error is None or str(error).startswith("query")


# -- outputs: no injection ----------------------------------------------------------------


def _hostile_example() -> examples.Example:
    tokens = ", ".join(json.dumps(t) for t in HOSTILE_TOKENS)
    rows = ", ".join(f"[{i}, 1]" for i in range(len(HOSTILE_TOKENS)))
    text = f"""{{"name": "</title><script>alert(1)</script>", "tokens": [{tokens}],
        "description": "<img src=x onerror=alert(1)> \\u001b[2J",
        "embeddings": [{rows}],
        "weights": {{"W_q": [[1, 0], [0, 1]], "W_k": [[1, 0], [0, 1]],
                     "W_v": [[1, 0], [0, 1]]}}}}"""
    return examples.loads(text, source="hostile.json")


RAW_TAG = re.compile(r"(?<!\\)<(?:script|img|/title|b>)")
"""A hostile tag that is not escaped: ``\\<script>`` is text in CommonMark, ``<script>`` is not."""


def _assert_inert(text: str, form: str) -> None:
    """No terminal control characters in any format; no live hostile tag in Markdown and
    HTML (JSON and LaTeX hold tokens as data, where ``<`` is harmless)."""
    assert "\x1b" not in text and "\x07" not in text, f"{form}: a raw control character"
    if form == "markdown":
        assert RAW_TAG.search(text) is None, RAW_TAG.search(text)
    if form == "html":
        assert "<script>alert" not in text and "<img src=x onerror" not in text
        assert text.count("</title>") == 1, "a token closed the page's <title>"


@pytest.mark.parametrize("form", ["text", "markdown", "latex", "json"])
def test_hostile_tokens_are_inert_in_every_format(form: str) -> None:
    trace = examples.run(_hostile_example())
    _assert_inert(render.render(trace, form, precision=3, width=100), form)


def test_hostile_tokens_are_inert_in_html(tmp_path: Path) -> None:
    trace = examples.run(_hostile_example())
    render.html(trace, tmp_path / "page.html", precision=3)
    _assert_inert((tmp_path / "page.html").read_text(encoding="utf-8"), "html")


def test_hostile_tokens_from_a_trace_file_are_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hostile.json"
    examples.run(_hostile_example()).save(path)
    for form in ("markdown", "text"):
        out = tmp_path / f"out.{form}"
        assert main(["explain", "--trace", str(path), "--format", form, "-o", str(out)]) == 0
        _assert_inert(out.read_text(encoding="utf-8"), form)
    capsys.readouterr()


def test_hostile_tokens_on_the_terminal_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = tmp_path / "hostile.json"
    tokens = list(HOSTILE_TOKENS)
    example.write_text(
        json.dumps(
            {
                "tokens": tokens,
                "embeddings": [[i, 1] for i in range(len(tokens))],
                "weights": {
                    "W_q": [[1, 0], [0, 1]],
                    "W_k": [[1, 0], [0, 1]],
                    "W_v": [[1, 0], [0, 1]],
                },
            }
        )
    )
    assert main(["explain", "--example", str(example), "--query", "0"]) == 0
    out = capsys.readouterr().out
    assert "\x1b]8" not in out and "\x1b[31m" not in out and "\x07" not in out


# -- what hung or filled the memory: in a child, with limits -----------------------------


def test_devices_and_huge_files_end_within_seconds(tmp_path: Path) -> None:
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    (tmp_path / "zero.csv").symlink_to("/dev/zero")
    big = tmp_path / "big.yaml"  # 50 MB: `qkv explain` hung on it
    with big.open("w") as handle:
        handle.write("tokens: [" + ", ".join(f"t{i}" for i in range(200_000)) + "]\n")
        handle.write("embeddings:\n" + "  - [0.5, 0.25]\n" * 3_000_000)
    bomb = tmp_path / "bomb.txt.gz"  # 200 MiB of blank lines in 200 gzip members, 40 kB
    bomb.write_bytes(b"".join([gzip.compress(b"3 8\n")] + [gzip.compress(b"\n" * (1 << 20))] * 200))
    header = tmp_path / "huge.txt"
    header.write_bytes(b"1000000000000 8\nthe " + b"0.5 " * 8 + b"\n")
    runs = [
        ["explain", "--example", "/dev/zero"],
        ["explain", "--trace", "/dev/zero"],
        ["explain", "--trace", str(tmp_path / "zero.json")],
        ["explain", "--example", str(big)],
        ["train", "classify", "--data", str(tmp_path / "zero.csv"), "--out", "r1"],
        ["train", "classify", "--embeddings", str(bomb), "--out", "r2", "--steps", "1"],
        ["train", "classify", "--embeddings", str(header), "--out", "r3", "--steps", "1"],
    ]
    for result in run_cli_isolated(runs, cwd=tmp_path, seconds=60):
        assert_clean_exit(result)
