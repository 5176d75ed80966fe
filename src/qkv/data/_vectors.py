"""Small word-vector files built from the project's own corpus, shipped in each format.

The vectors are made with a classic count method, in NumPy: co-occurrence counts in a window
of ±3 words, positive pointwise mutual information (PPMI, context counts raised to 0.75),
then a truncated SVD, ``W = U_D · √S_D`` (Levy, Goldberg & Dagan 2015). The corpus is the
sentiment set (:func:`qkv.data.sentiment`) plus background sentences that tie each adjective
to a feeling (``it was great and i loved it``), so the vectors know which adjectives are
positive, as real pretrained vectors roughly do.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from qkv.data._sentiment import NEGATIVE, NOUNS, POSITIVE, sentiment
from qkv.embeddings import Embeddings, save

FILES = {
    "word2vec": "sentiment.txt",
    "word2vec-binary": "sentiment.bin",
    "glove": "sentiment.glove.txt",
    "fasttext": "sentiment.vec",
}
"""The shipped file of each format, in ``qkv/data/files``."""

DIM = 16
BACKGROUND = {
    POSITIVE: (
        "it was {a} and i loved it",
        "the {n} was {a} and i was happy",
        "a {a} {n} , i smiled",
    ),
    NEGATIVE: (
        "it was {a} and i hated it",
        "the {n} was {a} and i was sad",
        "a {a} {n} , i frowned",
    ),
}


def embedding_file(format: str = "word2vec") -> Path:
    """The shipped word-vector file of ``format`` (47 words × 16, built by
    :func:`sentiment_embeddings`).

    Example:
        >>> embedding_file("fasttext").name
        'sentiment.vec'
    """
    if format not in FILES:
        raise ValueError(f"format must be one of {', '.join(map(repr, FILES))}, got {format!r}.")
    return Path(str(resources.files("qkv.data").joinpath("files", FILES[format])))


def embedding_corpus(seed: int = 0) -> list[str]:
    """The sentences the shipped vectors are built from: 2000 of :func:`sentiment` and 2000
    background sentences."""
    rng = np.random.default_rng([seed, 1])
    background = []
    for _ in range(2000):
        adjectives = (POSITIVE, NEGATIVE)[int(rng.integers(2))]
        templates = BACKGROUND[adjectives]
        template = templates[int(rng.integers(len(templates)))]
        background.append(
            template.format(
                a=adjectives[int(rng.integers(len(adjectives)))],
                n=NOUNS[int(rng.integers(len(NOUNS)))],
            )
        )
    return [*sentiment(2000, seed=seed).texts, *background]


def ppmi_svd(
    texts: Sequence[str], *, dim: int = DIM, window: int = 3, alpha: float = 0.75
) -> Embeddings:
    """Word vectors from co-occurrence counts: PPMI, then a truncated SVD.

    Words are split on whitespace and ordered by frequency (most frequent first, ties
    alphabetical). Each column's sign is fixed so its largest entry is positive, and the
    numbers are rounded to 5 decimals, so every format stores exactly the same float32s.

    Args:
        texts: the corpus, one sentence per item.
        dim: D, the length of each vector (at most the vocabulary size).
        window: words at most this far apart co-occur.
        alpha: the exponent that smooths context counts (0.75 as in word2vec).

    Example:
        >>> e = ppmi_svd(["a b c", "a b d", "c d"], dim=2)
        >>> e.words, e.vectors.shape
        (('a', 'b', 'c', 'd'), (4, 2))
    """
    counts = Counter(word for text in texts for word in text.split())
    words = sorted(counts, key=lambda w: (-counts[w], w))
    if not 1 <= dim <= len(words):
        raise ValueError(f"dim must be from 1 to the vocabulary size {len(words)}, got {dim}.")
    index = {w: i for i, w in enumerate(words)}
    pairs = np.zeros((len(words), len(words)), dtype=np.float64)
    for text in texts:
        ids = np.array([index[w] for w in text.split()], dtype=np.int64)
        for offset in range(1, window + 1):
            np.add.at(pairs, (ids[:-offset], ids[offset:]), 1.0)
            np.add.at(pairs, (ids[offset:], ids[:-offset]), 1.0)
    context = pairs.sum(axis=0) ** alpha
    p_word = pairs.sum(axis=1) / pairs.sum()
    p_context = context / context.sum()
    with np.errstate(divide="ignore"):
        pmi = np.log(pairs / pairs.sum()) - np.log(np.outer(p_word, p_context))
    ppmi = np.where(pairs > 0, np.maximum(pmi, 0.0), 0.0)
    u, s, _ = np.linalg.svd(ppmi)
    vectors = u[:, :dim] * np.sqrt(s[:dim])
    largest = np.abs(vectors).argmax(axis=0)
    vectors *= np.sign(vectors[largest, np.arange(dim)])
    return Embeddings(words, np.round(vectors, 5).astype(np.float32))


def sentiment_embeddings(seed: int = 0) -> Embeddings:
    """The vectors of the shipped files: :func:`ppmi_svd` of :func:`embedding_corpus`."""
    return ppmi_svd(embedding_corpus(seed))


def write_embedding_files(folder: str | os.PathLike[str], *, seed: int = 0) -> dict[str, Path]:
    """Write :func:`sentiment_embeddings` in each format into ``folder``; returns the paths.

    ``write_embedding_files("src/qkv/data/files")`` regenerates the shipped files.
    """
    vectors = sentiment_embeddings(seed)
    return {fmt: save(Path(folder) / name, vectors, fmt) for fmt, name in FILES.items()}
