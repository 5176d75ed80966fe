"""The rows practice mode compares with, per typed row (see :mod:`qkv.render._practice`).

For the row of token t in a step, worked out with ``qkv check``'s own slip reproduction
(:func:`~qkv.check.forward`, :func:`~qkv.check.slips_for`) and judged by
:func:`qkv.check.check`, whose sentences they carry:

- the **slips**: the row each slip that can change it gives from correct earlier numbers, with
  its diagnosis code and sentence (kept only where ``qkv check`` names that slip);
- the **consequential** rows: the row a correct step gives from earlier numbers that carry one
  slip (the finite set of plausible wrong earlier values), with the earlier rows it assumes;
- the **sensitivities**: how far each number moves per unit change of every number of an
  earlier step, summed (finite differences), from which the page computes the rounding the
  learner carried.

A multi-head example is judged as several computations (:class:`View`): the example itself
(Q, K, V, the heads' context vectors side by side, the output) and each head as a
single-head example of its columns (its scores, scaled scores and weights), since ``qkv
check`` judges score rows of one head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkv.check import DIAGNOSES, ROW_STEPS, Setup, Slip, Values, check, forward, slips_for
from qkv.examples import Claimed, Example

__all__ = [
    "INPUTS",
    "SCORE_STEPS",
    "STEPS",
    "Judge",
    "View",
    "candidates",
    "page_feeds",
    "row_of",
    "row_sens",
    "sensitivities",
    "starts_of",
    "views_of",
]

STEPS = ("Q", "K", "V", "scores", "scaled", "weights", "context", "output")
INPUTS = {
    "Q": (),
    "K": (),
    "V": (),
    "scores": ("Q", "K"),
    "scaled": ("scores",),
    "weights": ("scaled",),
    "context": ("weights", "V"),
    "output": ("context",),
}
_DELTA = 1e-6  # the step of the finite differences of the sensitivities
_SAME = 1e-9  # rows closer than this are the same row


@dataclass
class View:
    """One computation the page's steps come from: the example itself, or one head of it
    (a single-head example of that head's columns, which ``qkv check`` can judge score rows
    of). ``head`` is None for the example itself."""

    example: Example
    setup: Setup
    head: int | None
    steps: tuple[str, ...]
    exact: Values = field(init=False)
    slipped: dict[Slip, Values] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.exact = forward(self.setup)

    def key(self, step: str) -> str:
        """The page's name of a step: ``scores/1`` for head 1's scores."""
        return step if self.head is None or step not in SCORE_STEPS else f"{step}/{self.head}"


SCORE_STEPS = ("scores", "scaled", "weights")


def row_of(values: Values, step: str, t: int) -> np.ndarray:
    row: np.ndarray = values[step][t] if step in ROW_STEPS else values[step][0, t]
    return row


def _head_example(example: Example, h: int) -> Example:
    """Head ``h`` of a multi-head example as a single-head example (its columns of W_q, W_k,
    W_v, its rows of W_o): the same scores, weights and context as that head."""
    given = example.given
    d = given.get("Q", example.W_q).shape[1] // example.heads
    dv = given.get("V", example.W_v).shape[1] // example.heads
    cols, vcols = slice(h * d, (h + 1) * d), slice(h * dv, (h + 1) * dv)
    return dataclasses.replace(
        example,
        W_q=example.W_q[:, cols],
        W_k=example.W_k[:, cols],
        W_v=example.W_v[:, vcols],
        W_o=None if example.W_o is None else example.W_o[vcols],
        given={name: value[:, vcols if name == "V" else cols] for name, value in given.items()},
        heads=1,
        queries=None,
        claimed={},
    )


def views_of(example: Example) -> list[View]:
    """The example itself, then (with several heads) each head as an example of its own.

    Example:
        >>> from qkv.examples import builtin
        >>> [(view.head, view.steps) for view in views_of(builtin("two-heads"))][:2]
        [(None, ('Q', 'K', 'V', 'context', 'output')), (0, ('scores', 'scaled', 'weights'))]
    """
    last = ("output",) if example.W_o is not None else ()
    first = ("Q", "K", "V") if example.inputs == "embeddings" else ()
    if example.heads == 1:
        steps = (*first, *SCORE_STEPS, "context", *last)
        return [View(example, Setup.of(example), None, steps)]
    views = [View(example, Setup.of(example), None, (*first, "context", *last))]
    for h in range(example.heads):
        sub = _head_example(example, h)
        views.append(View(sub, Setup.of(sub), h, SCORE_STEPS))
    return views


def _feeds(view: View, step: str, t: int) -> Iterator[tuple[str, int]]:
    """The earlier rows (step, token) the row of ``t`` in ``step`` is computed from."""
    length = view.setup.length
    for source in STEPS[: STEPS.index(step)]:
        if source == "V" and step in SCORE_STEPS:
            continue
        if source in ("K", "V"):
            yield from ((source, u) for u in range(length) if not view.setup.causal or u <= t)
        elif source != "output":
            yield source, t


class Judge:
    """``qkv check`` on one row at a time, its sentences split from the correct line."""

    def __init__(self, view: View, precision: int) -> None:
        self.view = view
        self.decimals = min(max(precision, 2), 8)
        self._correct: dict[tuple[str, int], str] = {}

    def claimed(self, row: np.ndarray) -> Claimed:
        texts = tuple(f"{float(v):.{self.decimals}f}" for v in row)
        return Claimed(values=tuple(float(x) for x in texts), texts=texts)

    def verdict(
        self,
        step: str,
        t: int,
        row: np.ndarray,
        before: dict[str, dict[int, np.ndarray]],
        heads: Sequence[dict[str, dict[int, np.ndarray]]] = (),
    ) -> tuple[str, str | None, str]:
        """(status, diagnosis, sentence) of ``qkv check`` for ``row`` given earlier rows
        (``before``; ``heads``: rows of each head's score steps)."""

        def claims(rows: dict[str, dict[int, np.ndarray]]) -> dict[str, dict[int, Claimed]]:
            return {s: {u: self.claimed(r) for u, r in by.items()} for s, by in rows.items()}

        claimed = claims(before)
        claimed.setdefault(step, {})[t] = self.claimed(row)
        example = dataclasses.replace(
            self.view.example,
            claimed=claimed,
            head_claimed=tuple(claims(rows) for rows in heads),
        )
        finding = next(f for f in check(example).findings if f.step == step and f.position == t)
        correct = self.correct(step, t)
        said = finding.message.removesuffix(" " + correct)
        return finding.status, finding.diagnosis, said

    def correct(self, step: str, t: int) -> str:
        """The sentence ``qkv check`` says about the correct row: what the step is."""
        if (step, t) not in self._correct:
            example = dataclasses.replace(
                self.view.example,
                claimed={step: {t: self.claimed(row_of(self.view.exact, step, t))}},
            )
            (finding,) = check(example).findings
            self._correct[step, t] = finding.message
        return self._correct[step, t]


def _unique(slips: Iterator[Slip]) -> list[Slip]:
    return list(dict.fromkeys(slips))


def starts_of(views: Sequence[View], view: View) -> list[tuple[Slip, Values, Values | None]]:
    """The plausible wrong earlier numbers of a view: each slip made on purpose, with the
    values of every step (and, for a head, those of the whole example when the slip is made
    there). A head takes the slips of Q and K from the whole example (its columns of Q and K
    put in) and makes those of its scores itself."""
    length = view.setup.length
    starts: list[tuple[Slip, Values, Values | None]]
    if view.head is None:
        slips = _unique(
            s for st in view.steps for t in range(length) for s in slips_for(view.setup, st, t)
        )
        starts = [(slip, forward(view.setup, slip), None) for slip in slips]
        return starts
    full = views[0]
    d = view.setup.d_k
    cols = slice(view.head * d, (view.head + 1) * d)
    outer = _unique(
        s for st in ("Q", "K") for t in range(length) for s in slips_for(full.setup, st, t)
    )
    starts = []
    for slip in outer:
        whole = forward(full.setup, slip)
        put = {name: {u: whole[name][u, cols] for u in range(length)} for name in ("Q", "K")}
        starts.append((slip, forward(view.setup, None, put), whole))
    inner = _unique(
        s for st in SCORE_STEPS for t in range(length) for s in slips_for(view.setup, st, t)
    )
    starts += [
        (slip, forward(view.setup, slip), None)
        for slip in inner
        if slip.code not in ("wrong-query", "transposed-weights")
    ]
    return starts


def _changed(
    view: View, values: Values, step: str, t: int
) -> list[tuple[str, int | None, int, np.ndarray]]:
    """The earlier rows feeding the row of ``t`` in ``step`` that a slip changed: (step,
    head or None, token, row); with several heads, score rows are each head's own."""
    split = view.head is None and view.setup.heads > 1
    found: list[tuple[str, int | None, int, np.ndarray]] = []
    for s, u in _feeds(view, step, t):
        if split and s in SCORE_STEPS:
            for h in range(view.setup.heads):
                if _differs(values[s][h, u], view.exact[s][h, u]):
                    found.append((s, h, u, values[s][h, u]))
        elif _differs(row_of(values, s, u), row_of(view.exact, s, u)):
            found.append((s, None, u, row_of(values, s, u)))
    return found


def _floats(row: np.ndarray) -> list[float]:
    return [float(x) for x in row]


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.max(np.abs(a - b), initial=0.0) > _SAME)


def _page_row(view: View, step: str, u: int, values: Values, whole: Values | None) -> list[float]:
    """An earlier row as the page holds it: Q and K of a head are the whole example's rows
    (the learner types all heads side by side), as the slip made them in ``whole``."""
    row = row_of(whole if view.head is not None and whole is not None else values, step, u)
    return [float(x) for x in row]


def candidates(
    views: Sequence[View],
    view: View,
    judge: Judge,
    starts: list[tuple[Slip, Values, Values | None]],
    step: str,
    t: int,
) -> list[dict[str, Any]]:
    """Every row the page compares a typed row of ``t`` in ``step`` with, besides the correct
    one: the slips of this step, then correct steps on earlier numbers that carry a slip."""
    exact = row_of(view.exact, step, t)
    seen: list[np.ndarray] = [exact]
    out: list[dict[str, Any]] = []
    for slip in slips_for(view.setup, step, t):
        if slip not in view.slipped:
            view.slipped[slip] = forward(view.setup, slip)
        row = row_of(view.slipped[slip], step, t)
        if any(not _differs(row, other) for other in seen):
            continue
        seen.append(row)
        status, code, said = judge.verdict(step, t, row, {})
        if status != "mismatch" or code is None or code == "arithmetic":
            continue  # qkv check would not name this slip (e.g. rounded away)
        out.append({"kind": "slip", "code": code, "values": [float(x) for x in row], "says": said})
    heads = view.setup.heads if view.head is None else 1
    for slip, values, whole in starts:
        row = row_of(values, step, t)
        if not _differs(row, exact) or any(
            c["kind"] == "consequential" and not _differs(row, np.array(c["values"])) for c in out
        ):
            continue
        changed = _changed(view, values, step, t)
        if not changed:
            continue
        # qkv check is given the nearest rows (the step's own inputs); the page is given every
        # earlier row the slip changed, to compare with the learner's own.
        before: dict[str, dict[int, np.ndarray]] = {}
        per_head: list[dict[str, dict[int, np.ndarray]]] = [{} for _ in range(heads)]
        for s, h, u, value in changed:
            if s in INPUTS[step]:
                (before if h is None else per_head[h]).setdefault(s, {})[u] = value
        status, code, said = judge.verdict(step, t, row, before, per_head if heads > 1 else ())
        if status != "consequential":
            continue
        out.append(
            {
                "kind": "consequential",
                "code": slip.code,
                "values": [float(x) for x in row],
                "says": said,
                "inputs": [
                    [
                        view.key(s) if h is None else f"{s}/{h}",
                        u,
                        _page_row(view, s, u, values, whole) if h is None else _floats(value),
                    ]
                    for s, h, u, value in changed
                ],
            }
        )
    order = {code: k for k, code in enumerate(DIAGNOSES)}
    slips = sorted((c for c in out if c["kind"] == "slip"), key=lambda c: order.get(c["code"], 99))
    return slips + [c for c in out if c["kind"] == "consequential"]


def sensitivities(view: View) -> dict[tuple[str, str], np.ndarray]:
    """(step, earlier step) → per row and number, Σ over the earlier step's numbers of how
    far this number moves per unit change of that one (finite differences)."""
    found: dict[tuple[str, str], np.ndarray] = {}
    sources = (
        "Q",
        "K",
        "V",
        *(SCORE_STEPS if view.head is not None or view.setup.heads == 1 else ()),
        "context",
    )
    length = view.setup.length
    for source in sources:
        for u in range(length):
            base = row_of(view.exact, source, u)
            for i in range(base.size):
                moved = base.copy()
                moved[i] += _DELTA
                values = forward(view.setup, None, {source: {u: moved}})
                for step in STEPS[STEPS.index(source) + 1 :]:
                    change = np.abs(values[step] - view.exact[step]) / _DELTA
                    change = change if step in ROW_STEPS else change[0]
                    key = (step, source)
                    found[key] = found.get(key, 0) + change
    return found


def page_feeds(view: View, heads: int, step: str, t: int) -> list[list[Any]]:
    out: list[list[Any]] = []
    for source, u in _feeds(view, step, t):
        if view.head is None and heads > 1 and source in SCORE_STEPS:
            out += [[f"{source}/{h}", u] for h in range(heads)]
        else:
            out.append([view.key(source), u])
    return out


def row_sens(
    views: Sequence[View],
    view: View,
    sens: list[dict[tuple[str, str], np.ndarray]],
    step: str,
    t: int,
) -> dict[str, list[float]]:
    """Per earlier page step, the sensitivity of each number of this row (see the module)."""
    own = sens[views.index(view)]
    out: dict[str, list[float]] = {}
    for source in STEPS[: STEPS.index(step)]:
        if (step, source) in own and not (
            view.head is None and len(views) > 1 and source in SCORE_STEPS
        ):
            out[view.key(source)] = [round(float(x), 9) for x in own[step, source][t]]
    if view.head is None and len(views) > 1 and step in ("context", "output"):
        width = view.exact[step].shape[1]
        for head_view in views[1:]:
            theirs = sens[views.index(head_view)]
            for source in SCORE_STEPS:
                row = np.zeros(width)
                part = theirs[step, source][t]
                if step == "context":
                    h = head_view.head or 0
                    row[h * part.size : (h + 1) * part.size] = part
                else:
                    row = part
                out[head_view.key(source)] = [round(float(x), 9) for x in row]
    return out
