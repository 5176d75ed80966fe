"""``load``: read a word-vector file in any format, streaming with a limit or a vocabulary."""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable
from pathlib import Path

from qkv.embeddings._binary import BinaryReader
from qkv.embeddings._source import FORMATS, data_size, detect, open_file
from qkv.embeddings._text import TextReader
from qkv.embeddings._vectors import Embeddings

UNICODE_ERRORS = ("strict", "replace", "ignore")
DUPLICATES = ("error", "first")


def load(
    path: str | os.PathLike[str],
    format: str = "auto",
    *,
    limit: int | None = None,
    vocabulary: Iterable[str] | None = None,
    encoding: str = "utf-8",
    unicode_errors: str = "strict",
    duplicates: str = "error",
) -> Embeddings:
    """Read pretrained word vectors: word2vec (text or binary), GloVe or fastText ``.vec``.

    The file is read in blocks. With ``limit`` or ``vocabulary``, only the vectors asked for
    are kept in memory, and reading stops as soon as they are all found; lines that are
    skipped are not checked. Files ending in ``.gz`` (gzip) are read as they are.

    Args:
        path: the file.
        format: ``"auto"`` (default: a first line ``COUNT DIM`` is a header; then the bytes of
            the first vector tell text from binary; no header means GloVe), or one of
            ``"word2vec"``, ``"word2vec-binary"``, ``"glove"``, ``"fasttext"``.
        limit: read only the first ``limit`` vectors of the file (files usually list the most
            frequent words first). With ``vocabulary``, the wanted words among them.
        vocabulary: keep only these words (compared exactly, case included); the others are
            skipped without being converted. The result keeps the file's order; a word not
            in the file is simply absent (see :meth:`Embeddings.missing`).
        encoding: the text encoding of the words.
        unicode_errors: ``"strict"`` (default: a word that is not valid text in ``encoding``
            is an error with its line), ``"replace"`` or ``"ignore"``.
        duplicates: ``"error"`` (default) or ``"first"`` (keep the first vector of a word that
            appears twice).

    Returns:
        The words, in file order, and their (V, D) float32 vectors.

    Raises:
        EmbeddingsFileError: the file is not a valid word-vector file; the message names the
            line (text) or byte offset (binary), the problem and a hint.
        OSError: the file cannot be opened.
        ValueError, TypeError: an option is wrong.

    Example:
        >>> from qkv import data
        >>> from qkv.embeddings import load
        >>> e = load(data.embedding_file("glove"), vocabulary=["good", "great", "bad", "emu"])
        >>> e.words, e.vectors.shape, e.format
        (('good', 'great', 'bad'), (3, 16), 'glove')
        >>> e.missing(["good", "emu"])
        ['emu']
    """
    formats = ("auto", *FORMATS)
    if format not in formats:
        raise ValueError(
            f"format must be one of {', '.join(map(repr, formats))}, got {format!r}. Hint: "
            "'auto' tells the format from the file; a .vec file is 'fasttext'."
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"limit must be a positive whole number or None, got {limit!r}. "
            "Hint: limit=50000 reads the first 50,000 vectors."
        )
    wanted = _vocabulary(vocabulary)
    if unicode_errors not in UNICODE_ERRORS:
        raise ValueError(
            f"unicode_errors must be one of {', '.join(map(repr, UNICODE_ERRORS))}, got "
            f"{unicode_errors!r}."
        )
    if duplicates not in DUPLICATES:
        raise ValueError(
            f"duplicates must be one of {', '.join(map(repr, DUPLICATES))}, got {duplicates!r}."
        )
    codecs.lookup(encoding)  # an unknown encoding fails here, with Python's LookupError
    file = Path(path)
    source = os.fspath(path)
    chosen = detect(file, source, encoding=encoding).format if format == "auto" else format
    size = data_size(file, source)  # bounds what a header may claim: nothing huge is allocated
    with open_file(file, source) as handle:
        if chosen == "word2vec-binary":
            words, vectors = BinaryReader(
                handle,
                source=source,
                encoding=encoding,
                unicode_errors=unicode_errors,
                duplicates=duplicates,
                limit=limit,
                wanted=wanted,
                size_hint=size,
            ).read()
        else:
            text = TextReader(
                source,
                encoding=encoding,
                unicode_errors=unicode_errors,
                duplicates=duplicates,
                limit=limit,
                wanted=wanted,
                size_hint=size,
            )
            words, vectors = text.read(handle, header=chosen != "glove", auto=format == "auto")
    return Embeddings(words, vectors, format=chosen, source=source)


def detect_format(path: str | os.PathLike[str], *, encoding: str = "utf-8") -> str:
    """The format :func:`load` with ``format="auto"`` reads a file as.

    Example:
        >>> from qkv import data
        >>> from qkv.embeddings import detect_format
        >>> [detect_format(data.embedding_file(f)) for f in ("word2vec", "word2vec-binary")]
        ['word2vec', 'word2vec-binary']
    """
    return detect(Path(path), os.fspath(path), encoding=encoding).format


def _vocabulary(vocabulary: Iterable[str] | None) -> frozenset[str] | None:
    if vocabulary is None:
        return None
    if isinstance(vocabulary, str | bytes):
        raise TypeError(
            f"vocabulary must be a collection of words, got a {type(vocabulary).__name__} "
            f"({vocabulary!r:.40}). Hint: vocabulary=['cat', 'dog'], or text.split()."
        )
    words = frozenset(vocabulary)
    bad = [w for w in words if not isinstance(w, str)]
    if bad:
        raise TypeError(f"vocabulary must hold strings, got {bad[0]!r} ({type(bad[0]).__name__}).")
    return words
