"""Pretrained word vectors: read word2vec (text and binary), GloVe and fastText ``.vec`` files.

:func:`load` returns :class:`Embeddings`: the words and their (V, D) float32 matrix, with
lookups and a documented out-of-vocabulary policy (:meth:`Embeddings.lookup`). Large files
are read in blocks; ``limit=`` and ``vocabulary=`` keep only what is asked for. Every problem
in a file is an :class:`EmbeddingsFileError` naming the line (or byte offset) and a hint.
:func:`save` writes each format. NumPy only. See ``docs/embeddings.md``.

Shape legend: V words, D numbers per vector, N words looked up.

Example:
    >>> from qkv import data, embeddings
    >>> e = embeddings.load(data.embedding_file("word2vec"))
    >>> e  # doctest: +ELLIPSIS
    Embeddings(47 words × 16, format='word2vec', source='...sentiment.txt')
    >>> e.lookup("the food was superb".split()).shape
    (4, 16)
    >>> [w for w, _ in e.most_similar("good", n=3)]
    ['excellent', 'lovely', 'fine']
"""

from qkv.embeddings._errors import EmbeddingsFileError
from qkv.embeddings._load import detect_format, load
from qkv.embeddings._source import FORMATS
from qkv.embeddings._vectors import OOV_POLICIES, Embeddings, OOVPolicy, random_vector
from qkv.embeddings._write import save

__all__ = [
    "FORMATS",
    "OOV_POLICIES",
    "Embeddings",
    "EmbeddingsFileError",
    "OOVPolicy",
    "detect_format",
    "load",
    "random_vector",
    "save",
]
