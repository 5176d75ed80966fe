"""qkv.data: generated tasks are deterministic, labels are right, shipped files are current."""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv import data
from qkv.data.__main__ import main
from qkv.embeddings import load

# -- associative recall ----------------------------------------------------------------------


def test_recall_is_the_same_for_a_seed_and_differs_across_seeds() -> None:
    a, b, c = data.recall(50, seed=1), data.recall(50, seed=1), data.recall(50, seed=2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.tokens, c.tokens)


def test_recall_pinned_sequences() -> None:
    s = data.recall(2, pairs=3, seed=0)
    assert s.texts() == ["l 7 d 8 u 0 d", "w 0 g 6 u 3 w"]  # d → 8, w → 0
    assert s.vocabulary.decode(s.targets) == ["8", "0"]
    assert s.answer_pairs.tolist() == [1, 0]


def test_recall_answer_is_the_value_after_the_queried_key() -> None:
    s = data.recall(500, pairs=5, keys=12, values=7, seed=3)
    assert s.tokens.shape == (500, 11) and s.tokens.dtype == np.int64
    assert len(s.vocabulary) == 19
    for row, target, pair in zip(s.tokens, s.targets, s.answer_pairs, strict=True):
        keys, values, query = row[0:-1:2], row[1:-1:2], row[-1]
        assert len(set(keys.tolist())) == 5  # the keys of a sequence are all different
        assert (keys < 12).all() and (values >= 12).all()
        (where,) = np.flatnonzero(keys == query)
        assert values[where] == target and where == pair
    assert set(s.answer_pairs.tolist()) == set(range(5))  # every position is asked for


def test_recall_vocabulary_names() -> None:
    small = data.recall(1, pairs=1, keys=3, values=2)
    assert small.vocabulary.tokens == ("a", "b", "c", "0", "1")
    big = data.recall(1, pairs=1, keys=30, values=12)
    assert big.vocabulary.tokens[:2] == ("k0", "k1") and big.vocabulary.tokens[30] == "v0"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n": 0}, r"n must be a positive whole number, got 0\. Hint: n=10000"),
        ({"n": 5, "pairs": True}, r"pairs must be a positive whole number, got True"),
        ({"n": 5, "pairs": 5, "keys": 4}, r"pairs = 5 needs as many different keys, but keys = 4"),
    ],
)
def test_recall_bad_arguments(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        data.recall(**options)


# -- the sentiment set -----------------------------------------------------------------------

ADJ = "|".join(data.POSITIVE + data.NEGATIVE)
NOUN = "|".join(data.NOUNS)
# An independent reading of each rule: which adjective decides the label.
READERS = [
    (rf"the (?:{NOUN}) was ({ADJ}) , not (?:{ADJ})", "X, not Y"),
    (rf"the (?:{NOUN}) was not (?:{ADJ}) , it was ({ADJ})", "not X, it was Y"),
    (rf"the (?:{NOUN}) was (?:{ADJ}) but the (?:{NOUN}) was ({ADJ})", "X but Y"),
    (rf"the (?:{NOUN}) was (?:{ADJ}) at first and ({ADJ}) in the end", "first X, end Y"),
]


def read_label(text: str) -> tuple[str, str]:
    for pattern, rule in READERS:
        match = re.fullmatch(pattern, text)
        if match:
            return ("positive" if match[1] in data.POSITIVE else "negative"), rule
    raise AssertionError(f"no rule reads {text!r}")


def test_sentiment_labels_follow_the_rules() -> None:
    s = data.sentiment(2000, seed=0)
    assert len(s) == 2000 and len(set(s.texts)) == 2000
    for text, label, rule in zip(s.texts, s.labels, s.rules, strict=True):
        assert read_label(text) == (label, rule)
    assert Counter(s.labels) == {"positive": 1000, "negative": 1000}
    assert set(s.rules) == set(data.RULES)


def test_sentiment_pinned_sentences() -> None:
    s = data.sentiment(4, seed=0)
    assert list(zip(s.texts, s.labels, strict=True)) == [
        ("the staff was fine at first and bad in the end", "negative"),
        ("the staff was bad at first and fine in the end", "positive"),
        ("the movie was boring , not pleasant", "negative"),
        ("the movie was pleasant , not boring", "positive"),
    ]


def test_twins_have_the_same_words_and_opposite_labels() -> None:
    s = data.sentiment(400, seed=5)
    by_pair: dict[int, list[int]] = {}
    for i, pair in enumerate(s.pairs):
        by_pair.setdefault(pair, []).append(i)
    assert len(by_pair) == 200
    for i, j in by_pair.values():
        assert Counter(s.texts[i].split()) == Counter(s.texts[j].split())
        assert {s.labels[i], s.labels[j]} == {"positive", "negative"}


def test_no_bag_of_words_model_beats_chance() -> None:
    s = data.sentiment(2000, seed=0)
    assert data.bag_of_words_ceiling(s.texts, s.labels) == 0.5
    _, val = s.split(0.25, seed=1)
    assert data.bag_of_words_ceiling(val.texts, val.labels) == 0.5
    assert data.bag_of_words_ceiling(["a b", "b a", "c"], ["x", "y", "y"]) == 2 / 3


def test_sentiment_is_the_same_for_a_seed() -> None:
    assert data.sentiment(100, seed=3) == data.sentiment(100, seed=3)
    assert data.sentiment(100, seed=3) != data.sentiment(100, seed=4)


def test_split_keeps_twins_together() -> None:
    train, val = data.sentiment(1000).split(0.2, seed=0)
    assert (len(train), len(val)) == (800, 200)
    assert not set(train.pairs) & set(val.pairs)
    with pytest.raises(ValueError, match=r"validation must be a fraction between 0 and 1"):
        data.sentiment(10).split(1.0)


@pytest.mark.parametrize(
    ("n", "message"),
    [
        (3, r"n must be an even whole number of at least 2 \(sentences come in twin pairs\)"),
        (0, r"n must be an even whole number"),
        (10**6, r"n = 1000000 needs 500000 different pairs, but the rules allow 10752"),
    ],
)
def test_sentiment_bad_sizes(n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        data.sentiment(n)


def test_csv_and_jsonl_hold_the_set(tmp_path: Path) -> None:
    s = data.sentiment(20, seed=2)
    with s.to_csv(tmp_path / "s.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["text"] for r in rows] == list(s.texts)
    assert [r["label"] for r in rows] == list(s.labels)
    assert list(rows[0]) == ["text", "label", "pair", "rule"]
    lines = (s.to_jsonl(tmp_path / "s.jsonl")).read_text(encoding="utf-8").splitlines()
    objects = [json.loads(line) for line in lines]
    assert objects == s.rows()
    assert isinstance(objects[0]["pair"], int)


# -- the vocabulary --------------------------------------------------------------------------


def test_vocabulary() -> None:
    v = data.Vocabulary.from_texts(["b a b", "c b a"], min_count=2)
    assert v.tokens == ("<pad>", "<unk>", "b", "a")
    assert v.encode(["a", "zzz"], unknown="<unk>").tolist() == [3, 1]
    with pytest.raises(KeyError, match=r"'zzz' is not in the vocabulary of 4 tokens"):
        v.encode(["zzz"])
    with pytest.raises(IndexError, match=r"id 9 is outside the vocabulary \(ids 0\.\.3\)"):
        v.decode([9])
    with pytest.raises(ValueError, match=r"tokens\[1\] = 'a' repeats tokens\[0\]"):
        data.Vocabulary(["a", "a"])


# -- the shipped word vectors ----------------------------------------------------------------


def test_shipped_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    written = data.write_embedding_files(tmp_path)
    assert set(written) == set(data.FILES)
    for fmt, path in written.items():
        shipped = load(data.embedding_file(fmt))
        fresh = load(path)
        assert fresh.words == shipped.words
        # 5 decimals: allow one unit in the last place (another BLAS may round differently)
        np.testing.assert_allclose(fresh.vectors, shipped.vectors, rtol=0, atol=1.01e-5)
        if np.array_equal(fresh.vectors, shipped.vectors):  # then the bytes are too
            assert path.read_bytes() == data.embedding_file(fmt).read_bytes()


def test_embedding_vectors_are_rounded_and_sign_fixed() -> None:
    e = data.ppmi_svd(data.embedding_corpus(), dim=8)
    rounded = np.round(e.vectors.astype(np.float64), 5).astype(np.float32)
    np.testing.assert_array_equal(e.vectors, rounded)
    largest = np.abs(e.vectors).argmax(axis=0)
    assert (e.vectors[largest, np.arange(8)] > 0).all()
    with pytest.raises(ValueError, match=r"dim must be from 1 to the vocabulary size"):
        data.ppmi_svd(["a b"], dim=3)


def test_ppmi_of_a_tiny_corpus_by_hand() -> None:
    # "a b", "a c", window 1: the pairs (a,b), (b,a), (a,c), (c,a). Context weights
    # 2^0.75 : 1 : 1, so PPMI(b, a) = PPMI(c, a) = -log P_ctx(a) = log(1 + 2^0.25) = m, and
    # PPMI(a, b) = PPMI(a, c) < m. M·Mᵀ has the top eigenvector (0, 1, 1)/√2 with
    # eigenvalue 2m², so W = U·√S = (0, 1, 1)/√2 · (√2·m)^½ = (0, x, x), x = (m/√2)^½.
    e = data.ppmi_svd(["a b", "a c"], dim=1, window=1)
    m = np.log(1 + 2**0.25)
    x = np.sqrt(m / np.sqrt(2))
    assert e.words == ("a", "b", "c")
    np.testing.assert_allclose(e.vectors[:, 0], [0, x, x], atol=1e-5)


def test_python_m_qkv_data_writes_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "out"), "--sentences", "10", "--seed", "1"]) == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted([*data.FILES.values(), "sentiment.csv", "sentiment.jsonl"])
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert all(len(line) <= 80 for line in capsys.readouterr().out.splitlines())
    assert main([str(tmp_path / "bad"), "--sentences", "3"]) == 2
    assert "n must be an even whole number" in capsys.readouterr().err
