"""The worked example as Python values: :class:`Example` and its :class:`Claimed` rows."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

_NUMBER = re.compile(r"[-+]?\d*(?:\.(\d*))?(?:[eE]([-+]?\d+))?")


def decimals_of(text: str) -> int:
    """Digits after the decimal point of a printed number: ``"1.10"`` → 2, ``"1.5e-3"`` → 4.

    Example:
        >>> [decimals_of(t) for t in ("0.5152", "1.10", "3", "-.5", "2.5e-2", "1e3")]
        [4, 2, 0, 1, 3, 0]
    """
    match = _NUMBER.fullmatch(text.strip().replace("_", ""))
    if match is None:
        return 0
    fraction, exponent = match.group(1) or "", match.group(2) or "0"
    return max(0, len(fraction) - int(exponent))


@dataclass(frozen=True)
class Claimed:
    """One row of numbers as a tutorial printed it, e.g. the weights of the query "love".

    Attributes:
        values: the numbers, shape (n,).
        texts: the numbers exactly as written in the file (``"0.5152"``, ``"1.10"``), from
            which ``qkv check`` reads the precision the author worked to.
        line: the line of the row in the file, when known (not compared by ``==``).

    Example:
        >>> row = Claimed(values=(1.02, 1.1), texts=("1.02", "1.10"), line=3)
        >>> row.decimals()
        (2, 2)
    """

    values: tuple[float, ...]
    texts: tuple[str, ...]
    line: int | None = field(default=None, compare=False)

    def decimals(self) -> tuple[int, ...]:
        """Digits after the decimal point of each printed number, e.g. ``(4, 4, 4)``."""
        return tuple(decimals_of(text) for text in self.texts)


@dataclass(frozen=True, eq=False)
class Example:
    """A worked example: tokens, embeddings, projection weights, options and claimed numbers.

    Shapes (row-vector convention, ``Q = X·W_q``): L tokens, E = d_model, H heads,
    ``embeddings`` (L, E); ``W_q``, ``W_k`` (E, H·D); ``W_v`` (E, H·Dv);
    ``W_o`` (H·Dv, E_out) or None. Arrays are float64 and read-only.

    Attributes:
        name: the title, e.g. ``"I love statistics"``.
        description: one or two sentences for the learner.
        tokens: the L token labels.
        embeddings: X, shape (L, E).
        W_q, W_k, W_v: the projections, shape (E, H·D), (E, H·D), (E, H·Dv).
        W_o: the output projection, shape (H·Dv, E_out), or None.
        heads: H; the columns of W_q, W_k and W_v split evenly into heads.
        scale: True divides the scores by √d_k, False leaves them as they are, a number
            multiplies them.
        causal: whether token i may attend only to tokens 0..i.
        queries: the query positions to show (0-based), or None for all.
        claimed: step name → token index → the row the author printed.
        slug: the built-in id (``"i-love-statistics"``), or None for a file.
        source: the file path, ``"<string>"`` or ``"<built-in NAME>"`` (not compared by ``==``).
        extras: the ``x-*`` keys of the file, as plain Python values.
        format: the version of the file format, 1 or 2.
        inputs: what the example starts from: ``"embeddings"`` (X and the weights),
            ``"qkv"``, ``"qk"`` or ``"scores"`` (format 2: ``given`` holds them; then
            ``embeddings`` is (Lk, 0) and ``W_q``, ``W_k``, ``W_v`` have no rows).
        given: format 2's direct inputs: ``"Q"`` (Lq, H·D), ``"K"`` (Lk, H·D),
            ``"V"`` (Lk, H·Dv), ``"scores"`` (Lq, Lk).
        query_tokens: the Lq query names when they are not ``tokens`` (Lq ≠ Lk), or None.
        alignment: the causal rule when Lq ≠ Lk: ``"top-left"`` or ``"bottom-right"``.
        key_length: keys from this position on are padding, or None.
        mask: an explicit (Lq, Lk) boolean mask, True = may attend, or None.
        d_k: the d_k of ``scale: true`` for an example given by its scores, or None.
        precision: input name (``"embeddings"``, ``"W_q"``, ``"Q"``, ...) → the decimals
            it was printed rounded to.
        dtype: the floating-point format the text computed in (``"float32"``, ...;
            ``dtype:`` of format 2), or None when the file does not say.
        head_claimed: per head, claimed rows of that head (step → token → row).
        assumed: rows a text takes as given (not checked; later steps use them).
        block_size: the tile size of a tiled example (``tiled: {block_size: N}``), or None.
        tiled_claimed: the claimed rows of the tiled steps (``tiled.claimed``): step →
            query → the row; per-tile steps hold the values of the visited key blocks one
            after the other (``accumulator``: d_v numbers per block).

    Example:
        >>> from qkv.examples import builtin
        >>> ex = builtin("i-love-statistics")
        >>> ex.tokens, ex.embeddings.shape, ex.W_q.shape
        (('I', 'love', 'statistics'), (3, 3), (3, 2))
        >>> ex.claimed["scores"][1].texts
        ('0.5152', '0.7178', '0.8934')
    """

    name: str
    description: str
    tokens: tuple[str, ...]
    embeddings: np.ndarray
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray | None = None
    heads: int = 1
    scale: bool | float = True
    causal: bool = False
    queries: tuple[int, ...] | None = None
    claimed: Mapping[str, Mapping[int, Claimed]] = field(default_factory=dict)
    slug: str | None = None
    source: str | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    format: int = 1
    inputs: str = "embeddings"
    given: Mapping[str, np.ndarray] = field(default_factory=dict)
    query_tokens: tuple[str, ...] | None = None
    alignment: str = "top-left"
    key_length: int | None = None
    mask: np.ndarray | None = None
    d_k: int | None = None
    precision: Mapping[str, int] = field(default_factory=dict)
    dtype: str | None = None
    head_claimed: tuple[Mapping[str, Mapping[int, Claimed]], ...] = ()
    assumed: Mapping[str, Mapping[int, Claimed]] = field(default_factory=dict)
    block_size: int | None = None
    tiled_claimed: Mapping[str, Mapping[int, Claimed]] = field(default_factory=dict)

    @property
    def queries_named(self) -> tuple[str, ...]:
        """The names of the query rows: ``query_tokens``, or ``tokens``."""
        return self.tokens if self.query_tokens is None else self.query_tokens

    @property
    def d_model(self) -> int:
        """E, the number of embedding columns."""
        return int(self.embeddings.shape[1])

    def __eq__(self, other: object) -> bool:
        """Equal content: the same numbers, tokens, options and claims (``source`` aside)."""
        if not isinstance(other, Example):
            return NotImplemented
        for f in fields(self):
            if f.name == "source":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "given":
                if mine.keys() != theirs.keys() or not all(
                    np.array_equal(mine[k], theirs[k]) for k in mine
                ):
                    return False
            elif isinstance(mine, np.ndarray) or isinstance(theirs, np.ndarray):
                if mine is None or theirs is None or not np.array_equal(mine, theirs):
                    return False
            elif type(mine) is not type(theirs) or mine != theirs:  # scale: True is not 1.0
                return False
        return True

    __hash__ = None  # type: ignore[assignment]
