"""A vocabulary: tokens ↔ integer ids, for generated tasks and for models."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, init=False)
class Vocabulary:
    """Tokens and their ids: ``tokens[i]`` has id ``i``.

    Example:
        >>> v = Vocabulary(["a", "b", "0", "1"])
        >>> v.encode(["b", "1"])
        array([1, 3])
        >>> v.decode([1, 3])
        ['b', '1']
        >>> Vocabulary.from_texts(["not good", "good"]).tokens
        ('<pad>', '<unk>', 'good', 'not')
    """

    tokens: tuple[str, ...]
    index: Mapping[str, int] = field(repr=False)

    def __init__(self, tokens: Iterable[str]) -> None:
        tokens = tuple(tokens)
        index: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if not isinstance(token, str) or not token:
                raise TypeError(f"tokens[{i}] must be a non-empty str, got {token!r}.")
            if token in index:
                raise ValueError(
                    f"tokens[{i}] = {token!r} repeats tokens[{index[token]}]. "
                    "Hint: each token has one id; drop the repeats."
                )
            index[token] = i
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "index", MappingProxyType(index))

    @classmethod
    def from_texts(
        cls,
        texts: Iterable[str],
        *,
        specials: Sequence[str] = ("<pad>", "<unk>"),
        min_count: int = 1,
    ) -> Vocabulary:
        """The special tokens, then the words of ``texts`` (split on whitespace) seen at least
        ``min_count`` times, the most frequent first (ties in alphabetical order)."""
        counts = Counter(word for text in texts for word in text.split())
        words = sorted(
            (w for w, c in counts.items() if c >= min_count and w not in specials),
            key=lambda w: (-counts[w], w),
        )
        return cls([*specials, *words])

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self.index

    def __getitem__(self, i: int) -> str:
        return self.tokens[i]

    def encode(self, tokens: Iterable[str], *, unknown: str | None = None) -> IntArray:
        """The ids of ``tokens``, shape (N,); an unknown token is an error, or gets the id of
        ``unknown`` (e.g. ``"<unk>"``)."""
        fallback = None if unknown is None else self.index.get(unknown)
        if unknown is not None and fallback is None:
            raise KeyError(f"unknown={unknown!r} is not in the vocabulary itself.")
        ids = []
        for token in tokens:
            i = self.index.get(token, fallback)
            if i is None:
                raise KeyError(
                    f"{token!r} is not in the vocabulary of {len(self)} tokens. Hint: "
                    "encode(..., unknown='<unk>') maps unknown tokens to one id."
                )
            ids.append(i)
        return np.array(ids, dtype=np.int64)

    def decode(self, ids: Iterable[int] | npt.NDArray[np.integer]) -> list[str]:
        """The tokens of ``ids``."""
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if not 0 <= i < len(self.tokens):
                raise IndexError(f"id {i} is outside the vocabulary (ids 0..{len(self) - 1}).")
            out.append(self.tokens[i])
        return out
