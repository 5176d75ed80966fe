"""Embeddings: a vocabulary and its (V, D) matrix, with lookups and the out-of-vocabulary policy.

Shape legend: V words in the vocabulary, D numbers per word vector, N words looked up.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import numpy as np
import numpy.typing as npt

OOVPolicy = Literal["error", "zero", "random"]
OOV_POLICIES: tuple[str, ...] = ("error", "zero", "random")
"""What :meth:`Embeddings.lookup` does with a word that has no vector."""

FloatMatrix = npt.NDArray[np.float32]


@dataclass(frozen=True, eq=False, init=False, repr=False)
class Embeddings:
    """Word vectors: ``words[i]`` has the vector ``vectors[i]``.

    Attributes:
        words: the V words, in file order, each once.
        vectors: (V, D) float32, read-only.
        format: the file format they were read from (``"word2vec"``, ``"word2vec-binary"``,
            ``"glove"``, ``"fasttext"``), or ``"memory"`` when built from arrays.
        source: the file they were read from, or None.
        index: word → row of ``vectors``.

    Out-of-vocabulary policy (:meth:`lookup`): a word without a vector is an error by default
    (``oov="error"``, naming the missing words); ``oov="zero"`` gives it a zero vector;
    ``oov="random"`` gives it a random vector drawn from N(0, σ²), σ the standard deviation of
    all numbers in ``vectors``, seeded by the word itself (and ``seed``): the same word always
    gets the same vector, whatever else is looked up, on every run and machine.

    Example:
        >>> import numpy as np
        >>> e = Embeddings(["cat", "dog"], np.array([[1.0, 0.0], [0.0, 2.0]]))
        >>> e
        Embeddings(2 words × 2, format='memory')
        >>> e["dog"]
        array([0., 2.], dtype=float32)
        >>> e.lookup(["dog", "cat", "emu"], oov="zero")
        array([[0., 2.],
               [1., 0.],
               [0., 0.]], dtype=float32)
        >>> e.missing(["dog", "emu", "yak", "emu"])
        ['emu', 'yak']
    """

    words: tuple[str, ...]
    vectors: FloatMatrix
    format: str = "memory"
    source: str | None = None
    index: Mapping[str, int] = field(init=False)

    def __init__(
        self,
        words: Sequence[str],
        vectors: npt.ArrayLike,
        *,
        format: str = "memory",
        source: str | None = None,
    ) -> None:
        words = tuple(words)
        matrix = _as_matrix(vectors, len(words))
        index: dict[str, int] = {}
        for i, word in enumerate(words):
            if not isinstance(word, str) or not word:
                raise TypeError(
                    f"words[{i}] must be a non-empty str, got {word!r}. "
                    "Hint: words are the tokens the vectors belong to."
                )
            if word in index:
                raise ValueError(
                    f"words[{i}] = {word!r} repeats words[{index[word]}]: each word has one "
                    "vector. Hint: drop the repeated words (and their rows) first."
                )
            index[word] = i
        object.__setattr__(self, "words", words)
        object.__setattr__(self, "vectors", matrix)
        object.__setattr__(self, "format", format)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "index", MappingProxyType(index))

    @property
    def dim(self) -> int:
        """D, the numbers per word vector."""
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: object) -> bool:
        return word in self.index

    def __repr__(self) -> str:
        where = f", source={self.source!r}" if self.source else ""
        return f"Embeddings({len(self)} words × {self.dim}, format={self.format!r}{where})"

    def __getitem__(self, word: str) -> FloatMatrix:
        """The vector of one word, shape (D,); KeyError with close matches if it has none."""
        row = self.index.get(word)
        if row is None:
            raise KeyError(self._missing_message([word]))
        vector: FloatMatrix = self.vectors[row]
        return vector

    def missing(self, words: Iterable[str]) -> list[str]:
        """The words that have no vector, each once, in the order given."""
        seen: set[str] = set()
        out = []
        for word in words:
            if word not in self.index and word not in seen:
                seen.add(word)
                out.append(word)
        return out

    def lookup(
        self, words: Iterable[str], *, oov: OOVPolicy = "error", seed: int = 0
    ) -> FloatMatrix:
        """The vectors of ``words``, in order: shape (N, D), float32, a new array.

        Args:
            words: the N words (tokens) to look up, e.g. a sentence or a model's vocabulary.
            oov: what a word without a vector gets: ``"error"`` (raise, naming the missing
                words), ``"zero"`` (a zero vector) or ``"random"`` (a random vector from
                N(0, σ²), σ the standard deviation of all numbers in ``vectors``, seeded by the
                word and ``seed``, so a word always gets the same vector).
            seed: mixes into the random vectors of ``oov="random"``.

        Raises:
            KeyError: ``oov="error"`` and some words have no vector.
            ValueError: ``oov`` is not one of the three policies.

        Example:
            >>> import numpy as np
            >>> e = Embeddings(["cat"], np.ones((1, 3)))
            >>> a = e.lookup(["emu", "cat"], oov="random")
            >>> bool((a[0] == e.lookup(["emu"], oov="random")[0]).all())
            True
        """
        if oov not in OOV_POLICIES:
            raise ValueError(
                f"oov must be one of {', '.join(map(repr, OOV_POLICIES))}, got {oov!r}. "
                "Hint: oov='random' gives each unknown word its own fixed random vector."
            )
        words = list(words)
        bad = [w for w in words if not isinstance(w, str)]
        if bad:
            raise TypeError(
                f"words must be strings, got {bad[0]!r} ({type(bad[0]).__name__}). "
                "Hint: split a sentence into words first, e.g. text.split()."
            )
        rows = np.array([self.index.get(w, -1) for w in words], dtype=np.int64)
        out = np.zeros((len(words), self.dim), dtype=np.float32)
        known = rows >= 0
        out[known] = self.vectors[rows[known]]
        if known.all():
            return out
        if oov == "error":
            raise KeyError(self._missing_message(self.missing(words)))
        if oov == "random":
            scale = self._scale()
            for i in np.flatnonzero(~known):
                out[i] = random_vector(words[i], self.dim, scale=scale, seed=seed)
        return out

    def most_similar(self, word: str, n: int = 5) -> list[tuple[str, float]]:
        """The ``n`` words whose vectors have the largest cosine similarity with ``word``'s.

        Example:
            >>> import numpy as np
            >>> e = Embeddings(["a", "b", "c"], np.array([[1.0, 0], [0.9, 0.1], [0, 1.0]]))
            >>> [(w, round(s, 3)) for w, s in e.most_similar("a", n=2)]
            [('b', 0.994), ('c', 0.0)]
        """
        target = self[word].astype(np.float64)
        matrix = self.vectors.astype(np.float64)
        norms = np.linalg.norm(matrix, axis=1) * np.linalg.norm(target)
        with np.errstate(invalid="ignore", divide="ignore"):
            cosine = np.where(norms > 0, matrix @ target / np.where(norms > 0, norms, 1), 0.0)
        order = [i for i in np.argsort(-cosine, kind="stable") if self.words[i] != word]
        return [(self.words[i], float(cosine[i])) for i in order[:n]]

    def _scale(self) -> float:
        """σ of ``oov="random"``: the standard deviation of all numbers in the matrix."""
        if self.vectors.size < 2:
            return 1.0
        sigma = float(self.vectors.std(dtype=np.float64))
        return sigma if sigma > 0 else 1.0

    def _missing_message(self, missing: list[str]) -> str:
        shown = ", ".join(repr(w) for w in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        text = f"{len(missing)} word(s) have no vector: {shown}{more}"
        first = missing[0] if missing else ""
        close = [w for w in (first.lower(), first.capitalize()) if w != first and w in self.index]
        if not close and len(self) <= 100_000:
            close = difflib.get_close_matches(first, self.words, n=3)
        if close:
            text += f" (did you mean {', '.join(map(repr, close))} for {first!r}?)"
        return (
            f"{text}. Hint: lookup(..., oov='zero') or oov='random' gives unknown words a "
            "vector; see the out-of-vocabulary policy in docs/embeddings.md"
        )


def random_vector(word: str, dim: int, *, scale: float = 1.0, seed: int = 0) -> FloatMatrix:
    """The fixed random vector of an unknown word: N(0, scale²) seeded by the word and ``seed``.

    The word's UTF-8 bytes are hashed (BLAKE2b, 8 bytes) into the seed of NumPy's PCG64
    generator, so the vector is the same on every run and machine, and independent of the
    other words looked up.

    Example:
        >>> v = random_vector("emu", 4)
        >>> v.shape, bool((v == random_vector("emu", 4)).all())
        ((4,), True)
        >>> bool((v == random_vector("emu", 4, seed=1)).any())
        False
    """
    digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    rng = np.random.default_rng([seed, int.from_bytes(digest, "little")])
    return (rng.standard_normal(dim) * scale).astype(np.float32)


def _as_matrix(vectors: npt.ArrayLike, rows: int) -> FloatMatrix:
    array = np.asarray(vectors)
    if array.ndim != 2:
        raise ValueError(
            f"vectors must be a (V, D) matrix, got shape {array.shape}. "
            "Hint: one row per word, e.g. vectors.reshape(len(words), -1)."
        )
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"vectors must hold numbers, got dtype {array.dtype}.")
    if array.shape[0] != rows:
        raise ValueError(
            f"words has {rows} entries but vectors has {array.shape[0]} rows "
            f"(shape {array.shape}). Hint: one row per word, in the same order."
        )
    if array.shape[1] < 1:
        raise ValueError(f"vectors must have at least one column, got shape {array.shape}.")
    matrix = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(matrix).all():
        row = int(np.flatnonzero(~np.isfinite(matrix).all(axis=1))[0])
        raise ValueError(
            f"vectors[{row}] holds nan or inf. Hint: word vectors must be finite numbers."
        )
    view = matrix.view()
    view.flags.writeable = False
    return view
