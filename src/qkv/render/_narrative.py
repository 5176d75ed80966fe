"""Build the :class:`~qkv.render._model.Narrative` of a trace: the one place that decides what
a learner is shown. The renderers (text, Markdown, LaTeX) only lay it out.

For each step, in the order it was computed: a title in the seeds' words, its formula, one
line on what it means, a table with token labels, and worked lines where they teach something
(the dot product of a query with each key, the softmax of one score, every context vector
as the weighted sum of the value vectors). Worked lines are printed only after checking that
they reproduce the recorded numbers, so a renderer never shows arithmetic that is not true.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from qkv._format import latex_escape, latex_visible, number, visible
from qkv.render._model import Equation, Fact, Math, Narrative, Section, StepView, Table
from qkv.render._vocabulary import TITLES, latex_formula, meaning, plain_formula
from qkv.render._worked import WorkedLines
from qkv.steps import LAYER_INPUT, WORDS
from qkv.trace import Step, Trace, TraceCall

__all__ = ["TITLES", "narrate"]

_MATRIX_AXES = ("query", "key", "token", "model", "dim", "feature")


def narrate(trace: Trace, *, precision: int = 4) -> Narrative:
    """The narrative of a trace: header facts and the steps, grouped by head.

    Args:
        trace: a recorded :class:`qkv.Trace` (e.g. from ``with qkv.tracing() as t:``).
        precision: decimals of every number shown (0 to 15).

    Raises:
        ValueError: ``precision`` out of range, or a trace without steps.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> n = narrate(t, precision=2)
        >>> [step.title for step in n.sections[0].steps][4:8]
        ['Query vectors', 'Key vectors', 'Value vectors', 'Attention scores']
    """
    if not isinstance(precision, int) or not 0 <= precision <= 15:
        raise ValueError(f"precision must be an integer from 0 to 15, got {precision!r}.")
    if not trace.steps:
        raise ValueError(
            "the trace has no steps to show. Hint: record one with `with qkv.tracing() as t:` "
            "around an attention call, or pass trace=qkv.Trace()."
        )
    calls = trace_calls(trace)
    builders = [_CallBuilder(trace, call, precision) for call in calls]
    sections: list[Section] = []
    for index, builder in enumerate(builders):
        prefix = ""
        if len(calls) > 1:
            layer = calls[index].layer
            prefix = f"Call {index} of {len(calls)} calls"  # counted from 0, as everywhere
            prefix += f" ({layer})" if layer else ""
            if builder.batch and builder.batch > 1:
                prefix += f", batch element 0 of {builder.batch}"
        sections.extend(builder.sections(prefix))
    meta = trace.meta
    return _visible(
        Narrative(
            title=str(meta.get("name") or "Attention, step by step"),
            description=_description(trace, builders[-1]),
            facts=tuple(builders[-1].facts()),
            sections=tuple(sections),
            precision=precision,
        )
    )


def _visible(n: Narrative) -> Narrative:
    """The narrative with every control character of every string written out visibly
    (tokens, names, layer and step names come from files anyone may write)."""

    def math(m: Math) -> Math:
        return Math(visible(m.plain), latex_visible(m.latex))

    def step(view: StepView) -> StepView:
        table = view.table
        if table is not None:
            table = dataclasses.replace(
                table,
                corner=visible(table.corner),
                rows=tuple(visible(r) for r in table.rows),
                columns=tuple(visible(c) for c in table.columns),
            )
        return dataclasses.replace(
            view,
            title=visible(view.title),
            formula=math(view.formula),
            meaning=visible(view.meaning),
            table=table,
            equations=tuple(
                Equation(tuple(tuple(math(t) for t in side) for side in eq.sides))
                for eq in view.equations
            ),
            notes=tuple(visible(note) for note in view.notes),
        )

    return Narrative(
        title=visible(n.title),
        description=visible(n.description, newlines=True),
        facts=tuple(
            Fact(visible(f.label), visible(f.plain), latex_visible(f.latex)) for f in n.facts
        ),
        sections=tuple(
            Section(None if s.title is None else visible(s.title), tuple(step(v) for v in s.steps))
            for s in n.sections
        ),
        precision=n.precision,
    )


def _description(trace: Trace, builder: _CallBuilder) -> str:
    """The example's description; when ``--query`` shows other queries than the ones it was
    written for, a sentence says which are shown, so that the text matches the tables."""
    meta = trace.meta
    text = str(meta.get("description") or "")
    own, wanted = meta.get("example_queries"), meta.get("queries")
    if not text or wanted is None or not isinstance(own, list) or list(wanted) == own:
        return text
    shown = builder.queries if builder.queries is not None else []
    names = [f'"{builder.query_labels[i]}"' for i in shown]
    if not names:
        return text
    plural = "queries" if len(names) > 1 else "query"
    return f"{text} Shown here for the {plural} {_and(names)} instead."


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def trace_calls(trace: Trace) -> list[TraceCall]:
    """The attention calls of a trace, as the trace recorded them (:attr:`Trace.calls`): each
    with its steps (``call.steps``), its layer and its facts (``call.meta``). Every renderer
    reads a trace's calls from here, never by guessing where one call ends."""
    return trace.calls


def call_facts(trace: Trace, call: TraceCall) -> dict[str, Any]:
    """The facts of one call (scale, causality, mask, heads, ...): the call's own
    (``call.meta``) over the trace's (``trace.meta``: the example's name and ``d_model``, and
    the facts of a trace built by hand, whose calls recorded none)."""
    return {**trace.meta, **call.meta}


def _size(steps: Sequence[Step], axis: str) -> int | None:
    for step in steps:
        if axis in step.axes:
            return int(step.value.shape[step.axes.index(axis)])
    return None


def _labels(given: Sequence[str] | None, n: int, prefix: str) -> list[str]:
    """Token labels, with repeated tokens told apart by their 0-based position (``the#4``);
    control characters are written out (:func:`~qkv._format.visible`)."""
    if given is None or len(given) != n:
        return [f"{prefix}{i}" for i in range(n)]
    counts: dict[str, int] = {}
    for token in given:
        counts[token] = counts.get(token, 0) + 1
    return [
        visible(f"{token}#{i}" if counts[token] > 1 or not token else token)
        for i, token in enumerate(given)
    ]


def _labels_at(given: Sequence[str], positions: Sequence[int]) -> list[str]:
    """Labels of rows kept from a longer sequence: repeated (or empty) ones are told apart by
    their original 0-based position (``the#4``), as :func:`_labels` does for a whole one."""
    counts: dict[str, int] = {}
    for token in given:
        counts[token] = counts.get(token, 0) + 1
    return [
        visible(f"{token}#{i}" if counts[token] > 1 or not token else token)
        for token, i in zip(given, positions, strict=True)
    ]


def _index(steps: Sequence[Step], axis: str) -> list[int] | None:
    """The original index of each entry kept along ``axis`` (``Step.index``), or None when no
    step of the call was sliced along it."""
    for step in steps:
        if step.index and axis in step.index and axis in step.axes:
            return [int(i) for i in step.index[axis]]
    return None


def _derived_query_tokens(trace: Trace, rows: Sequence[int]) -> bool:
    """Whether ``trace.query_tokens`` only names the query rows a selection kept (what
    ``qkv.tracing(queries=...)`` writes: the token or ``t<i>`` of each row), so the queries
    are the tokens themselves (self-attention) and are labelled from ``trace.tokens``."""
    given, tokens = trace.query_tokens, trace.tokens
    if given is None:
        return True
    if len(given) != len(rows):
        return False
    return all(
        label == f"t{i}" or (tokens is not None and i < len(tokens) and label == tokens[i])
        for label, i in zip(given, rows, strict=True)
    )


def query_labels(trace: Trace, lq: int, rows: Sequence[int] | None) -> list[str]:
    """The labels of the ``lq`` query rows of a call; ``rows`` are their original positions
    when the trace kept only some (``Step.index["query"]``), else None.

    A kept row is labelled by its original position's token (``trace.query_tokens`` when it
    labels every query or just the kept ones, else ``trace.tokens``), or ``t<position>``.
    """
    if rows is None or len(rows) != lq or lq == 0:
        query_tokens = trace.query_tokens or trace.tokens
        return _labels(query_tokens, lq, "q" if trace.query_tokens else "t")
    given, tokens = trace.query_tokens, trace.tokens
    if given is not None and not _derived_query_tokens(trace, rows):
        if len(given) == len(rows):  # labels of the kept rows (cross-attention)
            return _labels_at(given, rows)
        if len(given) > max(rows):  # labels of every query row
            whole = _labels(given, len(given), "q")
            return [whole[i] for i in rows]
        return [f"q{i}" for i in rows]
    if tokens is not None and len(tokens) > max(rows):
        whole = _labels(tokens, len(tokens), "t")
        return [whole[i] for i in rows]
    return [f"t{i}" for i in rows]


def query_position(wanted: object, labels: Sequence[str], rows: Sequence[int] | None) -> int | None:
    """The row (0-based, in the recorded values) of a query asked for by its label or by its
    0-based position; with ``rows`` (a selection), a position is an original one (``-1`` the
    last kept row). None: no such query."""
    lq = len(labels)
    if isinstance(wanted, str) and visible(wanted) in labels:
        return labels.index(visible(wanted))
    if not isinstance(wanted, int) or isinstance(wanted, bool) or lq == 0:
        return None
    if rows is not None and len(rows) == lq and wanted >= 0:
        return list(rows).index(wanted) if wanted in rows else None
    return wanted % lq if -lq <= wanted < lq else None


class Heads:
    """The heads of one attention call as recorded, and the original numbers of each.

    Attributes:
        count: query heads recorded (the size of the ``head`` axis; 1 without one).
        kv_count: key/value heads recorded (the size of the ``kv_head`` axis).
        numbers: the original 0-based number of each recorded head (``Step.index``).
        total, kv_total: the heads and key/value heads of the call (None: unknown).
        kv_numbers: the original 0-based key/value head of each recorded head (None: unknown).
        selected: only some heads were recorded (``qkv.tracing(heads=...)``).
    """

    total: int | None
    kv_total: int | None
    kv_numbers: list[int] | None

    def __init__(self, trace: Trace, call: TraceCall) -> None:
        steps = call.steps
        self.count = _size(steps, "head") or 1
        kv_size = _size(steps, "kv_head")  # None: no key/value step recorded
        self.kv_count = kv_size or self.count
        index, kv_index = _index(steps, "head"), _index(steps, "kv_head")
        if index is None or len(index) != self.count:
            # the whole call: positions are head numbers (as before any selection existed)
            self.numbers = list(range(self.count))
            self.total, self.kv_total = self.count, self.kv_count
            if kv_size is None:  # no K or V step to count them: the call's facts say
                total, kv = _head_totals(trace, call, [self.count - 1])
                self.kv_total = kv if total == self.count and kv else self.count
            per = max(1, self.count // self.kv_total)
            self.kv_numbers = [h // per for h in range(self.count)]
            self._kv_rows = list(self.kv_numbers) if kv_size else [0] * self.count
            self.selected = False
            return
        self.numbers = index
        self.total, self.kv_total = _head_totals(trace, call, index)
        if kv_size is not None and kv_index is None:
            # K and V kept whole hold every key/value head: their count is the call's,
            # whatever the facts say (older files gave the counts of the rows recorded)
            self.kv_total = kv_size
        group = (
            self.total // self.kv_total
            if self.total and self.kv_total and self.total % self.kv_total == 0
            else None
        )
        if kv_index is not None and len(kv_index) == self.count:
            self.kv_numbers, self._kv_rows = kv_index, list(range(self.count))
        elif group is not None:
            self.kv_numbers = [h // group for h in index]
            whole = self.kv_count == self.kv_total  # key/value steps kept whole
            self._kv_rows = list(self.kv_numbers) if whole else [0] * self.count
        else:
            self.kv_numbers, self._kv_rows = None, [0] * self.count
        self.selected = self.total is None or index != list(range(self.total))

    @property
    def grouped(self) -> bool:
        """Whether key/value heads are shared by several query heads (GQA or MQA)."""
        return self.kv_total is not None and self.kv_total != self.total

    def select(self, step: Step, position: int) -> np.ndarray:
        """The 2-D (or 1-D) value of ``step`` for the recorded head at ``position``, batch 0."""
        if "kv_head" in step.axes:
            return step.select(head=self._kv_rows[position], batch=0, group_size=1)
        return step.select(head=position, batch=0)

    def title(self, position: int) -> str:
        """``Head 2 of 4 heads (key/value head 1 of 2)``: the original numbers, counted from
        0 as ``qkv.tracing(heads=...)`` and ``--head`` count them, and the call's counts."""
        of = f" of {self.total} heads" if self.total else ""
        name = f"Head {self.numbers[position]}{of}"
        if self.grouped and self.kv_numbers is not None:
            name += f" (key/value head {self.kv_numbers[position]} of {self.kv_total})"
        return name

    def split(self, steps: Sequence[Step]) -> tuple[int, int] | None:
        """The first and last positions of the per-head steps when the call is shown head by
        head (several heads, or heads chosen by a selection), else None."""
        per_head = [i for i, s in enumerate(steps) if {"head", "kv_head"} & set(s.axes)]
        if not per_head or (self.count == 1 and not self.selected):
            return None
        return per_head[0], per_head[-1]


def _head_totals(
    trace: Trace, call: TraceCall, index: Sequence[int]
) -> tuple[int | None, int | None]:
    """The heads and key/value heads of a call recorded with a head selection: from the
    call's facts, else the module's (``meta["layers"]``), else the trace's meta when it fits
    the selection."""
    layers = trace.meta.get("layers")
    layer = call.layer
    sources = [
        call.meta,
        layers.get(layer) if isinstance(layers, Mapping) and layer else None,
        trace.meta,
    ]
    for source in sources:
        if not isinstance(source, Mapping):
            continue
        total, kv = source.get("num_heads"), source.get("num_kv_heads")
        if isinstance(total, int) and not isinstance(total, bool) and total > max(index):
            kv_ok = isinstance(kv, int) and not isinstance(kv, bool) and 0 < kv <= total
            return total, kv if kv_ok else total
    return None, None


class _CallBuilder:
    """The sections of one attention call (one multi_head_attention or SDPA run)."""

    def __init__(self, trace: Trace, call: TraceCall, precision: int) -> None:
        self.trace = trace
        self.call = call
        self.meta = call_facts(trace, call)
        self.steps = steps = list(call.steps)
        self.p = precision
        self.head = Heads(trace, call)
        self.heads = self.head.count
        self.batch = _size(steps, "batch")
        # steps are numbered in the order they ran (a call with a bias and a score
        # modifier records two ``bias`` steps: each has its own number)
        self.numbers = {id(step): number for number, step in enumerate(steps, start=1)}
        lq = _size(steps, "query")
        lk = _size(steps, "key")
        tokens = trace.tokens
        # a selection keeps some query rows: each is labelled by its original position
        self.query_rows = _index(steps, "query")
        self.query_labels = query_labels(trace, lq or 0, self.query_rows)
        self.derived = self.query_rows is not None and _derived_query_tokens(trace, self.query_rows)
        query_tokens = tokens if self.derived else trace.query_tokens or tokens
        self.key_labels = _labels(tokens, lk or 0, "t")
        self.token_labels = _labels(query_tokens, _size(steps, "token") or 0, "t")
        self.queries = self._shown_queries(lq)
        self.worked = self._worked_query(lq or 0)
        self.scale = self._call_scale()
        self.work = WorkedLines(
            self.query_labels,
            self.key_labels,
            self.queries,
            self.worked,
            self.scale,
            precision,
            self.query_rows,
        )

    def _call_scale(self) -> tuple[float | None, str | None, int | None]:
        """(scale, scale_mode, d_k) of this call: its facts when its scores and scaled scores
        agree with them, else read from the numbers (a call of a version-1 file other than
        the last kept no facts)."""
        meta = self.meta
        scale, mode = meta.get("scale"), meta.get("scale_mode")
        d_k = _last_dim(self.steps, "Q") or meta.get("d_k")
        scores = next((s.value for s in self.steps if s.name == "scores"), None)
        scaled = next((s.value for s in self.steps if s.name == "scaled"), None)
        if scores is None or scaled is None or scores.shape != scaled.shape or not scores.size:
            return (None if scale is None else float(scale)), mode, d_k
        at = np.unravel_index(np.argmax(np.abs(scores)), scores.shape)
        if scores[at] == 0:
            return (None if scale is None else float(scale)), mode, d_k
        ratio = float(scaled[at] / scores[at])
        if scale is not None and math.isclose(ratio, float(scale), rel_tol=1e-5):
            return float(scale), mode, d_k
        if d_k and math.isclose(ratio, 1 / math.sqrt(d_k), rel_tol=1e-5):
            return 1 / math.sqrt(d_k), "sqrt_dk", d_k
        if math.isclose(ratio, 1.0, rel_tol=1e-5):
            return 1.0, "none", d_k
        return ratio, "custom", d_k

    def _worked_query(self, lq: int) -> int:
        """The query whose dot products and softmax are written out: the shown query with the
        most keys it may attend to (the first shown one when nothing is masked)."""
        shown = self._shown(lq) or [0]
        masked = next((s for s in self.steps if s.name == "masked"), None)
        if masked is None:
            return shown[0]
        allowed = np.isfinite(self.head.select(masked, 0))
        if allowed.ndim != 2 or allowed.shape[0] != lq:
            return shown[0]
        counts = allowed.sum(axis=1)
        return max(shown, key=lambda i: (counts[i], -i))

    # -- header ----------------------------------------------------------------------------

    def _shown_queries(self, lq: int | None) -> list[int] | None:
        wanted = self.trace.meta.get("queries")
        if wanted is None or lq is None:
            return None
        shown: list[int] = []
        for q in wanted if isinstance(wanted, list | tuple) else [wanted]:
            row = query_position(q, self.query_labels, self.query_rows)
            if row is None:
                return None  # a selection that does not fit this call: show every query
            shown.append(row)
        return shown if shown and shown != list(range(lq)) else None

    def facts(self) -> list[Fact]:
        meta, steps = self.meta, self.steps
        facts: list[Fact] = []
        query_tokens = None if self.derived else self.trace.query_tokens
        if self.trace.tokens:
            tokens = list(self.trace.tokens)
            label = "tokens" if not query_tokens else "key tokens"
            facts.append(_list_fact(label, tokens))
            if query_tokens:
                facts.append(_list_fact("query tokens", list(query_tokens)))
        d_model = meta.get("d_model") or _size(steps, "model")
        if d_model:
            facts.append(Fact("d_model", str(d_model), str(d_model)))
        d_k = _last_dim(steps, "Q") or meta.get("d_k")
        d_v = _last_dim(steps, "V") or meta.get("d_v")
        if d_k:
            value = str(d_k) if not d_v or d_v == d_k else f"{d_k} (d_v = {d_v})"
            facts.append(Fact("d_k", value, latex_escape(value)))
        facts.append(self._heads_fact())
        scale = self._scale_fact()
        if scale is not None:
            facts.append(scale)
        if meta.get("causal"):
            text = "causal: each token attends only to itself and the tokens before it"
            facts.append(Fact("mask", text, latex_escape(text)))
        elif meta.get("mask"):
            text = _mask_text(str(meta["mask"]), steps)
            facts.append(Fact("mask", text, latex_escape(text)))
        sink = self._sink_fact()
        if sink is not None:
            facts.append(sink)
        queries = self._queries_fact()
        if queries is not None:
            facts.append(queries)
        if self.batch and self.batch > 1:
            text = f"element 0 of {self.batch} shown"
            facts.append(Fact("batch", text, text))
        return facts

    def _queries_fact(self) -> Fact | None:
        """The queries shown (``love (1 of 3 shown)``) and the rows a selection recorded, named
        by their table labels as the trace's description names them (``recorded: rows a and
        e``; ``the#4`` for a repeated token, ``t4`` without tokens), or None when every query
        is shown."""
        plain: list[str] = []
        latex: list[str] = []
        if self.queries is not None:
            names = [self.query_labels[i] for i in self.queries]
            shown = f" ({len(names)} of {len(self.query_labels)} shown)"
            plain.append(", ".join(names) + shown)
            latex.append(", ".join(latex_escape(n) for n in names) + shown)
        if self.query_rows is not None and self.query_labels:
            plain.append(f"recorded: rows {_and(self.query_labels)}")
            latex.append(f"recorded: rows {_and([latex_escape(n) for n in self.query_labels])}")
        if not plain:
            return None
        return Fact("queries", "; ".join(plain), "; ".join(latex))

    def _sink_fact(self) -> Fact | None:
        """``this row (love) gives 0.12 of its attention to the sink``: the worked query's
        share of attention given to the sink, per recorded head (the call's ``sink`` meta,
        recorded with ``sinks=``), or None without a sink."""
        sink = self.meta.get("sink")
        if not isinstance(sink, dict) or "share" not in sink:
            return None
        try:
            share = np.asarray(sink["share"], dtype=float)
            axes = list(sink.get("axes") or [])
            if "batch" in axes:
                share = np.take(share, 0, axis=axes.index("batch"))
                axes.remove("batch")
            if "head" not in axes:
                share = share[None]
            rows = share.reshape(share.shape[0], -1)  # (recorded heads, recorded rows)
            worked = self.worked if self.worked < rows.shape[1] else 0
            label = self.query_labels[worked] if worked < len(self.query_labels) else None
        except (ValueError, TypeError, IndexError):
            return None  # a sink entry that does not fit the steps: say nothing
        row = f"this row ({label})" if label else "this row"
        parts = []
        for position in range(min(rows.shape[0], 4)):
            given = number(float(rows[position, worked]), 2)
            head = ""
            if rows.shape[0] > 1 and position < len(self.head.numbers):
                head = f"head {self.head.numbers[position]}: "
            parts.append(f"{head}{row} gives {given} of its attention to the sink")
        if rows.shape[0] > 4:
            parts.append("…")
        text = "; ".join(parts)
        return Fact("sink", text, latex_escape(text))

    def _heads_fact(self) -> Fact:
        """``4 (2 key/value heads: grouped-query attention)``, and which were recorded, named
        as the sections' titles name them (``recorded: head 1 and head 3``)."""
        head = self.head
        parts = []
        if head.total:
            text = str(head.total)
            if head.grouped:
                kind = "multi-query" if head.kv_total == 1 else "grouped-query"
                text += f" ({head.kv_total} key/value heads: {kind} attention)"
            parts.append(text)
        if head.selected:
            parts.append(f"recorded: {_and([f'head {h}' for h in head.numbers])}")
        text = "; ".join(parts)
        return Fact("heads", text, latex_escape(text))

    def _scale_fact(self) -> Fact | None:
        scale, mode, d_k = self.scale
        if scale is None:
            return None
        value = number(float(scale), self.p)
        if d_k and abs(float(scale) * d_k**0.5 - 1.0) <= 1e-6:
            mode = "sqrt_dk"  # a scale passed explicitly (a model's own) that is 1/√d_k
        if mode == "sqrt_dk" and d_k:
            plain = f"scaled by 1/√d_k = 1/√{d_k} = {value}"
            latex = rf"scaled by $1/\sqrt{{d_k}} = 1/\sqrt{{{d_k}}} = {value}$"
        elif mode == "none" or float(scale) == 1.0:
            plain = latex = "not scaled (scale = 1)"
        else:
            plain = f"scaled by {value} (a custom scale)"
            latex = f"scaled by ${value}$ (a custom scale)"
        return Fact("scale", plain, latex)

    # -- sections --------------------------------------------------------------------------

    def sections(self, prefix: str) -> list[Section]:
        def title(text: str | None) -> str | None:
            if prefix and text:
                return f"{prefix}: {text}"
            return prefix or text

        split = self.head.split(self.steps)
        if split is None:
            return [Section(title(None), tuple(self._views(self.steps, head=0)))]
        first, last = split
        before, middle, after = (
            self.steps[:first],
            self.steps[first : last + 1],
            self.steps[last + 1 :],
        )
        sections: list[Section] = []
        if before:
            sections.append(Section(title("Inputs"), tuple(self._views(before, head=0))))
        for h in range(self.heads):
            name = self.head.title(h)
            sections.append(Section(title(name), tuple(self._views(middle, head=h))))
        if after:
            sections.append(
                Section(title("Combining the heads"), tuple(self._views(after, head=0)))
            )
        return sections

    def _views(self, steps: Sequence[Step], *, head: int) -> list[StepView]:
        seen: dict[str, np.ndarray] = {}
        views = []
        for step in steps:
            value = np.asarray(self.head.select(step, head))
            axes = tuple(a for a in step.axes if a in _MATRIX_AXES)
            if value.ndim == 2 and len(axes) == 2:
                seen[step.name] = value.astype(np.float64)
            equations, notes = self.work.for_step(step.name, seen)
            views.append(
                StepView(
                    name=step.name,
                    number=self.numbers[id(step)],
                    title=self._title(step),
                    formula=Math(plain_formula(step), self._latex_formula(step)),
                    meaning=self._meaning(step),
                    table=self._table(step, value, axes),
                    equations=tuple(equations),
                    notes=tuple(notes),
                )
            )
        return views

    def _layer_input(self, step: Step) -> bool:
        """Whether ``step`` is the input a model's layer recorded (not token embeddings)."""
        return step.name == "embeddings" and self.call.layer is not None

    def _title(self, step: Step) -> str:
        return LAYER_INPUT.title if self._layer_input(step) else TITLES.get(step.name, step.name)

    def _meaning(self, step: Step) -> str:
        """The step's meaning; for the scaling step, what this run did; for a layer's input,
        what a layer reads (unless the step says it itself)."""
        if self._layer_input(step) and step.description in ("", WORDS["embeddings"].description):
            return meaning(replace(step, description=LAYER_INPUT.description))
        _, mode, _ = self.scale
        if step.name == "scaled" and mode == "none":
            return (
                "Not scaled in this run: S' = S. Dividing by √d_k would keep the softmax "
                "from becoming too sharp when d_k is large."
            )
        if step.name == "scaled" and mode == "custom":
            return "Scores multiplied by a chosen scale instead of 1/√d_k."
        return meaning(step)

    def _latex_formula(self, step: Step) -> str:
        name = step.name
        scale, mode, d_k = self.scale
        if name == "scaled" and scale is not None:
            if mode == "sqrt_dk" and d_k:
                return (
                    rf"S' = \frac{{S}}{{\sqrt{{d_k}}}} = \frac{{S}}{{\sqrt{{{d_k}}}}} "
                    rf"= S \times {float(scale):.4g}"
                )
            if mode == "none" or float(scale) == 1.0:
                return r"S' = S \quad \text{(no scaling)}"
            return rf"S' = S \times {float(scale):.4g}"
        if name in ("concat", "output"):
            last = self.head.total - 1 if self.head.total else "h-1"
            concat = rf"\operatorname{{concat}}(C_0, \dots, C_{{{last}}})"
            return concat if name == "concat" else rf"O = {concat}\, W_o"
        return latex_formula(step) or r"\text{" + latex_escape(name) + "}"

    # -- tables ----------------------------------------------------------------------------

    def _axis_labels(self, axis: str, n: int, step: str) -> list[str]:
        if axis == "query":
            return self.query_labels if len(self.query_labels) == n else _labels(None, n, "q")
        if axis == "key":
            return self.key_labels if len(self.key_labels) == n else _labels(None, n, "k")
        if axis == "token":
            return self.token_labels if len(self.token_labels) == n else _labels(None, n, "t")
        if axis == "model":
            return [f"e{i + 1}" for i in range(n)]
        if axis == "feature":
            # every head's columns are recorded, even when only some heads were selected
            groups = (self.head.kv_total if step in ("W_k", "W_v") else self.head.total) or 1
            if groups > 1 and n % groups == 0:
                per = n // groups
                return [f"h{i // per}.d{i % per + 1}" for i in range(n)]
        return [f"d{i + 1}" for i in range(n)]

    def _table(self, step: Step, value: np.ndarray, axes: tuple[str, ...]) -> Table:
        values = value.astype(np.float64)
        if values.ndim == 0 or len(axes) == 0:
            return Table(step.name, (step.name,), ("value",), values.reshape(1, 1))
        if values.ndim == 1 or len(axes) == 1:
            columns = self._axis_labels(axes[-1], values.shape[-1], step.name)
            return Table(step.name, (step.name,), tuple(columns), values.reshape(1, -1))
        values = values.reshape(-1, values.shape[-1])
        rows = self._axis_labels(axes[0], values.shape[0], step.name)
        columns = self._axis_labels(axes[-1], values.shape[1], step.name)
        if axes[0] == "query" and self.queries is not None:
            values = values[self.queries]
            rows = [rows[i] for i in self.queries]
        if axes[0] in ("query", "key", "token"):
            corner = f"{axes[0]} \\ key" if axes[-1] == "key" else axes[0]
        else:
            corner = step.name
        sums = None
        if step.name == "weights":
            sums = np.where(np.isfinite(values), values, 0.0).sum(axis=1)
        return Table(corner, tuple(rows), tuple(columns), values, sums)

    # -- worked lines ----------------------------------------------------------------------

    def _shown(self, n: int) -> list[int]:
        return list(self.queries) if self.queries is not None else list(range(n))


_RULE_WORDS = (
    (re.compile(r"causal\('(top-left|bottom-right)'\)"), r"causal (\1)"),
    (re.compile(r"key_padding\(\[([0-9, ]*)\]\)"), r"key padding (lengths \1)"),
)


def _mask_text(described: str, steps: Sequence[Step]) -> str:
    """What the mask of a call is, in words: ``causal (top-left)``, ``key padding (lengths
    3, 5)``, or for a boolean array what its pattern is (read from the masked scores)."""
    if not described.startswith("boolean array"):
        for pattern, words in _RULE_WORDS:
            described = pattern.sub(words, described)
        return described
    masked = next((s for s in steps if s.name == "masked"), None)
    if masked is None or not {"query", "key"} <= set(masked.axes):
        return "a boolean mask"
    value = np.asarray(masked.value)
    axes = list(masked.axes)
    if "head" in axes:  # a boolean mask is the same for every head: look at the first
        value = np.take(value, 0, axis=axes.index("head"))
        axes.remove("head")
    allowed = np.isfinite(value).reshape(-1, value.shape[axes.index("query")], value.shape[-1])
    lk = allowed.shape[-1]
    if all((a == a[:1]).all() for a in allowed):  # every query sees the same keys: padding
        rows = [a[0] for a in allowed]
        lengths = [int(r.sum()) for r in rows]
        if all(r[:n].all() for r, n in zip(rows, lengths, strict=True)):
            if all(n == lk for n in lengths):
                return "a boolean mask; it blocks no key here"
            listed = ", ".join(map(str, lengths))
            return f"key padding (length{'s' * (len(lengths) > 1)} {listed} of {lk} keys)"
        if len(lengths) == 1:
            return f"a boolean mask: {lk - lengths[0]} of {lk} keys blocked for every query"
        counts = ", ".join(str(lk - n) for n in lengths)
        return f"a boolean mask: the same keys blocked for every query ({counts} of {lk})"
    lq = allowed.shape[1]
    if lq == lk and all((a == np.tril(np.ones((lq, lk), bool))).all() for a in allowed):
        return "causal (a boolean mask): each token attends to itself and the tokens before it"
    blocked = int((~allowed[0]).sum())
    where = " of batch element 1" if len(allowed) > 1 else ""
    return f"a boolean mask: {blocked} of {allowed[0].size} query-key pairs{where} blocked"


def _last_dim(steps: Sequence[Step], name: str) -> int | None:
    for step in steps:
        if step.name == name and step.value.ndim:
            return int(step.value.shape[-1])
    return None


def _list_fact(label: str, tokens: list[Any]) -> Fact:
    names = [str(t) for t in tokens]
    suffix = f" ({len(names)} token{'s' * (len(names) != 1)})"
    return Fact(
        label,
        ", ".join(names) + suffix,
        ", ".join(latex_escape(n) for n in names) + suffix,
    )
