"""Writing word vectors in each format, atomically (a temporary file, then a rename)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qkv._io import write_atomic
from qkv.embeddings._source import FORMATS
from qkv.embeddings._vectors import Embeddings

ROWS = 4096  # rows formatted at a time
NEAR_FLOAT32_MAX = 3.4e38  # rows with a larger number are written exactly, never rounded


def save(
    path: str | os.PathLike[str],
    embeddings: Embeddings,
    format: str = "word2vec",
    *,
    precision: int | None = None,
) -> Path:
    """Write word vectors to a file in one of the formats :func:`load` reads.

    - ``word2vec``: header ``V D``, then ``word x1 ... xD`` per line (as gensim writes it);
    - ``fasttext``: the same, each line ending in a space (as fastText writes ``.vec``);
    - ``glove``: no header, ``word x1 ... xD`` per line;
    - ``word2vec-binary``: header ``V D``, then per word the word, a space, D little-endian
      float32 numbers and a newline.

    A path ending in ``.gz`` is gzip-compressed (reproducibly: no time stamp). The file is
    written to a temporary file in the same folder and renamed: a failure leaves any old file
    as it was.

    Args:
        path: the file to write.
        embeddings: V words and their (V, D) vectors.
        format: one of :data:`FORMATS`.
        precision: significant digits of the numbers in the text formats; None (default)
            writes each float32 exactly, with the fewest digits that read back to it.

    Returns:
        The path written.

    Raises:
        ValueError: an unknown format, or a word the format cannot hold (empty, or with
            whitespace).

    Example:
        >>> import numpy as np, tempfile, pathlib
        >>> from qkv.embeddings import Embeddings, load
        >>> e = Embeddings(["cat", "dog"], np.array([[0.5, 1], [2, -0.25]]))
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "pets.txt"
        >>> print(save(path, e).read_text(), end="")
        2 2
        cat 0.5 1.0
        dog 2.0 -0.25
        >>> load(path).vectors.tolist()
        [[0.5, 1.0], [2.0, -0.25]]
    """
    if format not in FORMATS:
        raise ValueError(
            f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}. "
            "Hint: 'word2vec' is the most widely read text format."
        )
    if not isinstance(embeddings, Embeddings):
        raise TypeError(
            f"embeddings must be a qkv.embeddings.Embeddings, got {type(embeddings).__name__}. "
            "Hint: Embeddings(words, vectors) builds one from a list and a (V, D) array."
        )
    if precision is not None and (
        isinstance(precision, bool) or not isinstance(precision, int) or not 1 <= precision <= 9
    ):
        raise ValueError(
            f"precision must be a whole number of significant digits from 1 to 9, or None, "
            f"got {precision!r}. Hint: None writes every float32 exactly."
        )
    for i, word in enumerate(embeddings.words):
        if any(c in word for c in " \t\n\r\x0b\x0c"):
            raise ValueError(
                f"words[{i}] = {word!r} holds whitespace, which the {format} format uses to "
                "separate fields. Hint: replace it, e.g. word.replace(' ', '_')."
            )
    target = Path(path)
    chunks = (
        _binary(embeddings) if format == "word2vec-binary" else _text(embeddings, format, precision)
    )
    write_atomic(target, chunks, compress=target.name.endswith(".gz"))
    return target


def _text(embeddings: Embeddings, format: str, precision: int | None) -> Iterator[bytes]:
    count, dim = embeddings.vectors.shape
    if format != "glove":
        yield f"{count} {dim}\n".encode()
    end = " \n" if format == "fasttext" else "\n"
    row_format = " ".join([f"%.{precision}g"] * dim) if precision is not None else None
    for start in range(0, count, ROWS):
        block = embeddings.vectors[start : start + ROWS]
        words = embeddings.words[start : start + ROWS]
        exact = [" ".join(row) for row in block.astype(str).tolist()]  # shortest exact text
        if row_format is None:
            texts = exact
        else:  # rounding a number this close to the float32 limit could overflow to inf
            huge = np.abs(block).max(axis=1) > NEAR_FLOAT32_MAX
            texts = [
                exact[i] if huge[i] else row_format % tuple(row)
                for i, row in enumerate(block.tolist())
            ]
        yield "".join(f"{w} {t}{end}" for w, t in zip(words, texts, strict=True)).encode()


def _binary(embeddings: Embeddings) -> Iterator[bytes]:
    count, dim = embeddings.vectors.shape
    yield f"{count} {dim}\n".encode()
    little = embeddings.vectors.astype("<f4", copy=False)
    for start in range(0, count, ROWS):
        parts = []
        for i in range(start, min(start + ROWS, count)):
            parts += [embeddings.words[i].encode("utf-8"), b" ", little[i].tobytes(), b"\n"]
        yield b"".join(parts)
