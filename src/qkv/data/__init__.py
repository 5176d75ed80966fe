"""Data the project generates: nothing is downloaded, everything is the same for a seed.

- :func:`recall`: associative recall, ``a 3 c 5 b 1 c`` → ``5``.
- :func:`sentiment`: a small sentiment set whose labels depend on word order and negation;
  every sentence has a twin with the same words and the opposite label, so a bag of words
  is right on at most half (:func:`bag_of_words_ceiling`). Writes CSV and JSON Lines.
- :func:`embedding_file`: small word-vector files built from that corpus (PPMI + SVD), one
  per format, shipped with the package; :func:`write_embedding_files` regenerates them.

``python -m qkv.data DIR`` writes the sets and the vector files into a folder.
NumPy only. See ``docs/embeddings.md``.

Example:
    >>> from qkv import data
    >>> s = data.sentiment(4)
    >>> s.texts[0], s.labels[0]
    ('the staff was fine at first and bad in the end', 'negative')
    >>> data.recall(1, pairs=2, seed=3).texts()
    ['u 2 a 4 u']
"""

from qkv.data._recall import RecallSet, recall
from qkv.data._sentiment import (
    LABELS,
    NEGATIVE,
    NOUNS,
    POSITIVE,
    RULES,
    TextSet,
    bag_of_words_ceiling,
    sentiment,
)
from qkv.data._vectors import (
    FILES,
    embedding_corpus,
    embedding_file,
    ppmi_svd,
    sentiment_embeddings,
    write_embedding_files,
)
from qkv.data._vocabulary import Vocabulary

__all__ = [
    "FILES",
    "LABELS",
    "NEGATIVE",
    "NOUNS",
    "POSITIVE",
    "RULES",
    "RecallSet",
    "TextSet",
    "Vocabulary",
    "bag_of_words_ceiling",
    "embedding_corpus",
    "embedding_file",
    "ppmi_svd",
    "recall",
    "sentiment",
    "sentiment_embeddings",
    "write_embedding_files",
]
