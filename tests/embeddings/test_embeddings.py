"""qkv.embeddings: each format read and written, streaming, out-of-vocabulary policy, oracles."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gensim.models import KeyedVectors
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qkv import data
from qkv.embeddings import (
    FORMATS,
    Embeddings,
    _binary,
    _text,
    detect_format,
    load,
    random_vector,
    save,
)

WORDS = ["the", "cat", "sat", "on", "mat"]


def vectors(v: int = 5, d: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((v, d)).astype(np.float32)


def pets(v: int = 5, d: int = 3) -> Embeddings:
    words = WORDS[:v] if v <= len(WORDS) else [f"w{i}" for i in range(v)]
    return Embeddings(words, vectors(v, d))


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


SUFFIX = {
    "word2vec": "w2v.txt",
    "word2vec-binary": "bin",
    "glove": "glove.txt",
    "fasttext": "vec",
}


# -- each format: round trips, detection, the exact bytes ---------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_round_trips_and_is_detected(tmp_path: Path, fmt: str) -> None:
    e = pets()
    path = save(tmp_path / f"pets.{SUFFIX[fmt]}", e, fmt)
    assert detect_format(path) == fmt
    back = load(path)
    assert back.format == fmt
    assert back.words == e.words
    np.testing.assert_array_equal(back.vectors, e.vectors)
    assert back.vectors.dtype == np.float32 and not back.vectors.flags.writeable
    explicit = load(path, fmt)
    np.testing.assert_array_equal(explicit.vectors, e.vectors)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gzip_files_are_read_as_they_are(tmp_path: Path, fmt: str) -> None:
    e = pets()
    path = save(tmp_path / f"pets.{SUFFIX[fmt]}.gz", e, fmt)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = load(path)
    assert back.format == fmt
    np.testing.assert_array_equal(back.vectors, e.vectors)


def test_written_text_is_what_each_tool_writes(tmp_path: Path) -> None:
    e = Embeddings(["cat", "dog"], np.array([[0.5, 1.0], [2.0, -0.25]]))
    text = {f: save(tmp_path / f, e, f).read_bytes() for f in FORMATS}
    assert text["word2vec"] == b"2 2\ncat 0.5 1.0\ndog 2.0 -0.25\n"
    assert text["fasttext"] == b"2 2\ncat 0.5 1.0 \ndog 2.0 -0.25 \n"
    assert text["glove"] == b"cat 0.5 1.0\ndog 2.0 -0.25\n"
    assert text["word2vec-binary"] == (
        b"2 2\ncat " + struct.pack("<2f", 0.5, 1.0) + b"\ndog " + struct.pack("<2f", 2, -0.25)
        + b"\n"
    )  # fmt: skip


def test_precision_rounds_the_text_numbers(tmp_path: Path) -> None:
    e = Embeddings(["pi"], np.array([[3.14159265, -0.000123456]]))
    path = save(tmp_path / "pi.txt", e, precision=3)
    assert path.read_text() == "1 2\npi 3.14 -0.000123\n"


def test_binary_without_trailing_newlines_is_read(tmp_path: Path) -> None:
    raw = b"2 2\na " + struct.pack("<2f", 1, 2) + b"b " + struct.pack("<2f", 3, 4)
    e = load(write(tmp_path, "v.bin", raw))
    assert e.words == ("a", "b")
    assert e.vectors.tolist() == [[1, 2], [3, 4]]


def test_text_variants_are_read(tmp_path: Path) -> None:
    # CRLF line ends, a byte-order mark, tabs, trailing spaces, blank lines, a word with spaces
    glove = "\ufeffa 1 2\r\n\r\nb\t3 4 \n. . . 5 6\n"
    e = load(write(tmp_path, "v.txt", glove))
    assert e.format == "glove"
    assert e.words == ("a", "b", ". . .")
    assert e.vectors.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_unicode_words_and_other_encodings(tmp_path: Path) -> None:
    e = Embeddings(["café", "日本", "naïve\u00a0x"], vectors(3, 2))
    for fmt in FORMATS:
        back = load(save(tmp_path / f"u.{SUFFIX[fmt]}", e, fmt))
        assert back.words == e.words
    latin = write(tmp_path, "latin.txt", "1 2\ncafé 1 2\n".encode("latin-1"))
    assert load(latin, encoding="latin-1").words == ("café",)
    assert load(latin, unicode_errors="replace").words == ("caf\ufffd",)


# -- the shipped files ---------------------------------------------------------------------


def test_shipped_files_hold_the_same_vectors_in_every_format() -> None:
    first = load(data.embedding_file("word2vec"))
    assert len(first) == 47 and first.dim == 16
    for fmt in FORMATS:
        path = data.embedding_file(fmt)
        assert path.stat().st_size < 200_000
        e = load(path)
        assert e.format == fmt
        assert e.words == first.words
        np.testing.assert_array_equal(e.vectors, first.vectors)


def test_shipped_vectors_know_which_adjectives_are_positive() -> None:
    e = load(data.embedding_file("word2vec"))
    for word in data.POSITIVE:
        top = [w for w, _ in e.most_similar(word, n=4)]
        assert set(top) <= set(data.POSITIVE), (word, top)
    for word in data.NEGATIVE:
        top = [w for w, _ in e.most_similar(word, n=4)]
        assert set(top) <= set(data.NEGATIVE), (word, top)


# -- gensim as an independent oracle -----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_gensim_reads_what_we_write(tmp_path: Path, fmt: str) -> None:
    e = pets(40, 7)
    path = save(tmp_path / f"x.{SUFFIX[fmt]}", e, fmt)
    kv = KeyedVectors.load_word2vec_format(
        str(path), binary=fmt == "word2vec-binary", no_header=fmt == "glove"
    )
    assert kv.index_to_key == list(e.words)
    np.testing.assert_array_equal(kv.vectors, e.vectors)


@pytest.mark.parametrize("binary", [False, True])
def test_we_read_what_gensim_writes(tmp_path: Path, binary: bool) -> None:
    e = pets(40, 7)
    kv = KeyedVectors(7)
    kv.add_vectors(list(e.words), e.vectors)
    path = tmp_path / ("g.bin" if binary else "g.txt")
    kv.save_word2vec_format(str(path), binary=binary)
    back = load(path)
    assert back.format == ("word2vec-binary" if binary else "word2vec")
    assert back.words == e.words
    np.testing.assert_array_equal(back.vectors, kv.vectors)


# -- hypothesis: any words and vectors survive every format ------------------------------

WORD = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters=" \t\n\r\x0b\x0c\ufeff"),
    min_size=1,
    max_size=8,
)
FLOATS = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def embeddings(draw: st.DrawFn) -> Embeddings:
    words = draw(st.lists(WORD, min_size=1, max_size=6, unique=True))
    dim = draw(st.integers(1, 5))
    numbers = draw(st.lists(FLOATS, min_size=len(words) * dim, max_size=len(words) * dim))
    return Embeddings(words, np.array(numbers, dtype=np.float32).reshape(len(words), dim))


@settings(max_examples=60, deadline=None)
@given(e=embeddings(), fmt=st.sampled_from(FORMATS), precision=st.sampled_from([None, 4, 7]))
@example(  # float32 bytes that are all printable: binary by their layout, not by their bytes
    e=Embeddings(("0", "00"), np.array([[2.2691616e14], [0.0]], dtype=np.float32)),
    fmt="word2vec-binary",
    precision=None,
)
@example(  # float32 bytes holding a newline (0.02 is 0A D7 A3 3C): still binary by their layout
    e=Embeddings(("0", "00"), np.array([[0.02, 91905.0, 0.02], [0.0] * 3], dtype=np.float32)),
    fmt="word2vec-binary",
    precision=None,
)
@example(  # a first vector whose bytes read as text "pe 8" (3.8241444e-05): the next is not
    e=Embeddings(("cat", "dog"), np.array([[3.8241444e-05], [0.0]], dtype=np.float32)),
    fmt="word2vec-binary",
    precision=None,
)
@example(  # the largest float32, rounded to 7 digits, would overflow to inf
    e=Embeddings(("w",), np.array([[np.finfo(np.float32).max]], dtype=np.float32)),
    fmt="word2vec",
    precision=7,
)
def test_any_embeddings_survive_every_format(
    tmp_path_factory: pytest.TempPathFactory, e: Embeddings, fmt: str, precision: int | None
) -> None:
    path = save(tmp_path_factory.mktemp("h") / "x", e, fmt, precision=precision)
    back = load(path, fmt)
    assert back.words == e.words
    if precision is None or fmt == "word2vec-binary":
        np.testing.assert_array_equal(back.vectors, e.vectors)  # exact
    else:
        huge = np.abs(e.vectors).max(axis=1) > 3.4e38  # such rows are written exactly
        expected = np.array(
            [
                [x if h else float(f"{x:.{precision}g}") for x in row]
                for row, h in zip(e.vectors.tolist(), huge, strict=True)
            ]
        )
        np.testing.assert_array_equal(back.vectors, expected.astype(np.float32))
        np.testing.assert_allclose(back.vectors, e.vectors, rtol=10.0 ** (1 - precision))
    if fmt != "glove":  # a GloVe line "7 2" is indistinguishable from a header
        assert detect_format(path) == ("word2vec" if fmt == "fasttext" else fmt)


@settings(max_examples=40, deadline=None)
@given(e=embeddings(), fmt=st.sampled_from(["word2vec", "glove"]))
def test_the_fast_pass_equals_the_careful_pass(
    tmp_path_factory: pytest.TempPathFactory, e: Embeddings, fmt: str
) -> None:
    path = save(tmp_path_factory.mktemp("f") / "x", e, fmt)
    fast = load(path, fmt)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_text.TextReader, "_parse_fast", lambda self, kept: None)
        careful = load(path, fmt)
    assert fast.words == careful.words
    np.testing.assert_array_equal(fast.vectors, careful.vectors)


# -- streaming: limit and vocabulary -----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_limit_reads_the_first_vectors_and_stops(tmp_path: Path, fmt: str) -> None:
    e = pets(5, 3)
    path = save(tmp_path / f"x.{SUFFIX[fmt]}", e, fmt)
    with path.open("ab") as handle:  # garbage after the limit is never read
        handle.write(b"\x00garbage that is not a vector\n")
    got = load(path, limit=2)
    assert got.words == e.words[:2]
    np.testing.assert_array_equal(got.vectors, e.vectors[:2])
    with pytest.raises(ValueError, match=r"(line [67]|byte \d+)"):
        load(path, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_vocabulary_keeps_only_the_wanted_words_in_file_order(tmp_path: Path, fmt: str) -> None:
    e = pets(5, 3)
    path = save(tmp_path / f"x.{SUFFIX[fmt]}", e, fmt)
    got = load(path, vocabulary=["mat", "cat", "emu"])
    assert got.words == ("cat", "mat")
    np.testing.assert_array_equal(got.vectors, e.vectors[[1, 4]])
    assert got.missing(["cat", "emu"]) == ["emu"]
    both = load(path, vocabulary=["mat", "cat"], limit=3)
    assert both.words == ("cat",)
    with path.open("ab") as handle:  # reading stops when all wanted words are found
        handle.write(b"\x00garbage\n")
    assert load(path, vocabulary=["cat", "the"]).words == ("the", "cat")
    none = load(path, vocabulary=[])
    assert len(none) == 0 and none.dim == 3
    if fmt == "glove":  # no count to check, and skipped lines are not parsed
        assert len(load(path, vocabulary=["emu"])) == 0
    else:  # not found: the whole file is read, and the header's count checked
        with pytest.raises(ValueError, match=r"(line 7|byte \d+): (one vector|more data)"):
            load(path, vocabulary=["emu"])


def test_streaming_keeps_memory_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_text, "BLOCK_BYTES", 1 << 15)
    monkeypatch.setattr(_binary, "CHUNK", 1 << 15)
    e = pets(20_000, 50)  # 4 MB as float32
    for fmt in ("word2vec-binary", "word2vec"):
        path = save(tmp_path / f"big.{SUFFIX[fmt]}", e, fmt, precision=4)
        assert path.stat().st_size > 3_000_000
        for options in ({"limit": 10}, {"vocabulary": ["w3", "w19999"]}):
            tracemalloc.start()
            got = load(path, fmt, **options)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert len(got) in (10, 2)
            assert peak < 600_000, (fmt, options, peak)


def test_line_numbers_are_right_across_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_text, "BLOCK_BYTES", 64)
    lines = ["300 2"] + [f"w{i} {i} 1.5" for i in range(299)] + ["bad 1 x"]
    path = write(tmp_path, "v.txt", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"v\.txt, line 301: 'x' is not a number"):
        load(path)
    assert len(load(path, limit=299)) == 299


# -- malformed text files: each message pinned ------------------------------------------

TEXT_ERRORS = [
    (
        "2 3\na 1 2 3\nb 1 2\n",
        r"line 3: the vector of 'b' has 2 numbers, expected 3 \(the header on line 1 says "
        r"D = 3\)\. Hint: each line is a word and D numbers",
    ),
    ("2 3\na 1 2 3\nb 1 2 3 4\n", r"line 3: the vector of 'b' has 4 numbers, expected 3"),
    ("a 1 2 3\nb 1 2\n", r"line 2: .* expected 3 \(line 1 has 3, which sets D\)"),
    ("2 3\na 1 2 3\nb\n", r"line 3: the line holds only 'b': expected a word and 3 numbers"),
    ("2 3\na 1 2 3\nb 1 x 3\n", r"line 3: 'x' is not a number \(number 2 of the vector of 'b'\)"),
    ("2 3\na 1 2 3\nb 1 1_0 3\n", r"line 3: '1_0' is not a number"),
    ("2 3\na 1 2 3\nb 1 nan 3\n", r"line 3: number 2 of the vector of 'b' is nan, not a finite"),
    ("2 3\na 1 2 3\nb inf 1 3\n", r"line 3: number 1 of the vector of 'b' is inf"),
    (
        "1 3\na 1 2 3\nb 1 2 3\n",
        r"line 3: one vector more than the 1 the header \(line 1\) says\. Hint: fix the count "
        r"in the header, or read the first 1 with limit=1",
    ),
    (
        "3 3\na 1 2 3\nb 1 2 3\n",
        r"v\.txt: the file ends after 2 vectors, but the header \(line 1\) says 3\. Hint: the "
        r"file may be truncated .*limit=2",
    ),
    (
        "2 3\na 1 2 3\na 4 5 6\n",
        r"line 3: the word 'a' appears again \(first on line 2\)\. Hint: .*duplicates='first'",
    ),
    ("", r"v\.txt: the file is empty"),
    ("2 0\n", r"line 1: the header says each vector has DIM = 0 numbers"),
    (
        "# a comment\na 1 2\n",
        r"line 1 is neither a word2vec/fastText header 'COUNT DIM' nor a GloVe line",
    ),
]


@pytest.mark.parametrize(("content", "message"), TEXT_ERRORS)
def test_malformed_text_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = write(tmp_path, "v.txt", content)
    with pytest.raises(ValueError, match=message) as info:
        load(path)
    assert str(info.value).startswith(str(path))


def test_bad_encoding_names_the_line_and_byte(tmp_path: Path) -> None:
    path = write(tmp_path, "v.txt", b"2 2\na 1 2\nb\xffc 3 4\n")
    with pytest.raises(
        ValueError,
        match=r"line 3: the word 'b\\xffc' is not valid utf-8 \(byte 0xff at column 2\)\. "
        r"Hint: pass encoding='latin-1'.*unicode_errors='replace'",
    ):
        load(path)
    assert load(path, unicode_errors="ignore").words == ("a", "bc")


def test_duplicates_first_keeps_the_first_vector(tmp_path: Path) -> None:
    path = write(tmp_path, "v.txt", "a 1 2\nb 3 4\na 5 6\n")
    e = load(path, duplicates="first")
    assert e.words == ("a", "b") and e.vectors.tolist() == [[1, 2], [3, 4]]


def test_explicit_formats_that_do_not_fit(tmp_path: Path) -> None:
    glove = write(tmp_path, "g.txt", "a 1 2 3\n")
    with pytest.raises(
        ValueError,
        match=r"line 1: expected the header 'COUNT DIM', got 'a 1 2 3'\. Hint: this line looks "
        r"like GloVe \(no header\): format='glove'",
    ):
        load(glove, "word2vec")
    header = write(tmp_path, "h.txt", "1 3\na 1 2 3\n")
    with pytest.raises(ValueError, match=r"line 1 is a header '1 3', but the GloVe format has"):
        load(header, "glove")
    with pytest.raises(
        ValueError,
        match=r"byte 6: the vector of 'a' is printable text, not float32 numbers\. Hint: this "
        r"looks like a text file: format='word2vec'",
    ):
        load(header, "word2vec-binary")


# -- malformed binary files: each message pinned, with byte offsets -----------------------


def binary(*entries: tuple[bytes, tuple[float, ...]], header: bytes = b"2 3\n") -> bytes:
    return header + b"".join(w + b" " + struct.pack(f"<{len(v)}f", *v) + b"\n" for w, v in entries)


GOOD = binary((b"a", (1, 2, 3)), (b"b", (4, 5, 6)))  # a at byte 4, b at byte 19, its vector at 21


BINARY_ERRORS = [
    (
        GOOD[:25],
        r"v\.bin, byte 21: the file ends in the middle of the vector of 'b': 4 of 12 bytes "
        r"\(3 float32 numbers\)\. Hint: the file is truncated .*limit=1",
    ),
    (GOOD[:20], r"byte 19: the file ends inside a word \('b'\)"),
    (GOOD[:19], r"byte 19: the file ends after 1 vectors, but the header \(line 1\) says 2"),
    (GOOD + b"c ", r"byte 34: more data after the 2 vectors the header \(line 1\) says"),
    (
        binary((b"a", (1, 2, 3)), (b"\xff", (4, 5, 6))),
        r"byte 19: the word '\\xff' is not valid utf-8 \(byte 0xff\)",
    ),
    (
        binary((b"a", (1, 2, 3)), (b"b", (4, float("nan"), 6))),
        r"byte 19: the vector of 'b' holds nan or inf",
    ),
    (
        binary((b"a", (1, 2, 3)), (b"a", (4, 5, 6))),
        r"byte 19: the word 'a' appears again \(first at byte 4\)",
    ),
    (b"2 3\n a" + GOOD[5:], r"byte 4: an empty word"),
    (b"2 3\n" + b"x" * 70_000, r"byte 4: no space after a word within 65536 bytes"),
]


@pytest.mark.parametrize(("content", "message"), BINARY_ERRORS)
def test_malformed_binary_files_name_the_byte(tmp_path: Path, content: bytes, message: str) -> None:
    path = write(tmp_path, "v.bin", content)
    with pytest.raises(ValueError, match=message) as info:
        load(path, "word2vec-binary")
    assert info.value.offset is not None  # type: ignore[attr-defined]


def test_truncated_gzip_binary_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "v.bin.gz"
    path.write_bytes(gzip.compress(GOOD[:25]))
    with pytest.raises(ValueError, match=r"byte 21: the file ends in the middle of the vector"):
        load(path)


# -- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"format": "vec"}, ValueError, r"format must be one of 'auto', 'word2vec'"),
        ({"limit": 0}, ValueError, r"limit must be a positive whole number or None, got 0"),
        ({"limit": True}, ValueError, r"limit must be a positive whole number"),
        ({"vocabulary": "cat"}, TypeError, r"vocabulary must be a collection of words, got a str"),
        ({"vocabulary": [1]}, TypeError, r"vocabulary must hold strings, got 1"),
        ({"unicode_errors": "x"}, ValueError, r"unicode_errors must be one of 'strict'"),
        ({"duplicates": "last"}, ValueError, r"duplicates must be one of 'error', 'first'"),
        ({"encoding": "klingon"}, LookupError, r"unknown encoding"),
    ],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any], error: type, message: str) -> None:
    path = save(tmp_path / "x.txt", pets())
    with pytest.raises(error, match=message):
        load(path, **options)


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.txt")


def test_save_refuses_words_with_whitespace_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = save(tmp_path / "x.txt", pets())
    before = path.read_bytes()
    bad = Embeddings(["ice cream"], np.ones((1, 2)))
    with pytest.raises(ValueError, match=r"words\[0\] = 'ice cream' holds whitespace"):
        save(path, bad)
    with pytest.raises(ValueError, match=r"format must be one of"):
        save(path, pets(), "npy")
    with pytest.raises(ValueError, match=r"precision must be a whole number"):
        save(path, pets(), precision=0)
    with pytest.raises(ValueError, match=r"the folder .* does not exist"):
        save(tmp_path / "no" / "x.txt", pets())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


# -- Embeddings and the out-of-vocabulary policy ----------------------------------------------


def test_lookup_policies() -> None:
    e = Embeddings(["cat", "dog"], np.array([[1.0, 0.0], [0.0, 2.0]]))
    with pytest.raises(
        KeyError,
        match=r"2 word\(s\) have no vector: 'emu', 'yak'\. Hint: lookup\(\.\.\., "
        r"oov='zero'\) or oov='random'",
    ):
        e.lookup(["cat", "emu", "yak"])
    zero = e.lookup(["cat", "emu"], oov="zero")
    assert zero.tolist() == [[1, 0], [0, 0]]
    rand = e.lookup(["emu", "cat", "yak"], oov="random")
    assert rand[1].tolist() == [1, 0]
    np.testing.assert_array_equal(rand[0], e.lookup(["emu"], oov="random")[0])  # fixed per word
    assert not np.array_equal(rand[0], rand[2])
    assert not np.array_equal(rand[0], e.lookup(["emu"], oov="random", seed=1)[0])
    with pytest.raises(ValueError, match=r"oov must be one of 'error', 'zero', 'random'"):
        e.lookup(["cat"], oov="skip")  # type: ignore[arg-type]


def test_random_vectors_have_the_scale_of_the_file() -> None:
    e = Embeddings([f"w{i}" for i in range(200)], vectors(200, 50) * 0.1)
    sigma = float(e.vectors.std())
    unknown = e.lookup([f"new{i}" for i in range(200)], oov="random")
    assert abs(float(unknown.std()) / sigma - 1) < 0.05
    v = random_vector("emu", 3, scale=2.0, seed=5)
    expected = np.random.default_rng(
        [5, int.from_bytes(__import__("hashlib").blake2b(b"emu", digest_size=8).digest(), "little")]
    )
    np.testing.assert_array_equal(v, (expected.standard_normal(3) * 2.0).astype(np.float32))


def test_missing_word_suggests_the_other_case() -> None:
    e = Embeddings(["Paris", "cat"], np.ones((2, 2)))
    with pytest.raises(KeyError, match=r"did you mean 'Paris' for 'paris'"):
        e["paris"]
    assert "cat" in e and "emu" not in e and len(e) == 2


@pytest.mark.parametrize(
    ("words", "vecs", "error", "message"),
    [
        (["a"], np.ones(3), ValueError, r"vectors must be a \(V, D\) matrix, got shape \(3,\)"),
        (["a", "b"], np.ones((3, 2)), ValueError, r"words has 2 entries but vectors has 3 rows"),
        (["a", "a"], np.ones((2, 2)), ValueError, r"words\[1\] = 'a' repeats words\[0\]"),
        ([""], np.ones((1, 2)), TypeError, r"words\[0\] must be a non-empty str"),
        (["a"], [[np.nan, 1]], ValueError, r"vectors\[0\] holds nan or inf"),
    ],
)
def test_embeddings_checks_its_input(
    words: list[str], vecs: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        Embeddings(words, vecs)  # type: ignore[arg-type]


def test_embeddings_and_data_need_numpy_only() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['matplotlib'] = None; "
        "sys.modules['gensim'] = None; sys.modules['scipy'] = None; "
        "from qkv import data, embeddings; "
        "e = embeddings.load(data.embedding_file('word2vec-binary')); "
        "print(len(e), data.recall(1).tokens.shape, len(data.sentiment(10)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["47", "(1,", "9)", "10"]
