"""Labelled texts for classification: read CSV / JSON Lines files, split words, split sets.

A file is read whole (training sets are small next to word-vector files); every problem is a
:class:`DataError` that names the file, the line and a hint. NumPy only.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkv._format import visible
from qkv._read import FileLimitError, json_lines, json_value, read_bytes

__all__ = [
    "GENERATED",
    "DataError",
    "LabelledTexts",
    "generated_texts",
    "read_labelled",
    "split_rows",
    "tokenize",
]

GENERATED = "generated"
"""The ``--data`` value that means the sentiment set qkv generates (:func:`qkv.data.sentiment`)."""

SUFFIXES = {".csv": ",", ".tsv": "\t", ".jsonl": None, ".ndjson": None}
MAX_DATA_BYTES = 1 << 30
"""The largest data file :func:`read_labelled` reads (1 GiB); it is read into memory whole."""

_WORD = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")


class DataError(ValueError):
    """A data file that cannot be used: ``"FILE, line N: problem. Hint: ..."``.

    Example:
        >>> str(DataError("the text is empty", source="a.csv", line=4, hint="fill it in"))
        'a.csv, line 4: the text is empty. Hint: fill it in'
    """

    def __init__(
        self, problem: str, *, source: str, line: int | None = None, hint: str | None = None
    ) -> None:
        self.problem, self.source, self.line, self.hint = problem, source, line, hint
        where = source if line is None else f"{source}, line {line}"
        text = f"{where}: {problem}"
        if hint:
            text = f"{text.rstrip('.')}. Hint: {hint}"
        super().__init__(visible(text))  # a label or column name from the file, escaped


def tokenize(text: str, *, lowercase: bool = True) -> list[str]:
    """Split a text into words and punctuation marks (lower case by default).

    A word is a run of letters, digits and underscores, with inner apostrophes (``don't``);
    every other visible character is a token of its own.

    Example:
        >>> tokenize("The food was great, not awful!")
        ['the', 'food', 'was', 'great', ',', 'not', 'awful', '!']
        >>> tokenize("It isn't BAD", lowercase=False)
        ['It', "isn't", 'BAD']
    """
    return _WORD.findall(text.lower() if lowercase else text)


@dataclass(frozen=True)
class LabelledTexts:
    """Texts and their labels, as read from a file (or generated).

    Attributes:
        texts: the N texts.
        labels: the N labels, as strings (a JSON number 1 becomes ``"1"``).
        lines: the line of the file each row ends on (for error messages).
        source: the file, or ``"generated"``.
        groups: rows that must stay on the same side of a split (the twin sentences of the
            generated set share a group), or None.
    """

    texts: tuple[str, ...]
    labels: tuple[str, ...]
    lines: tuple[int, ...]
    source: str
    groups: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """SHA-256 of the texts and labels: a resumed run checks that its data did not change.

        Example:
            >>> a = LabelledTexts(("a b",), ("x",), (2,), "f.csv")
            >>> a.fingerprint() == LabelledTexts(("a b",), ("x",), (9,), "g.csv").fingerprint()
            True
        """
        digest = hashlib.sha256()
        for text, label in zip(self.texts, self.labels, strict=True):
            digest.update(json.dumps([text, label], ensure_ascii=False).encode("utf-8"))
            digest.update(b"\n")
        return digest.hexdigest()


def generated_texts(n: int = 2000, *, seed: int = 0) -> LabelledTexts:
    """The sentiment set of :func:`qkv.data.sentiment`, whose labels depend on word order.

    Example:
        >>> s = generated_texts(4)
        >>> s.source, s.labels, s.groups
        ('generated', ('negative', 'positive', 'negative', 'positive'), (0, 0, 1, 1))
    """
    from qkv.data import sentiment

    made = sentiment(n, seed=seed)
    return LabelledTexts(
        texts=made.texts,
        labels=made.labels,
        lines=tuple(range(2, len(made) + 2)),
        source=GENERATED,
        groups=made.pairs,
    )


def read_labelled(
    path: str | os.PathLike[str],
    *,
    text_column: str = "text",
    label_column: str = "label",
    group_column: str | None = None,
    require_labels: bool = True,
) -> LabelledTexts:
    """Read texts and labels from a CSV (``.csv``), TSV (``.tsv``) or JSON Lines file.

    CSV and TSV files start with a header line naming the columns; a JSON Lines file
    (``.jsonl``, ``.ndjson``) holds one object per line. Other columns are ignored.

    Args:
        path: the file (UTF-8, a byte-order mark is skipped).
        text_column: the column (or key) of the texts.
        label_column: the column of the labels.
        group_column: a column whose rows with the same value stay together when the set is
            split (:func:`split_rows`), e.g. the ``pair`` of the generated set's twins.
        require_labels: an empty label is an error (else it is kept as ``""``).

    Raises:
        DataError: the file type is unknown, a column is missing, a text or label is empty,
            a JSON line is not an object, the file is not UTF-8 or has no rows; the message
            names the line.
        OSError: the file cannot be opened.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "reviews.csv"
        >>> _ = path.write_text("text,label\\ngood film,pos\\n\\"dull, long\\",neg\\n")
        >>> rows = read_labelled(path)
        >>> rows.texts, rows.labels, rows.lines
        (('good film', 'dull, long'), ('pos', 'neg'), (2, 3))
    """
    file = Path(path)
    source = os.fspath(path)
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(
            f"unknown file type {file.suffix or '(none)'!r}",
            source=source,
            hint="give a .csv, .tsv or .jsonl file (JSON Lines: one object per line)",
        )
    try:  # bounded: /dev/zero or a 100 GB file is refused at once (qkv._read)
        raw = read_bytes(file, limit=MAX_DATA_BYTES, what="a data file")
    except FileLimitError as error:
        raise DataError(error.problem, source=source, hint=error.hint) from None
    try:
        content = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise DataError(
            f"the file is not UTF-8 text (byte 0x{raw[error.start]:02x})",
            source=source,
            line=line,
            hint="save it as UTF-8",
        ) from None
    delimiter = SUFFIXES[suffix]
    columns = (text_column, label_column) + (() if group_column is None else (group_column,))
    if delimiter is None:
        rows = _jsonl_rows(content, source, columns)
    else:
        rows = _csv_rows(content, source, delimiter, columns)
    texts, labels, lines, groups = [], [], [], []
    group_ids: dict[str, int] = {}
    for line, row in rows:
        text, label = row[text_column], row[label_column]
        if not tokenize(text):
            raise DataError(
                f"the text ({text_column!r}) is empty",
                source=source,
                line=line,
                hint="every row needs a text with at least one word; remove or fill in the row",
            )
        if require_labels and not label.strip():
            raise DataError(
                f"the label ({label_column!r}) is empty",
                source=source,
                line=line,
                hint="every row needs a label; remove or fill in the row",
            )
        texts.append(text)
        labels.append(label.strip())
        lines.append(line)
        if group_column is not None:
            groups.append(group_ids.setdefault(row[group_column], len(group_ids)))
    if not texts:
        raise DataError(
            "the file has no rows",
            source=source,
            hint=f"write one row per example with a {text_column!r} and a {label_column!r}",
        )
    return LabelledTexts(
        tuple(texts),
        tuple(labels),
        tuple(lines),
        source,
        groups=tuple(groups) if group_column is not None else None,
    )


def _csv_rows(
    content: str, source: str, delimiter: str, columns: tuple[str, ...]
) -> list[tuple[int, dict[str, str]]]:
    reader = csv.reader(io.StringIO(content, newline=""), delimiter=delimiter)
    try:
        header = next(reader)
    except StopIteration:
        raise DataError(
            "the file is empty",
            source=source,
            hint=f"the first line names the columns, e.g. {delimiter.join(columns[:2])}",
        ) from None
    except csv.Error as error:
        raise DataError(f"not valid CSV: {error}", source=source, line=1) from None
    header = [name.strip() for name in header]
    _check_columns(header, columns, source)
    where = {name: header.index(name) for name in columns}
    rows = []
    try:
        for record in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in record):
                continue  # a blank line
            if len(record) != len(header):
                raise DataError(
                    f"{len(record)} fields, but the header has {len(header)}",
                    source=source,
                    line=line,
                    hint="a text with a comma (or a tab in a .tsv) must be in double quotes",
                )
            rows.append((line, {name: record[i] for name, i in where.items()}))
    except csv.Error as error:
        raise DataError(
            f"not valid CSV: {error}",
            source=source,
            line=reader.line_num,
            hint='a quote inside a quoted text is written twice ("")',
        ) from None
    return rows


def _jsonl_rows(
    content: str, source: str, columns: tuple[str, ...]
) -> list[tuple[int, dict[str, str]]]:
    rows = []
    for line, text in json_lines(content):  # U+2028 inside a string is no line break
        if not text.strip():
            continue
        try:
            item = json_value(text)
        except FileLimitError as error:
            raise DataError(error.problem, source=source, line=line, hint=error.hint) from None
        except json.JSONDecodeError as error:
            raise DataError(
                f"not valid JSON ({error.msg}, column {error.colno})",
                source=source,
                line=line,
                hint="JSON Lines holds one object per line, e.g. "
                '{"text": "good film", "label": "pos"}',
            ) from None
        if not isinstance(item, dict):
            raise DataError(
                f"expected a JSON object, got {type(item).__name__}",
                source=source,
                line=line,
                hint='each line is an object, e.g. {"text": "good film", "label": "pos"}',
            )
        _check_columns(list(item), columns, source, line=line)
        row = {}
        for name in columns:
            value = item[name]
            if isinstance(value, dict | list):
                raise DataError(
                    f"{name!r} is a JSON {type(value).__name__}, expected a string",
                    source=source,
                    line=line,
                )
            row[name] = "" if value is None else str(value)
        rows.append((line, row))
    return rows


def _check_columns(
    present: Sequence[str], columns: tuple[str, ...], source: str, line: int | None = None
) -> None:
    options = ("--text-column", "--label-column", "--group-column")
    for name, option in zip(columns, options[: len(columns)], strict=True):
        if name not in present:
            shown = ", ".join(repr(p) for p in present) or "none"
            raise DataError(
                f"no column {name!r} (the columns are {shown})",
                source=source,
                line=line,
                hint=f"name the right one with {option}",
            )


def split_rows(
    n: int, validation: float, *, seed: int, groups: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """The rows for training and for validation: a random ``validation`` share of the rows
    (of the groups, when given: a group stays on one side), the same for the same seed.

    Raises:
        ValueError: ``validation`` is not between 0 and 1, or leaves a side empty.

    Example:
        >>> split_rows(10, 0.2, seed=0)
        ([0, 1, 2, 4, 5, 6, 8, 9], [3, 7])
        >>> split_rows(4, 0.5, seed=0, groups=[0, 0, 1, 1])
        ([2, 3], [0, 1])
    """
    if not 0.0 < validation < 1.0:
        raise ValueError(
            f"--validation must be a fraction between 0 and 1, got {validation!r}. "
            "Hint: 0.2 keeps a fifth of the rows to measure accuracy on."
        )
    keys = list(range(n)) if groups is None else list(groups)
    ids = sorted(set(keys))
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7]))
    order = rng.permutation(len(ids))
    count = round(validation * len(ids))
    if count < 1 or count >= len(ids):
        raise ValueError(
            f"--validation {validation} of {len(ids)} rows leaves no rows for "
            f"{'validation' if count < 1 else 'training'}. Hint: use more data, or another "
            "--validation fraction."
        )
    chosen = {ids[i] for i in order[:count]}
    train = [i for i, key in enumerate(keys) if key not in chosen]
    val = [i for i, key in enumerate(keys) if key in chosen]
    return train, val
