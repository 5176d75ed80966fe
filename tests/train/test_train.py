"""qkv.train's pieces: reading labelled texts, splitting, the models, the embedding report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data import Vocabulary
from qkv.train import (
    AttentionClassifier,
    BagOfWords,
    DataError,
    RecallModel,
    RecallTask,
    build_model,
    embedding_drift,
    read_labelled,
    tokenize,
)
from qkv.train._tasks import PAD, UNK, ClassifyTask, encode_texts
from qkv.train._text import generated_texts, split_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- reading texts --------------------------------------------------------------------------


def test_tokenize_splits_words_and_punctuation() -> None:
    assert tokenize("The food was GREAT, not awful!") == [
        "the", "food", "was", "great", ",", "not", "awful", "!",
    ]  # fmt: skip
    assert tokenize("don't") == ["don't"]


def test_read_csv_and_jsonl_give_the_same_rows(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text('review,stars\n"good, long film",5\nbad,1\n', "utf-8")
    lines = [{"review": "good, long film", "stars": 5}, {"review": "bad", "stars": 1}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), "utf-8")
    csv_rows = read_labelled(tmp_path / "a.csv", text_column="review", label_column="stars")
    json_rows = read_labelled(tmp_path / "a.jsonl", text_column="review", label_column="stars")
    assert csv_rows.texts == json_rows.texts == ("good, long film", "bad")
    assert csv_rows.labels == json_rows.labels == ("5", "1")
    assert csv_rows.lines == (2, 3)
    assert csv_rows.fingerprint() == json_rows.fingerprint()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.csv", "txt,label\nhello,x\n", r"a\.csv: no column 'text' \(the columns are 'txt'"),
        (
            "a.csv",
            "text,lbl\nhello,x\n",
            r"no column 'label'.*Hint: name the right one with --label",
        ),
        ("a.csv", "text,label\nhello,x\n  ,y\n", r"a\.csv, line 3: the text \('text'\) is empty"),
        ("a.csv", "text,label\n!!!,\n", r"line 2: the label \('label'\) is empty"),
        ("a.csv", "text,label\n", r"a\.csv: the file has no rows"),
        ("a.csv", "", r"the file is empty"),
        ("a.csv", "text,label\nhi,x,extra\n", r"line 2: 3 fields, but the header has 2"),
        ("a.jsonl", '{"text": "hi", "label": "x"}\n{"text": "hi"\n', r"line 2: not valid JSON"),
        ("a.jsonl", '["hi", "x"]\n', r"line 1: expected a JSON object, got list"),
        ("a.jsonl", '{"text": "hi"}\n', r"line 1: no column 'label'"),
        ("a.txt", "hello\n", r"unknown file type '\.txt'.*Hint: give a \.csv"),
    ],
)
def test_bad_data_files_name_the_line_and_give_a_hint(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content, "utf-8")
    with pytest.raises(DataError, match=message) as caught:
        read_labelled(path)
    assert "Hint:" in str(caught.value)


def test_a_file_that_is_not_utf8_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_bytes(b"text,label\ncaf\xe9,x\n")
    with pytest.raises(DataError, match=r"line 2: the file is not UTF-8 text \(byte 0xe9\)"):
        read_labelled(path)


def test_group_column_keeps_twins_on_one_side(tmp_path: Path) -> None:
    made = generated_texts(40)
    path = tmp_path / "s.csv"
    from qkv.data import sentiment

    sentiment(40).to_csv(path)
    rows = read_labelled(path, group_column="pair")
    assert rows.groups == made.groups
    train, val = split_rows(len(rows), 0.25, seed=3, groups=rows.groups)
    assert rows.groups is not None
    assert not {rows.groups[i] for i in train} & {rows.groups[i] for i in val}
    assert sorted(train + val) == list(range(40))


def test_split_is_reproducible_and_refuses_an_empty_side() -> None:
    assert split_rows(50, 0.2, seed=1) == split_rows(50, 0.2, seed=1)
    assert split_rows(50, 0.2, seed=1) != split_rows(50, 0.2, seed=2)
    assert len(split_rows(50, 0.2, seed=1)[1]) == 10
    with pytest.raises(ValueError, match="leaves no rows for validation"):
        split_rows(2, 0.1, seed=0)


def test_unknown_label_names_its_line() -> None:
    texts = generated_texts(4)
    vocabulary = Vocabulary.from_texts(texts.texts, specials=(PAD, UNK))
    with pytest.raises(DataError, match=r"generated, line 2: the label 'negative' is not one"):
        encode_texts(texts, range(4), vocabulary, ["positive", "neutral"], lowercase=True,
                     max_length=8)  # fmt: skip


# -- tasks ----------------------------------------------------------------------------------


def test_recall_batches_depend_only_on_seed_and_step() -> None:
    task = RecallTask(pairs=3, batch_size=5, seed=4)
    again = RecallTask(pairs=3, batch_size=5, seed=4)
    assert torch.equal(task.train_batch(7).tokens, again.train_batch(7).tokens)
    assert not torch.equal(task.train_batch(7).tokens, task.train_batch(8).tokens)
    batch = task.train_batch(0)
    assert batch.tokens.shape == (5, 7)
    # the answer is the value that follows the queried key
    for row, target in zip(batch.tokens.tolist(), batch.targets.tolist(), strict=True):
        position = row[:-1:2].index(row[-1])
        assert row[2 * position + 1] - 26 == target


def test_classify_epochs_visit_every_row_once() -> None:
    texts = generated_texts(20)
    vocabulary = Vocabulary.from_texts(texts.texts, specials=(PAD, UNK))
    encoded = encode_texts(texts, range(20), vocabulary, ["negative", "positive"],
                           lowercase=True, max_length=64)  # fmt: skip
    task = ClassifyTask(encoded, encoded, labels=["negative", "positive"], batch_size=6, seed=0)
    assert task.steps_per_epoch == 4
    seen = [tuple(row) for step in range(4) for row in task.train_batch(step).tokens.tolist()]
    assert len(seen) == 20
    assert sorted(seen) == sorted(tuple(r) for r in encoded.batch(range(20)).tokens.tolist())


# -- models ---------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(st.permutations(list(range(6))))
def test_bag_of_words_ignores_order_attention_does_not(order: list[int]) -> None:
    torch.manual_seed(0)
    bag = BagOfWords(20, 2, embedding_dim=8)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    lengths = torch.tensor([6])
    shuffled = tokens[:, order]
    torch.testing.assert_close(bag(tokens, lengths), bag(shuffled, lengths))
    attention = AttentionClassifier(20, 2, embedding_dim=8, num_heads=2, dropout=0.0).eval()
    if order != sorted(order):
        assert not torch.allclose(attention(tokens, lengths), attention(shuffled, lengths))


@pytest.mark.parametrize(
    "model",
    [
        RecallModel(36, 10, d_model=16, num_heads=2),
        RecallModel(36, 10, d_model=16, num_heads=2, layers=2, next_token=False),
        AttentionClassifier(30, 3, embedding_dim=8, num_heads=2, dropout=0.0),
        BagOfWords(30, 3, embedding_dim=8),
    ],
)
def test_padding_changes_nothing(model: torch.nn.Module) -> None:
    model.eval()
    torch.manual_seed(1)
    tokens = torch.randint(1, 30, (1, 5))
    padded = torch.cat((tokens, torch.zeros(1, 3, dtype=torch.int64)), dim=1)
    lengths = torch.tensor([5])
    torch.testing.assert_close(model(tokens, lengths), model(padded, lengths))
    rebuilt = build_model(model.config())  # type: ignore[operator]
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt.eval()(tokens, lengths), model(tokens, lengths))


def test_build_model_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match=r"unknown model kind 'lstm'.*Hint"):
        build_model({"kind": "lstm", "vocab_size": 3, "num_classes": 2})


# -- the embedding report -------------------------------------------------------------------


def test_embedding_drift_numbers_by_hand() -> None:
    start = np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 4.0], [1.0, 0.0]])
    end = np.array([[0.0, 0.0], [9.0, 9.0], [3.0, 4.0], [0.0, 1.0]])
    report = embedding_drift(start, end, ["<pad>", "<unk>", "good", "bad"], top=2)
    assert report["words"] == 2 and not report["identical"]  # the specials are left out
    bad, good = report["moved_most"]
    assert bad["word"] == "bad" and bad["l2"] == pytest.approx(2**0.5)
    assert bad["cosine"] == 0.0 and bad["relative"] == pytest.approx(2**0.5)
    assert good == {"word": "good", "l2": 0.0, "cosine": 1.0, "relative": 0.0,
                    "pretrained": True}  # fmt: skip
    assert report["mean_l2"] == pytest.approx(2**0.5 / 2)
    assert embedding_drift(start, start.copy(), ["a", "b", "c", "d"])["identical"]
