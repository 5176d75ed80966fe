"""``qkv explain --tiled``: the FlashAttention algorithm on a worked example, tile by tile.

The numbers come from :func:`qkv.attention._tiled_steps.tiled_steps` (plain NumPy float64),
run on the Q, K and V a worked example's trace recorded, with its scale and mask. This module
only lays them out: a :class:`~qkv.render.Narrative` (the same model as every step of
``qkv explain``, so text, Markdown and LaTeX come from the existing renderers), JSON with
every array, and the data of the page (:mod:`qkv.render._tiled_page`).

For each head: the tiles (query blocks × key blocks: skipped, full, or masked), then each
tile in the order the forward pass visits it (its scaled scores, tile maximum, running
maximum, rescale factor, running sum and accumulator, row by row), the output O / l and the
log-sum-exp, the comparison with the plain softmax, and the backward of one key block
(D = rowsum(dO ∘ O), P recomputed from L, dP, dS, and dQ, dK, dV).
"""

from __future__ import annotations

import json as _json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from qkv._format import json_safe, latex_escape, latex_number, number
from qkv.attention._tiled_steps import BackwardTile, ForwardTile, TiledSteps, tiled_steps
from qkv.render._model import Equation, Fact, Math, Narrative, Section, StepView, Table
from qkv.render._narrative import _labels, _visible
from qkv.render._worked import _holds, _shown, widened_notes, widest
from qkv.steps import TILED_WORDS
from qkv.trace import Trace

__all__ = [
    "DEFAULT_BLOCK",
    "TILED_FORMATS",
    "TiledRun",
    "render_tiled",
    "tiled_json",
    "tiled_narrative",
    "tiled_run",
]

DEFAULT_BLOCK = 2
"""Queries and keys per tile by default: the built-in examples (3 to 6 tokens) then have
several tiles in each direction."""

TILED_FORMATS = ("text", "markdown", "latex", "json")
"""The formats of ``qkv explain --tiled`` besides the page (``--html``)."""

_KIND_WORDS = {
    "skipped": "skipped: every score of the tile is masked, nothing is computed",
    "full": "full: every query of the block may attend every key of it, no mask is applied",
    "masked": "masked: some scores of the tile are −∞, the mask is applied element by element",
}


@dataclass(frozen=True)
class TiledRun:
    """A worked example computed tile by tile, every head.

    Attributes:
        name, description: the example's.
        queries: the query rows' labels (Lq). keys: the keys' labels (Lk).
        heads: one :class:`~qkv.attention._tiled_steps.TiledSteps` per head.
        causal: the example is causal (the masked tiles are on the diagonal).
        mask: the mask in words (``"causal (top-left)"``), or ``""`` for none.
        reference: (H, Lq, Dv) the context vectors qkv's reference computed (the steps of
            ``qkv explain``).
        reference_difference: the largest |O − reference| over every head.
        backward_block: the key block whose backward is shown.
    """

    name: str
    description: str
    queries: tuple[str, ...]
    keys: tuple[str, ...]
    heads: tuple[TiledSteps, ...]
    causal: bool
    mask: str
    reference: np.ndarray
    reference_difference: float
    backward_block: int = 0

    @property
    def block_size(self) -> int:
        return self.heads[0].block_size


def _per_head(trace: Trace, name: str) -> np.ndarray:
    """A step of the trace as (H, L, ·) (one head: a leading axis of 1)."""
    step = trace[name]
    value = np.asarray(step.value, dtype=np.float64)
    return value if value.ndim == 3 else value[None]


def tiled_run(trace: Trace, *, block_size: int = DEFAULT_BLOCK) -> TiledRun:
    """The worked example's trace (from :func:`qkv.examples.run`) computed tile by tile.

    Raises:
        ValueError: a trace that is not one call of one batch element with Q, K, V and the
            context (a model's trace), one with a bias or dropout (not shown tiled), or a
            block size the tiles refuse.

    Example:
        >>> from qkv import examples
        >>> run = tiled_run(examples.run(examples.builtin("i-love-statistics")))
        >>> run.heads[0].kinds.tolist(), run.reference_difference < 1e-15
        ([['full', 'full'], ['full', 'full']], True)
    """
    names = [step.name for step in trace.steps]
    missing = [n for n in ("Q", "K", "V", "context") if n not in names]
    if missing or len(names) != len(set(names)):
        raise ValueError(
            "a tiled explanation needs one attention call with Q, K, V and the context "
            "vectors, as a worked example records. Hint: qkv explain --tiled --example NAME"
        )
    for extra in ("bias", "dropout"):
        if extra in names:
            raise ValueError(
                f"the example has a {extra} step, which the tiled explanation does not show. "
                "Hint: explain it without --tiled"
            )
    q, k, v = (_per_head(trace, n) for n in ("Q", "K", "V"))
    reference = _per_head(trace, "context")
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError("a tiled explanation needs one batch element. Hint: a worked example")
    allowed = None
    if "masked" in names:
        masked = np.asarray(trace["masked"].value, dtype=np.float64)
        allowed = np.isfinite(masked if masked.ndim == 3 else masked[None])
    heads, kv_heads = q.shape[0], k.shape[0]
    group = heads // kv_heads
    scale = float(trace.meta.get("scale") or 1.0 / math.sqrt(q.shape[2]))
    results = tuple(
        tiled_steps(
            q[h],
            k[h // group],
            v[h // group],
            block_size=block_size,
            scale=scale,
            allowed=None if allowed is None else allowed[h if allowed.shape[0] > 1 else 0],
        )
        for h in range(heads)
    )
    difference = max(float(np.abs(r.output - reference[h]).max()) for h, r in enumerate(results))
    meta = trace.meta
    causal = bool(meta.get("causal"))
    mask = ""
    if causal:
        mask = f"causal ({meta.get('causal_alignment') or 'top-left'})"
    if allowed is not None and not causal:
        mask = "the example's mask"
    elif allowed is not None and meta.get("mask") is not None:
        mask += " and the example's mask"
    return TiledRun(
        name=str(meta.get("name") or "Attention"),
        description=str(meta.get("description") or ""),
        queries=tuple(_labels(trace.query_tokens or trace.tokens, q.shape[1], "t")),
        keys=tuple(_labels(trace.tokens, k.shape[1], "t")),
        heads=results,
        causal=causal,
        mask=mask,
        reference=reference,
        reference_difference=difference,
    )


# -- pieces of mathematics in two spellings --------------------------------------------------


def _tex(label: str) -> str:
    return r"\text{" + latex_escape(label) + "}"


def _num(x: float, p: int) -> Math:
    return Math(number(x, p), latex_number(x, p))


def _vec(values: np.ndarray, p: int) -> Math:
    plain = "[" + ", ".join(number(float(x), p) for x in values) + "]"
    tex = "[" + r",\ ".join(latex_number(float(x), p) for x in values) + "]"
    return Math(plain, tex)


def _at(name: str, tex: str, *labels: str) -> Math:
    """``m[I]`` / ``m_{\\text{I}}``, ``P̃[I, love]`` / ``\\tilde P_{\\text{I},\\,\\text{love}}``."""
    return Math(f"{name}[{', '.join(labels)}]", tex + "_{" + r",\,".join(map(_tex, labels)) + "}")


def _call(func: str, tex: str, *args: Math) -> Math:
    return Math(
        f"{func}({', '.join(a.plain for a in args)})",
        tex + r"\left(" + ", ".join(a.latex for a in args) + r"\right)",
    )


def _minus(a: Math, b: Math) -> Math:
    b_plain = f"({b.plain})" if b.plain.startswith("-") else b.plain
    b_tex = f"({b.latex})" if b.latex.startswith("-") else b.latex
    return Math(f"{a.plain} − {b_plain}", f"{a.latex} - {b_tex}")


def _times(a: Math, b: Math, op: str = "·", tex_op: str = r"\cdot ") -> Math:
    a_plain = f"({a.plain})" if a.plain.startswith("-") else a.plain
    a_tex = f"({a.latex})" if a.latex.startswith("-") else a.latex
    return Math(f"{a_plain}{op}{b.plain}", f"{a_tex}{tex_op}{b.latex}")


def _eq(*sides: Math | Sequence[Math]) -> Equation:
    return Equation(tuple((s,) if isinstance(s, Math) else tuple(s) for s in sides))


_Line = tuple[Equation, bool]
"""A worked line at some precision, and whether its rounded numbers add up."""

_ALPHA = Math("α", r"\alpha")
_ROW_SYMBOLS = (
    ("tile_max", "m̃"),
    ("running_max", "m"),
    ("rescale", "α"),
    ("running_sum", "l"),
    ("accumulator", "O"),
)
_SUM_P = Math("Σ_j P̃", r"\sum_j \tilde P")


def _block_words(labels: Sequence[str], bounds: tuple[int, int]) -> str:
    return ", ".join(labels[bounds[0] : bounds[1]])


# -- the narrative -----------------------------------------------------------------------------


def tiled_narrative(run: TiledRun, *, precision: int = 4) -> Narrative:
    """The run as a :class:`~qkv.render.Narrative`: what the text, Markdown and LaTeX
    formats lay out.

    Example:
        >>> from qkv import examples
        >>> run = tiled_run(examples.run(examples.builtin("i-love-statistics")))
        >>> [s.title for s in tiled_narrative(run).sections[0].steps][:2]
        ['The tiles', 'Tile (query block 0, key block 0): full']
    """
    if not isinstance(precision, int) or not 0 <= precision <= 12:
        raise ValueError(f"precision must be an integer from 0 to 12, got {precision!r}.")
    sections = []
    count = len(run.heads)
    for h, steps in enumerate(run.heads):
        title = None if count == 1 else f"Head {h} of {count} heads"
        views = _Views(run, steps, precision, h).all()
        sections.append(Section(title, tuple(views)))
    first = run.heads[0]
    facts = [
        Fact("tokens", ", ".join(run.keys), ", ".join(latex_escape(t) for t in run.keys)),
        Fact("d_k", str(first.q.shape[1]), str(first.q.shape[1])),
        Fact("scale", number(first.scale, 4), number(first.scale, 4)),
        Fact("mask", run.mask or "none", latex_escape(run.mask or "none")),
        Fact(
            "tiles",
            f"{first.block_size} queries × {first.block_size} keys: {first.query_blocks} "
            f"query blocks × {first.key_blocks} key blocks",
            f"{first.block_size} queries $\\times$ {first.block_size} keys: "
            f"{first.query_blocks} query blocks $\\times$ {first.key_blocks} key blocks",
        ),
        Fact("dO", "all ones (the gradient of sum(O))", "all ones (the gradient of sum(O))"),
    ]
    description = (
        "Attention computed the way FlashAttention computes it: the scaled scores are cut "
        f"into tiles of {first.block_size} queries by {first.block_size} keys, and each query "
        "row keeps a running maximum m, a running sum l and an accumulator O, updated tile by "
        "tile; the (Lq, Lk) matrix of weights is never held. At the end O / l is the output "
        "and L = m + log l the log-sum-exp, which the backward pass recomputes the weights "
        "from."
    )
    return _visible(
        Narrative(
            title=f"FlashAttention, tile by tile: {run.name}",
            description=description,
            facts=tuple(facts),
            sections=tuple(sections),
            precision=precision,
        )
    )


class _Views:
    """The steps of one head, numbered from 1."""

    def __init__(self, run: TiledRun, steps: TiledSteps, precision: int, head: int) -> None:
        self.run, self.s, self.p, self.head = run, steps, precision, head
        self.number = 0
        self.widths: list[int] = []

    def view(self, name: str, title: str, formula: Math, meaning: str, **kw: Any) -> StepView:
        self.number += 1
        return StepView(name, self.number, title, formula, meaning, **kw)

    def all(self) -> list[StepView]:
        views = [self.grid()]
        views += [self.tile(t) for t in self.s.tiles]
        views += [self.output(), self.lse(), self.comparison()]
        views += self.backward()
        return views

    def grid(self) -> StepView:
        s, run = self.s, self.run
        notes = []
        rows = [(t.rows) for t in s.tiles if t.k_block == 0]
        cols = [(t.cols) for t in s.tiles if t.q_block == 0]
        for i, bounds in enumerate(rows):
            notes.append(f"query block {i}: {_block_words(run.queries, bounds)}")
        for j, bounds in enumerate(cols):
            notes.append(f"key block {j}: {_block_words(run.keys, bounds)}")
        for i in range(s.query_blocks):
            kinds = ", ".join(f"key block {j} {s.kinds[i, j]}" for j in range(s.key_blocks))
            notes.append(f"query block {i} × {kinds}")
        present = dict.fromkeys(str(k) for k in s.kinds.flat)
        for kind in ("full", "masked", "skipped"):
            if kind in present:
                words = _KIND_WORDS[kind]
                if kind == "masked" and run.causal:
                    words += " (on the diagonal of the causal mask)"
                notes.append(words[:1].upper() + words[1:] + ".")
        return self.view(
            "scaled",
            "The tiles",
            Math(
                "S'_ij = Q_i·K_jᵀ × scale, tile by tile",
                r"S'_{ij} = Q_i K_j^{\top} \cdot \mathrm{scale}",
            ),
            f"The forward pass visits query block by query block, each key block from left to "
            f"right: {s.query_blocks} × {s.key_blocks} tiles.",
            table=None,
            notes=tuple(notes),
        )

    def tile(self, t: ForwardTile) -> StepView:
        run = self.run
        queries = run.queries[t.rows[0] : t.rows[1]]
        keys = run.keys[t.cols[0] : t.cols[1]]
        title = f"Tile (query block {t.q_block}, key block {t.k_block}): {t.kind}"
        where = f"Queries {', '.join(queries)} × keys {', '.join(keys)}"
        if t.kind == "skipped":
            return self.view(
                "accumulator",
                title,
                Math("m, l and O unchanged", r"m,\ \ell,\ O \text{ unchanged}"),
                f"{where}: every score is masked, so the tile is skipped: nothing is "
                "computed, m, l and O stay as they were.",
                table=None,
            )
        formula = Math(
            "m = max(m_old, m̃); α = exp(m_old − m); l = α·l_old + ΣP̃; O = α·O_old + P̃·V_j",
            r"m = \max(m^{\text{old}}, \tilde m),\ \alpha = e^{m^{\text{old}} - m},\ "
            r"\ell = \alpha\,\ell^{\text{old}} + \textstyle\sum \tilde P,\ "
            r"O = \alpha\,O^{\text{old}} + \tilde P V_j",
        )
        named = [
            f"the {TILED_WORDS[n].singular.removesuffix(' row')} {symbol}"
            for n, symbol in _ROW_SYMBOLS
        ]
        names = ", ".join(named[:-1]) + " and " + named[-1]
        meaning = (
            f"{where}. "
            + _KIND_WORDS[t.kind][:1].upper()
            + _KIND_WORDS[t.kind][1:]
            + f". Row by row: {names}, with P̃ = exp(S' − m)."
        )
        table = Table("S' (query \\ key)", tuple(queries), tuple(keys), t.scores)
        equations: list[Equation] = []
        notes: list[str] = []
        for r, query in enumerate(queries):
            equations += self._row(t, r, query, keys, notes)
        if any(not np.isfinite(t.scores[r]).all() for r in range(len(queries))):
            notes.append("Masked scores (−∞) give P̃ = 0: their terms are left out.")
        return self.view(
            "accumulator",
            title,
            formula,
            meaning,
            table=table,
            equations=tuple(equations),
            notes=tuple(dict.fromkeys([*notes, *self.widened()])),
        )

    def _worked(self, line: Callable[[int], _Line]) -> list[Equation]:
        return widest(line, self.p, self.widths)

    def widened(self) -> list[str]:
        """The notes of the lines written with more decimals, or left out, since the last
        call."""
        return widened_notes(self.widths, self.p)

    def _exp_line(self, lhs: Math, a: float, b: float, result: float) -> list[Equation]:
        """``lhs = exp(a − b) = result``, checked with the numbers as printed."""

        def line(p: int) -> _Line:
            equation = _eq(
                lhs, _call("exp", r"\exp", _minus(_num(a, p), _num(b, p))), _num(result, p)
            )
            shift = _shown(a, p) - _shown(b, p) if math.isfinite(a) else -math.inf
            by_hand = math.exp(float(shift)) if math.isfinite(b) else math.exp(a) * 0
            half = 0.5 * 10.0**-p
            return equation, _holds(by_hand, result, p, 2 * half * abs(result))

        if not math.isfinite(b):  # exp(x − (−∞)): never shown, the exponent uses 0
            return []
        return self._worked(line)

    def _row(
        self, t: ForwardTile, r: int, query: str, keys: Sequence[str], notes: list[str]
    ) -> list[Equation]:
        p = self.p
        scores = t.scores[r]
        allowed = [c for c in range(len(keys)) if np.isfinite(scores[c])]
        m_old, m_new = float(t.m_old[r]), float(t.m_new[r])
        if not allowed:
            if math.isinf(m_new):
                notes.append(
                    f"{query}: no key allowed yet, m stays −∞; α and P̃ take 0 in place of m, "
                    "so no −∞ − (−∞) = NaN: α = 0 and l, O stay 0."
                )
            else:
                notes.append(f"{query}: every key of this tile is masked: m, l and O unchanged.")
            return []
        out = [
            _eq(
                _at("m̃", r"\tilde m", query),
                _call("max", r"\max", *(_num(float(scores[c]), p) for c in allowed)),
                _num(float(t.tile_max[r]), p),
            ),
            _eq(
                _at("m", "m", query),
                _call("max", r"\max", _num(m_old, p), _num(float(t.tile_max[r]), p)),
                _num(m_new, p),
            ),
        ]
        out += self._exp_line(_at("α", r"\alpha", query), m_old, m_new, float(t.rescale[r]))
        for c in allowed:
            lhs = _at("P̃", r"\tilde P", query, keys[c])
            out += self._exp_line(lhs, float(scores[c]), m_new, float(t.p[r, c]))
        alpha, l_old = float(t.rescale[r]), float(t.l_old[r])
        weights = [float(t.p[r, c]) for c in allowed]

        def sum_line(p: int) -> _Line:
            terms = [_times(_num(alpha, p), _num(l_old, p))] + [_num(w, p) for w in weights]
            equation = _eq(
                _at("l", r"\ell", query),
                [_times(_ALPHA, Math("l_old", r"\ell^{\text{old}}")), _SUM_P],
                terms,
                _num(float(t.l_new[r]), p),
            )
            by_hand = _shown(alpha, p) * _shown(l_old, p) + _shown(weights, p).sum()
            carried = 0.5 * 10.0**-p * (abs(alpha) + abs(l_old) + len(weights))
            return equation, _holds(by_hand, t.l_new[r], p, carried)

        out += self._worked(sum_line)
        values = self.s.v[t.cols[0] : t.cols[1]][allowed]

        def accumulator_line(p: int) -> _Line:
            terms = [_times(_num(alpha, p), _vec(t.o_old[r], p))]
            terms += [
                _times(_num(w, p), Math(f"v_{keys[c]}", f"v_{{{_tex(keys[c])}}}"))
                for w, c in zip(weights, allowed, strict=True)
            ]
            equation = _eq(
                _at("O", "O", query),
                [
                    _times(_ALPHA, Math("O_old", r"O^{\text{old}}")),
                    Math("Σ_j P̃·v_j", r"\sum_j \tilde P\, v_j"),
                ],
                terms,
                _vec(t.o_new[r], p),
            )
            by_hand = _shown(alpha, p) * _shown(t.o_old[r], p) + _shown(weights, p) @ values
            carried = (
                0.5 * 10.0**-p * (np.abs(t.o_old[r]) + abs(alpha) + np.abs(values).sum(axis=0))
            )
            return equation, _holds(by_hand, t.o_new[r], p, carried)

        out += self._worked(accumulator_line)
        return out

    def _division_line(self, r: int, query: str, p: int) -> _Line:
        s = self.s
        acc, total = s.accumulator[r], float(s.l[r])
        equation = _eq(
            _at("O", "O", query),
            Math(
                f"{_vec(acc, p).plain} / {number(total, p)}",
                rf"{_vec(acc, p).latex} / {latex_number(total, p)}",
            ),
            _vec(s.output[r], p),
        )
        shown = float(_shown(total, p))
        if shown == 0:
            return equation, False
        by_hand = _shown(acc, p) / shown
        carried = 0.5 * 10.0**-p * (1 / abs(total) + np.abs(acc) / total**2)
        return equation, _holds(by_hand, s.output[r], p, carried)

    def _lse_line(self, r: int, query: str, p: int) -> _Line:
        s = self.s
        m, total = float(s.m[r]), float(s.l[r])
        equation = _eq(
            _at("L", "L", query),
            Math(
                f"{number(m, p)} + log {number(total, p)}",
                rf"{latex_number(m, p)} + \log {latex_number(total, p)}",
            ),
            _num(float(s.lse[r]), p),
        )
        shown = float(_shown(total, p))
        if shown <= 0:
            return equation, False
        by_hand = float(_shown(m, p)) + math.log(shown)
        carried = 0.5 * 10.0**-p * (1 + 1 / total)
        return equation, _holds(by_hand, s.lse[r], p, carried)

    def _delta_line(self, r: int, query: str, p: int) -> _Line:
        s = self.s
        terms = [
            _times(_num(float(s.d_out[r, c]), p), _num(float(s.output[r, c]), p), "×")
            for c in range(s.output.shape[1])
        ]
        equation = _eq(_at("D", "D", query), terms, _num(float(s.delta[r]), p))
        by_hand = float(_shown(s.d_out[r], p) @ _shown(s.output[r], p))
        carried = 0.5 * 10.0**-p * float(np.abs(s.d_out[r]).sum() + np.abs(s.output[r]).sum())
        return equation, _holds(by_hand, s.delta[r], p, carried)

    def _ds_line(self, t: BackwardTile, r: int, c: int, query: str, key: str, p: int) -> _Line:
        weight, dp, delta = float(t.p[r, c]), float(t.dp[r, c]), float(self.s.delta[t.rows[0] + r])
        equation = _eq(
            _at("dS", "dS", query, key),
            Math("P·(dP − D)", r"P\,(dP - D)"),
            _times(
                _num(weight, p),
                Math(
                    f"({number(dp, p)} − {number(delta, p)})",
                    f"({latex_number(dp, p)} - {latex_number(delta, p)})",
                ),
            ),
            _num(float(t.ds[r, c]), p),
        )
        by_hand = float(_shown(weight, p) * (_shown(dp, p) - _shown(delta, p)))
        carried = 0.5 * 10.0**-p * (abs(dp - delta) + 2 * abs(weight))
        return equation, _holds(by_hand, t.ds[r, c], p, carried)

    def output(self) -> StepView:
        s, run = self.s, self.run
        words = TILED_WORDS["output"]
        columns = tuple(f"d{c + 1}" for c in range(s.output.shape[1]))
        equations: list[Equation] = []
        notes: list[str] = []
        for r, query in enumerate(run.queries):
            if s.l[r] == 0:
                notes.append(
                    f"{query}: no key allowed, l = 0: the row is zeros (qkv's policy, as "
                    "the plain softmax gives), never 0 / 0."
                )
                continue
            equations += self._worked(partial(self._division_line, r, query))
        return self.view(
            "output",
            words.title,
            Math(words.formula, words.latex),
            "After the last tile, one division per row: the context vectors.",
            table=Table("query", run.queries, columns, s.output),
            equations=tuple(equations),
            notes=(*notes, *self.widened()),
        )

    def lse(self) -> StepView:
        s, run = self.s, self.run
        words = TILED_WORDS["lse"]
        values = np.stack([s.m, s.l, s.lse], axis=1)
        equations: list[Equation] = []
        for r, query in enumerate(run.queries):
            if s.l[r] == 0:
                continue
            equations += self._worked(partial(self._lse_line, r, query))
        notes = ["Natural log: L = log Σ_j exp(S'_ij), what FlashAttention saves per row."]
        if (s.l == 0).any():
            notes.append("A row with no allowed key has L = −∞.")
        return self.view(
            "lse",
            words.title,
            Math(words.formula, words.latex),
            "The log of each row's softmax denominator, from m and l.",
            table=Table("query", run.queries, ("m", "l", "L"), values),
            equations=tuple(equations),
            notes=(*notes, *self.widened()),
        )

    def comparison(self) -> StepView:
        s, run = self.s, self.run
        reference = float(np.abs(s.output - run.reference[self.head]).max())
        return self.view(
            "output",
            "The tiled pass equals the plain softmax",
            Math(
                "O = softmax(S')·V, L = log Σ_j exp(S'_ij)",
                r"O = \operatorname{softmax}(S') V,\ L = \log \textstyle\sum_j e^{S'_{ij}}",
            ),
            "The same numbers as the plain softmax over whole rows, up to float64 rounding.",
            table=None,
            notes=(
                f"max |O − C| = {reference:.1e}, C: the context vectors of qkv explain "
                "(qkv's reference, float64).",
                f"max |L − log Σ_j exp(S'_ij)| = {s.lse_difference:.1e}, the whole row at "
                "once (float64).",
            ),
        )

    def backward(self) -> list[StepView]:
        s, run = self.s, self.run
        j = run.backward_block
        cols = next(t.cols for t in s.tiles if t.k_block == j)
        keys = run.keys[cols[0] : cols[1]]
        equations: list[Equation] = []
        for r, query in enumerate(run.queries):
            equations += self._worked(partial(self._delta_line, r, query))
        views = [
            self.view(
                "output",
                f"Backward of key block {j} ({', '.join(keys)}): D = rowsum(dO ∘ O)",
                Math("D = rowsum(dO ∘ O)", r"D = \operatorname{rowsum}(dO \circ O)"),
                "FlashAttention-2's backward visits key block by key block, each query block "
                "from top to bottom, and recomputes the weights from L instead of keeping "
                "them. dO, the gradient reaching the output, is all ones here (the gradient "
                "of sum(O)).",
                table=None,
                equations=tuple(equations),
                notes=tuple(self.widened()),
            )
        ]
        views += [self._backward_tile(t) for t in s.backward_of(j)]
        grads = np.concatenate([s.dk[cols[0] : cols[1]], s.dv[cols[0] : cols[1]]], axis=1)
        d = s.dk.shape[1]
        columns = tuple(f"dK.d{c + 1}" for c in range(d))
        columns += tuple(f"dV.d{c + 1}" for c in range(s.dv.shape[1]))
        views.append(
            self.view(
                "output",
                f"dK and dV of key block {j}",
                Math(
                    "dK_j = Σ_i scale·dS_ijᵀ·Q_i, dV_j = Σ_i P_ijᵀ·dO_i",
                    r"dK_j = \textstyle\sum_i \mathrm{scale}\, dS_{ij}^{\top} Q_i,\ "
                    r"dV_j = \textstyle\sum_i P_{ij}^{\top} dO_i",
                ),
                "Complete once every query block has been visited.",
                table=Table("key", tuple(keys), columns, grads),
            )
        )
        dq_columns = tuple(f"dQ.d{c + 1}" for c in range(d))
        views.append(
            self.view(
                "output",
                "dQ, after every key block",
                Math("dQ_i = Σ_j scale·dS_ij·K_j", r"dQ_i = \sum_j \mathrm{scale}\, dS_{ij} K_j"),
                "Each key block adds its part to the rows of dQ.",
                table=Table("query", run.queries, dq_columns, s.dq),
                notes=(
                    f"max |tiled − plain| over dQ, dK and dV = {s.gradient_difference:.1e}, "
                    "the plain backward over the whole matrices at once (float64).",
                ),
            )
        )
        return views

    def _backward_tile(self, t: BackwardTile) -> StepView:
        s, p, run = self.s, self.p, self.run
        queries = run.queries[t.rows[0] : t.rows[1]]
        keys = run.keys[t.cols[0] : t.cols[1]]
        equations: list[Equation] = []
        for r, query in enumerate(queries):
            row = t.rows[0] + r
            for c, key in enumerate(keys):
                if not s.allowed[row, t.cols[0] + c]:
                    continue
                score = float(s.scale * s.q[row] @ s.k[t.cols[0] + c])
                lhs = _at("P", "P", query, key)
                equations += self._exp_line(lhs, score, float(s.lse[row]), float(t.p[r, c]))
                equations += self._worked(partial(self._ds_line, t, r, c, query, key))
        for c, key in enumerate(keys):
            k_tex = _tex(key)
            equations.append(
                _eq(
                    Math(
                        f"dV[{key}] += Σ_i P[i, {key}]·dO[i]",
                        rf"dV_{{{k_tex}}} \mathrel{{+}}= \sum_i P_{{i,{k_tex}}}\, dO_i",
                    ),
                    _vec(t.dv[c], p),
                )
            )
            equations.append(
                _eq(
                    Math(
                        f"dK[{key}] += scale·Σ_i dS[i, {key}]·q_i",
                        rf"dK_{{{k_tex}}} \mathrel{{+}}= \mathrm{{scale}} \sum_i "
                        rf"dS_{{i,{k_tex}}}\, q_i",
                    ),
                    _vec(t.dk[c], p),
                )
            )
        for r, query in enumerate(queries):
            equations.append(
                _eq(
                    Math(
                        f"dQ[{query}] += scale·Σ_j dS[{query}, j]·k_j",
                        rf"dQ_{{{_tex(query)}}} \mathrel{{+}}= \mathrm{{scale}} \sum_j "
                        rf"dS_{{{_tex(query)},j}}\, k_j",
                    ),
                    _vec(t.dq[r], p),
                )
            )
        notes = ["dP = dO·V_jᵀ (the table); masked entries have P = 0 and dS = 0."]
        return self.view(
            "accumulator",
            f"Backward tile (query block {t.q_block}, key block {t.k_block}): {t.kind}",
            Math(
                "P = exp(S' − L); dP = dO·V_jᵀ; dS = P ∘ (dP − D)",
                r"P = e^{S' - L},\ dP = dO\, V_j^{\top},\ dS = P \circ (dP - D)",
            ),
            f"Queries {', '.join(queries)} × keys {', '.join(keys)}: the weights again, "
            "from L, and this tile's part of each gradient.",
            table=Table("dP (query \\ key)", tuple(queries), tuple(keys), t.dp),
            equations=tuple(equations),
            notes=(*notes, *self.widened()),
        )


# -- JSON --------------------------------------------------------------------------------------


def _list(x: np.ndarray) -> Any:
    """An array as nested lists, −∞ as the string "-inf" (strict JSON)."""
    if x.ndim == 0:
        value = float(x)
        return value if math.isfinite(value) else ("-inf" if value < 0 else "inf")
    return [_list(item) for item in x]


def tiled_data(run: TiledRun) -> dict[str, Any]:
    """Every number of the run, as JSON-ready data (−∞ as ``"-inf"``)."""
    heads = []
    for h, s in enumerate(run.heads):
        heads.append(
            {
                "kinds": s.kinds.tolist(),
                "forward": [
                    {
                        "query_block": t.q_block,
                        "key_block": t.k_block,
                        "rows": list(t.rows),
                        "cols": list(t.cols),
                        "kind": t.kind,
                        "scores": _list(t.scores),
                        "tile_max": _list(t.tile_max),
                        "running_max": {"old": _list(t.m_old), "new": _list(t.m_new)},
                        "rescale": _list(t.rescale),
                        "p": _list(t.p),
                        "running_sum": {"old": _list(t.l_old), "new": _list(t.l_new)},
                        "accumulator": {"old": _list(t.o_old), "new": _list(t.o_new)},
                    }
                    for t in s.tiles
                ],
                "running_max": _list(s.m),
                "running_sum": _list(s.l),
                "output": _list(s.output),
                "lse": _list(s.lse),
                "max_difference": {
                    "output_vs_reference": float(np.abs(s.output - run.reference[h]).max()),
                    "output_vs_plain": s.output_difference,
                    "lse_vs_plain": s.lse_difference,
                    "gradients_vs_plain": s.gradient_difference,
                },
                "backward": {
                    "d_out": _list(s.d_out),
                    "D": _list(s.delta),
                    "key_block": run.backward_block,
                    "tiles": [
                        {
                            "query_block": t.q_block,
                            "key_block": t.k_block,
                            "rows": list(t.rows),
                            "cols": list(t.cols),
                            "kind": t.kind,
                            "P": _list(t.p),
                            "dP": _list(t.dp),
                            "dS": _list(t.ds),
                            "dQ_part": _list(t.dq),
                            "dK_part": _list(t.dk),
                            "dV_part": _list(t.dv),
                        }
                        for t in s.backward_of(run.backward_block)
                    ],
                    "dQ": _list(s.dq),
                    "dK": _list(s.dk),
                    "dV": _list(s.dv),
                },
            }
        )
    first = run.heads[0]
    return {
        "kind": "tiled-attention",
        "name": run.name,
        "queries": list(run.queries),
        "keys": list(run.keys),
        "block_size": run.block_size,
        "scale": first.scale,
        "mask": run.mask or None,
        "lse_base": "e",
        "heads": heads,
    }


def tiled_json(run: TiledRun) -> str:
    """The run as JSON: every tile's numbers at full float64 precision.

    Example:
        >>> import json
        >>> from qkv import examples
        >>> run = tiled_run(examples.run(examples.builtin("i-love-statistics"), causal=True))
        >>> data = json.loads(tiled_json(run))
        >>> [t["kind"] for t in data["heads"][0]["forward"]]
        ['masked', 'skipped', 'full', 'full']
    """
    text = _json.dumps(tiled_data(run), indent=2, ensure_ascii=False)
    return json_safe(text) + "\n"


def render_tiled(run: TiledRun, format: str, *, precision: int = 4, width: int = 80) -> str:
    """The run in one of :data:`TILED_FORMATS`.

    Raises:
        ValueError: another format, naming the ones there are.
    """
    from qkv.render._latex import render_latex
    from qkv.render._markdown import render_markdown
    from qkv.render._text import narrative_text

    if format == "json":
        return tiled_json(run)
    if format not in TILED_FORMATS:
        raise ValueError(f"format {format!r}: a tiled run is shown as {', '.join(TILED_FORMATS)}.")
    narrative = tiled_narrative(run, precision=precision)
    if format == "text":
        return narrative_text(narrative, width=width)
    if format == "markdown":
        return render_markdown(narrative)
    return render_latex(narrative)
