"""Associative recall: key–value pairs, then a query key; the answer is the key's value.

``a 3 c 5 b 1 c`` → ``5``. The classic task that attention solves and a bag of tokens cannot:
the answer depends on which value stands next to the queried key.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

from qkv.data._vocabulary import IntArray, Vocabulary


@dataclass(frozen=True)
class RecallSet:
    """N associative-recall sequences of P key–value pairs each.

    All ids are token ids of ``vocabulary``: keys first (ids 0..n_keys−1), then values.

    Attributes:
        keys: (N, P) the keys of each sequence, all different within a sequence.
        values: (N, P) ``values[n, p]`` is the value of ``keys[n, p]``.
        queries: (N,) the key asked for, one of the sequence's keys.
        targets: (N,) the answer: the value of the queried key.
        answer_pairs: (N,) p such that ``keys[n, p] == queries[n]``.
        vocabulary: keys (``a``..``z`` when at most 26) then values (``0``..``9`` when at
            most 10).
        n_keys: how many key tokens the vocabulary has.
        n_values: how many value tokens.

    Example:
        >>> s = recall(2, pairs=3, seed=0)
        >>> s.texts()
        ['l 7 d 8 u 0 d', 'w 0 g 6 u 3 w']
        >>> s.vocabulary.decode(s.targets)
        ['8', '0']
        >>> s.tokens.shape  # (N, 2·P + 1): k1 v1 k2 v2 k3 v3 query
        (2, 7)
    """

    keys: IntArray
    values: IntArray
    queries: IntArray
    targets: IntArray
    answer_pairs: IntArray
    vocabulary: Vocabulary
    n_keys: int
    n_values: int

    def __len__(self) -> int:
        return int(self.queries.shape[0])

    @property
    def tokens(self) -> IntArray:
        """(N, 2·P + 1): the flat sequences ``k1 v1 k2 v2 ... kP vP query``."""
        n, p = self.keys.shape
        out = np.empty((n, 2 * p + 1), dtype=np.int64)
        out[:, 0 : 2 * p : 2] = self.keys
        out[:, 1 : 2 * p : 2] = self.values
        out[:, -1] = self.queries
        return out

    def texts(self) -> list[str]:
        """Each sequence as text, tokens separated by spaces."""
        return [" ".join(self.vocabulary.decode(row)) for row in self.tokens]


def recall(n: int, *, pairs: int = 4, keys: int = 26, values: int = 10, seed: int = 0) -> RecallSet:
    """Generate ``n`` associative-recall sequences, the same for the same arguments.

    Each sequence draws ``pairs`` different keys uniformly from ``keys`` key tokens, a value
    for each uniformly (with repeats) from ``values`` value tokens, and queries one of its keys
    uniformly. NumPy's PCG64 generator seeded with ``seed`` makes it reproducible on every
    machine.

    Args:
        n: how many sequences (N).
        pairs: key–value pairs per sequence (P); at most ``keys``.
        keys: key tokens in the vocabulary (26 gives ``a``..``z``).
        values: value tokens (10 gives ``0``..``9``).
        seed: the random seed.

    Raises:
        ValueError: a count is not a positive whole number, or ``pairs > keys``.
    """
    for name, value, hint in (
        ("n", n, "n=10000 sequences"),
        ("pairs", pairs, "pairs=4 gives sequences like 'a 3 c 5 b 1 d 7 c'"),
        ("keys", keys, "keys=26 gives the keys a..z"),
        ("values", values, "values=10 gives the values 0..9"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name} must be a positive whole number, got {value!r}. Hint: {hint}."
            )
    if pairs > keys:
        raise ValueError(
            f"pairs = {pairs} needs as many different keys, but keys = {keys}. "
            f"Hint: keys of a sequence are all different; use keys >= {pairs}."
        )
    rng = np.random.default_rng(seed)
    key_ids = rng.random((n, keys)).argsort(axis=1)[:, :pairs].astype(np.int64)
    value_ids = rng.integers(keys, keys + values, size=(n, pairs), dtype=np.int64)
    answer = rng.integers(0, pairs, size=n, dtype=np.int64)
    rows = np.arange(n)
    return RecallSet(
        keys=key_ids,
        values=value_ids,
        queries=key_ids[rows, answer],
        targets=value_ids[rows, answer],
        answer_pairs=answer,
        vocabulary=Vocabulary(
            [*_names(keys, string.ascii_lowercase, "k"), *_names(values, string.digits, "v")]
        ),
        n_keys=keys,
        n_values=values,
    )


def _names(count: int, letters: str, prefix: str) -> list[str]:
    if count <= len(letters):
        return list(letters[:count])
    return [f"{prefix}{i}" for i in range(count)]
