"""Worked lines: the arithmetic of a step written out with its numbers.

``q_love = x_love·W_q = [0.4000, 0.8000, 0.6000]·W_q = [0.5000, 0.8000]``, the dot product of
a query with each key, one scaling, one softmax with its denominator, the sum of a row of
weights, and every context vector as the weighted sum of the value vectors. Each line is
checked against the recorded numbers first, so a line that would not be true (Q or K changed
after recording, a bias the softmax line cannot see) is left out rather than printed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkv._format import latex_escape, latex_number, number
from qkv.attention import softmax as softmax_of
from qkv.render._model import Equation, Math

__all__ = ["WorkedLines"]

_MAX_WORKED_KEYS = 8  # dot products and softmax terms written out for at most this many keys
_MAX_WORKED_DIMS = 8  # dot products written out for d_k up to this
_MAX_WEIGHTED_SUMS = 32  # context vectors written as weighted sums
_MAX_EXTRA_DECIMALS = 4  # a line whose rounded numbers do not add up gets up to this many more

_Line = tuple[Equation, bool]


def widest(line: Callable[[int], _Line], precision: int, widths: list[int]) -> list[Equation]:
    """The line at ``precision`` when it reads true (:func:`_holds`); else with up to
    :data:`_MAX_EXTRA_DECIMALS` more decimals, the fewest that do (added to ``widths``);
    else no line (-1 added). At ``--precision 0`` the weights 0.3, 0.3, 0.4 are all 0, and
    "0 + 0 + 0 = 1" would contradict itself."""
    for p in range(precision, min(precision + _MAX_EXTRA_DECIMALS, 15) + 1):
        equation, holds = line(p)
        if holds:
            if p > precision:
                widths.append(p)
            return [equation]
    widths.append(-1)
    return []


def widened_notes(widths: list[int], precision: int) -> list[str]:
    """The notes of the lines :func:`widest` wrote with more decimals, or left out; empties
    ``widths``."""
    kept, notes = sorted(set(widths)), []
    widths.clear()
    if kept and kept[0] == -1:
        notes.append(
            f"Lines whose numbers, rounded to {_decimals(precision)}, would not add up are "
            "left out."
        )
        kept = kept[1:]
    if kept:
        notes.append(
            f"Worked out with {_decimals(kept[-1])} instead of {precision}: rounded to "
            f"{_decimals(precision)}, the numbers of the line would not add up."
        )
    return notes


@dataclass(frozen=True)
class WorkedLines:
    """Writes out the arithmetic of one attention call.

    Attributes:
        query_labels, key_labels: the row and column labels of the scores.
        queries: the query rows shown, or None for all.
        worked: the query whose dot products and softmax are written out.
        scale: (scale, scale_mode, d_k) of the call.
        precision: decimals of every number.
        query_rows: the original position of each query row when a selection kept only
            some (``Step.index["query"]``), else None; the embeddings keep every row.
    """

    query_labels: Sequence[str]
    key_labels: Sequence[str]
    queries: Sequence[int] | None
    worked: int
    scale: tuple[float | None, str | None, int | None]
    precision: int
    query_rows: Sequence[int] | None = None
    _widened: list[int] = field(default_factory=list, repr=False, compare=False)

    @property
    def p(self) -> int:
        return self.precision

    def _shown(self, n: int) -> list[int]:
        return list(self.queries) if self.queries is not None else list(range(n))

    def _widest(self, line: Callable[[int], _Line]) -> list[Equation]:
        return widest(line, self.p, self._widened)

    def for_step(self, name: str, seen: dict[str, np.ndarray]) -> tuple[list[Equation], list[str]]:
        """The worked lines and notes of step ``name``, given the section's steps so far."""
        lines, notes = self._lines(name, seen)
        return lines, notes + widened_notes(self._widened, self.p)

    def _lines(self, name: str, seen: dict[str, np.ndarray]) -> tuple[list[Equation], list[str]]:
        if name == "Q":
            return self._projection(seen), []
        if name == "scores":
            return self._dot_products(seen)
        if name == "scaled":
            return self._scaling(seen), []
        if name == "weights":
            return self._softmax_lines(seen)
        if name == "context":
            return self._weighted_sums(seen)
        return [], []

    def _projection(self, seen: dict[str, np.ndarray]) -> list[Equation]:
        """``q_love = x_love·W_q = [0.4, 0.8, 0.6]·W_q = [0.5, 0.8]`` for the worked query."""
        x, w, q = seen.get("embeddings"), seen.get("W_q"), seen.get("Q")
        if x is None or w is None or q is None:
            return []
        rows = self.query_rows
        if rows is not None and len(rows) == q.shape[0] and x.shape[0] > max(rows, default=0):
            x = x[list(rows)]  # the embeddings of the query rows kept
        if x.shape[0] != q.shape[0]:
            return []
        if w.shape != (x.shape[1], q.shape[1]):
            return []  # several heads, or a different source: nothing simple to show
        with np.errstate(all="ignore"):  # a trace file's inf or NaN: no warning, no line
            same = np.allclose(x @ w, q, rtol=1e-6, atol=1e-9)
        if not same:
            return []  # a bias, or numbers that do not make Q: nothing simple to show
        i, query = self.worked, self.query_labels[self.worked]

        def line(p: int) -> _Line:
            embedding = _vector(x[i], p)
            sides = (
                (Math(f"q_{query}", rf"q_{{{_tex_token(query)}}}"),),
                (Math(f"x_{query}·W_q", rf"x_{{{_tex_token(query)}}} W_q"),),
                (Math(f"{embedding.plain}·W_q", rf"{embedding.latex}\, W_q"),),
                (_vector(q[i], p),),
            )
            carried = 0.5 * 10.0**-p * np.abs(w).sum(axis=0)
            return Equation(sides), _holds(_shown(x[i], p) @ w, q[i], p, carried)

        return self._widest(line)

    def _scaling(self, seen: dict[str, np.ndarray]) -> list[Equation]:
        """``S'[love, I] = 1.1160 / √2 = 0.7891`` for the worked query and its first key."""
        scores, scaled = seen.get("scores"), seen.get("scaled")
        scale, mode, d_k = self.scale
        if scores is None or scaled is None or scale is None or scores.shape != scaled.shape:
            return []
        if float(scale) == 1.0 or not np.allclose(scores * float(scale), scaled, rtol=1e-6):
            return []
        i, query, key = self.worked, self.query_labels[self.worked], self.key_labels[0]
        lhs = Math(f"S'[{query}, {key}]", rf"S'_{{{_tex_token(query)},\,{_tex_token(key)}}}")

        def line(p: int) -> _Line:
            s = number(float(scores[i, 0]), p)
            if mode == "sqrt_dk" and d_k:
                middle = Math(f"{s} / √{d_k}", rf"\frac{{{s}}}{{\sqrt{{{d_k}}}}}")
                by_hand = _shown(scores[i, 0], p) / math.sqrt(d_k)
                carried = 0.5 * 10.0**-p / math.sqrt(d_k)
            else:
                factor = number(float(scale), p)
                middle = Math(f"{s} × {factor}", rf"{s} \times {factor}")
                by_hand = _shown(scores[i, 0], p) * _shown(float(scale), p)
                carried = 0.5 * 10.0**-p * (abs(float(scale)) + abs(float(scores[i, 0])))
            equation = Equation(((lhs,), (middle,), (_num(float(scaled[i, 0]), p),)))
            return equation, _holds(by_hand, scaled[i, 0], p, carried)

        return self._widest(line)

    def _dot_products(self, seen: dict[str, np.ndarray]) -> tuple[list[Equation], list[str]]:
        q, k, s = seen.get("Q"), seen.get("K"), seen.get("scores")
        if q is None or k is None or s is None or q.shape[1] != k.shape[1]:
            return [], []
        if s.shape != (q.shape[0], k.shape[0]) or q.shape[1] > _MAX_WORKED_DIMS:
            return [], []
        i = self.worked
        keys = range(min(k.shape[0], _MAX_WORKED_KEYS))
        if not np.allclose(q[i] @ k[list(keys)].T, s[i, list(keys)], rtol=1e-6, atol=1e-9):
            return [], []  # Q or K were changed after recording (e.g. rotary embeddings)
        query = self.query_labels[i]
        lines = []
        for j in keys:
            key = self.key_labels[j]
            lhs = Math(
                f"q_{query}·k_{key}", rf"q_{{{_tex_token(query)}}} \cdot k_{{{_tex_token(key)}}}"
            )

            def line(p: int, j: int = j, lhs: Math = lhs) -> _Line:
                terms = tuple(_product(a, b, p) for a, b in zip(q[i], k[j], strict=True))
                equation = Equation(((lhs,), terms, (_num(float(s[i, j]), p),)))
                by_hand = _shown(q[i], p) @ _shown(k[j], p)
                carried = 0.5 * 10.0**-p * (np.abs(q[i]).sum() + np.abs(k[j]).sum())
                return equation, _holds(by_hand, s[i, j], p, carried)

            lines += self._widest(line)
        notes = []
        if k.shape[0] > len(keys):
            notes.append(f"The dot products with the first {len(keys)} of {k.shape[0]} keys.")
        return lines, notes

    def _softmax_lines(self, seen: dict[str, np.ndarray]) -> tuple[list[Equation], list[str]]:
        weights = seen.get("weights")
        if weights is None:
            return [], []
        notes: list[str] = []
        for i in self._shown(weights.shape[0]):
            if not np.any(weights[i]):
                notes.append(
                    f"Every key is masked for the query {self.query_labels[i]}: its attention "
                    "weights are all 0 and its context vector is 0."
                )
        i = self.worked
        source = None
        for candidate in ("masked", "bias", "scaled", "scores"):
            scores = seen.get(candidate)
            if (
                scores is not None
                and scores.shape == weights.shape
                and np.allclose(softmax_of(scores[i]), weights[i], rtol=1e-6, atol=1e-9)
            ):
                source = scores
                break
        n = weights.shape[1]
        if source is None or not np.isfinite(source[i]).any() or n > _MAX_WORKED_KEYS:
            return [], notes
        row, query = source[i], self.query_labels[i]
        j = int(np.flatnonzero(np.isfinite(row))[0])
        key = self.key_labels[j]
        lhs = Math(f"A[{query}, {key}]", rf"A_{{{_tex_token(query)},\,{_tex_token(key)}}}")

        def softmax(p: int) -> _Line:
            exps = [_exp(float(v), p) for v in row]
            middle = Math(
                f"{exps[j].plain} / ({' + '.join(e.plain for e in exps)})",
                rf"\frac{{{exps[j].latex}}}{{{' + '.join(e.latex for e in exps)}}}",
            )
            equation = Equation(((lhs,), (middle,), (_num(float(weights[i, j]), p),)))
            shown = _shown(row, p)
            finite = np.isfinite(shown)
            by_hand = (
                np.exp(shown[j] - shown[finite].max())
                / np.exp(shown[finite] - shown[finite].max()).sum()
            )
            carried = 10.0**-p * weights[i, j] * (1 - weights[i, j])  # Σ_k |∂A_j/∂S_k| · ½u
            return equation, _holds(by_hand, weights[i, j], p, carried)

        total = Math(f"Σ_j A[{query}, j]", rf"\sum_j A_{{{_tex_token(query)},\,j}}")

        def row_sum(p: int) -> _Line:
            terms = tuple(_num(float(w), p) for w in weights[i])
            equation = Equation(((total,), terms, (_num(float(weights[i].sum()), p),)))
            carried = 0.5 * 10.0**-p * weights.shape[1]
            return equation, _holds(_shown(weights[i], p).sum(), weights[i].sum(), p, carried)

        return self._widest(softmax) + self._widest(row_sum), notes

    def _weighted_sums(self, seen: dict[str, np.ndarray]) -> tuple[list[Equation], list[str]]:
        weights = seen.get("dropout", seen.get("weights"))
        values, context = seen.get("V"), seen.get("context")
        if weights is None or values is None or context is None:
            return [], []
        if weights.shape != (context.shape[0], values.shape[0]):
            return [], []
        if values.shape[1] != context.shape[1] or not np.isfinite(values).all():
            return [], []
        # float32 rounding of each term (a model's trace), not of the sum: |A|·|V| bounds it
        if not np.all(
            np.abs(weights @ values - context) <= 1e-9 + 1e-6 * (np.abs(weights) @ np.abs(values))
        ):
            return [], []
        masked = seen.get("masked")
        shown = self._shown(weights.shape[0])
        lines, left_out = [], False
        for i in shown[:_MAX_WEIGHTED_SUMS]:
            query = self.query_labels[i]
            kept = [
                j
                for j, w in enumerate(weights[i])
                if not (w == 0 and masked is not None and np.isneginf(masked[i, j]))
            ]
            left_out = left_out or len(kept) < weights.shape[1]
            lhs = Math(f"c_{query}", rf"c_{{{_tex_token(query)}}}")

            def line(p: int, i: int = i, kept: list[int] = kept, lhs: Math = lhs) -> _Line:
                terms = tuple(
                    Math(
                        f"{number(float(weights[i, j]), p)}·v_{self.key_labels[j]}",
                        rf"{latex_number(float(weights[i, j]), p)}"
                        rf"\,v_{{{_tex_token(self.key_labels[j])}}}",
                    )
                    for j in kept
                )
                result = _vector(context[i], p)
                sides = ((lhs,), terms, (result,)) if terms else ((lhs,), (result,))
                by_hand = _shown(weights[i, kept], p) @ values[kept]
                carried = 0.5 * 10.0**-p * np.abs(values[kept]).sum(axis=0)
                return Equation(sides), _holds(by_hand, context[i], p, carried)

            lines += self._widest(line)
        notes = []
        if left_out:
            notes.append("Terms with weight 0 (masked keys) are left out of the weighted sums.")
        if len(shown) > _MAX_WEIGHTED_SUMS:
            notes.append(
                f"The first {_MAX_WEIGHTED_SUMS} of {len(shown)} context vectors are written "
                "as weighted sums."
            )
        return lines, notes


def _decimals(n: int) -> str:
    return f"{n} decimal" + ("" if n == 1 else "s")


def _shown(values: Any, precision: int) -> np.ndarray:
    """The numbers as printed with ``precision`` decimals, read back."""
    array = np.asarray(values, dtype=np.float64)
    flat = [float(f"{v:.{precision}f}") for v in array.ravel()]
    return np.asarray(flat, dtype=np.float64).reshape(array.shape)


def _holds(by_hand: Any, result: Any, precision: int, carried: Any = 0.0) -> bool:
    """Whether a line written with ``precision`` decimals reads true.

    True when the arithmetic redone with the printed numbers (``by_hand``) gives the printed
    result within half a unit of its last decimal; or, failing that, when the rounding the
    printed numbers carry (``carried``: how far their half units can move the result, plus
    the result's own half unit) stays within 5% of the result, so that a reader sees a
    difference in the last digit, not a contradiction like "0 + 0 + 0 = 1".
    """
    by_hand = np.asarray(by_hand, dtype=np.float64)
    printed = _shown(result, precision)
    if not (np.isfinite(by_hand).all() and np.isfinite(printed).all()):
        return bool(np.array_equal(by_hand, printed))
    half = 0.5 * 10.0**-precision
    off = np.abs(by_hand - printed)
    exact = off <= half * (1 + 1e-6) + 1e-9 * np.maximum(1.0, np.abs(printed))
    bound = half + np.abs(np.asarray(carried, dtype=np.float64))
    close = (off <= bound * (1 + 1e-6)) & (bound <= 0.05 * np.abs(printed))
    return bool(np.all(exact | close))


def _product(a: float, b: float, precision: int) -> Math:
    def factor(x: float) -> Math:
        text = number(x, precision)
        if text.startswith("-"):
            return Math(f"({text})", f"({text})")
        return Math(text, text)

    fa, fb = factor(float(a)), factor(float(b))
    return Math(f"{fa.plain}×{fb.plain}", rf"{fa.latex} \times {fb.latex}")


def _exp(value: float, precision: int) -> Math:
    return Math(f"e^{number(value, precision)}", f"e^{{{latex_number(value, precision)}}}")


def _tex_token(token: str) -> str:
    return r"\text{" + latex_escape(token) + "}"


def _vector(values: np.ndarray, precision: int) -> Math:
    plain = "[" + ", ".join(number(float(v), precision) for v in values) + "]"
    latex = "[" + r",\ ".join(latex_number(float(v), precision) for v in values) + "]"
    return Math(plain, latex)


def _num(value: float, precision: int) -> Math:
    return Math(number(value, precision), latex_number(value, precision))
