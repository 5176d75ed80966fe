"""One self-contained, interactive HTML page of a trace: open it from disk, send it by e-mail.

The page holds everything it needs: its CSS and JavaScript (``assets/page.css``,
``assets/page.js``, written for qkv, inlined) and the trace's numbers as JSON. It makes no
network request: a Content-Security-Policy allows only its own inline script and style.
It shows

- the step-by-step explanation (the same :class:`~qkv.render.Narrative` as ``qkv explain``:
  titles, formulas, meanings, worked lines) with each matrix colour-scaled;
- a head view: queries on the left, keys on the right, one line per (query, key) whose
  thickness is the attention weight; hovering or focusing a token highlights its row (or its
  column) in the lines and in every matrix;
- a head selector and a layer selector when the trace has several heads or several attention
  calls (``Step.layer`` names them);
- the context vector of the selected query read as the weighted sum of the value vectors.

Safety: every token, name and formula reaches the page only as JSON inside
``<script type="application/json">`` with ``<``, ``>``, ``&``, U+2028 and U+2029 escaped, and
the script writes it with ``textContent`` only, so ``<script>alert(1)</script>`` is shown as
text and runs nothing.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from html import escape
from importlib import resources
from typing import Any

import numpy as np

from qkv._io import write_atomic
from qkv.render._lab import LAB_CALLS_MAX, lab_data
from qkv.render._model import Section, StepView, Table
from qkv.render._model_view import model_view
from qkv.render._narrative import (
    _MATRIX_AXES,
    Heads,
    _index,
    _size,
    narrate,
    query_position,
    trace_calls,
)
from qkv.trace import STEP_NAMES, Step, Trace, TraceCall

__all__ = ["MAX_VALUES", "HtmlPage", "html", "notebook_html"]

MAX_VALUES = 4_000_000
"""The most numbers a page holds by default (about 21 MB of HTML); see ``max_values``."""

_PROBABILITIES = ("weights", "dropout")  # colour-scaled from 0; the others diverge from 0


class HtmlPage(str):
    """The page of :func:`html`: the HTML text itself (a ``str``: write it, search it), which
    Jupyter shows as the interactive page in a sandboxed ``<iframe>`` when it ends a cell.

    The trace stays plain data: showing it is this layer's job (``render.html(trace)``).
    """

    __slots__ = ()

    def _repr_html_(self) -> str:
        """The page in an ``<iframe srcdoc>``, sandboxed (scripts only: no access to the
        notebook, no storage)."""
        return _iframe(self)


def html(
    trace: Trace,
    path: str | os.PathLike[str] | None = None,
    *,
    precision: int = 4,
    steps: Sequence[str] | None = None,
    layers: Sequence[int | str] | None = None,
    max_values: int | None = None,
    practice: dict[str, Any] | None = None,
) -> HtmlPage:
    """The trace as one self-contained interactive HTML page (no network, no CDN).

    Every matrix of the trace is embedded for batch element 0: the weights of shape
    (B, H, Lq, Lk) become H matrices (Lq, Lk), one per head, selected on the page.

    Args:
        trace: a recorded :class:`qkv.Trace` (``with qkv.tracing() as t:``, a worked example,
            a model).
        path: also write the page there, atomically (a failed write leaves no partial file).
        precision: decimals of the numbers shown (0 to 15).
        steps: keep only these steps (e.g. ``("weights",)`` for a long sequence); default all.
        layers: keep only these attention calls: 0-based positions, or the ``layer`` names
            the steps were recorded with; default all.
        max_values: refuse to write more numbers than this (default :data:`MAX_VALUES`; a
            page takes about 5.4 bytes per number); raise it, or keep fewer ``steps`` or
            ``layers``, for a big trace.
        practice: the data of practice mode (``render._practice.practice_data``): the page
            then opens asking the learner to compute each step, with a toggle back.

    Returns:
        The page, as an :class:`HtmlPage`: a string that Jupyter shows as the interactive
        page (put ``render.html(trace)`` last in a cell).

    Raises:
        TypeError: ``trace`` is not a Trace.
        ValueError: an empty trace, an unknown step or layer, or too many numbers.

    Example:
        >>> import numpy as np, qkv
        >>> from qkv import render
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> t.tokens = ["<b>hi</b>", "there"]
        >>> page = render.html(t)
        >>> page.startswith("<!DOCTYPE html>"), "<b>hi" in page, "\\\\u003cb\\\\u003ehi" in page
        (True, False, True)
    """
    data = page_data(trace, precision=precision, steps=steps, layers=layers, max_values=max_values)
    if practice is not None:
        data["practice"] = practice
    page = HtmlPage(_assemble(data))
    if path is not None:
        write_atomic(path, page)
    return page


def notebook_html(trace: Trace) -> str | None:
    """What a notebook shows for ``trace``: the page in a sandboxed ``<iframe srcdoc>``
    (:meth:`HtmlPage._repr_html_`), a one-line message with the hint for a trace too big for
    one page, None for a trace without steps."""
    if not trace.steps:
        return None
    try:
        page = html(trace)
    except ValueError as error:
        return f"<p>qkv: {escape(str(error))}</p>"
    return page._repr_html_()


def _iframe(page: str) -> str:
    return (
        '<iframe sandbox="allow-scripts" title="qkv: attention, step by step" '
        'style="width: 100%; height: 720px; border: 1px solid #c8c8c8;" '
        f'srcdoc="{escape(page, quote=True)}"></iframe>'
    )


# -- the data the page shows ---------------------------------------------------------------


def page_data(
    trace: Trace,
    *,
    precision: int = 4,
    steps: Sequence[str] | None = None,
    layers: Sequence[int | str] | None = None,
    max_values: int | None = None,
) -> dict[str, Any]:
    """What the page shows, as plain JSON-able data (see :func:`html` for the arguments)."""
    max_values = MAX_VALUES if max_values is None else max_values
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a qkv.Trace, got {type(trace).__name__}.")
    if not isinstance(max_values, int) or max_values < 1:
        raise ValueError(f"max_values must be a positive integer, got {max_values!r}.")
    if not trace.steps:
        raise ValueError(
            "the trace has no steps to show. Hint: record one with `with qkv.tracing() as t:` "
            "around an attention call, or pass trace=qkv.Trace()."
        )
    calls = _select_calls(trace_calls(trace), layers)
    whole = dict(calls)  # every step each call recorded, for the page's edit mode
    if steps is not None:
        calls = _keep_steps(trace, calls, steps)
    total = sum(_numbers_shown(call) for _, call in calls)
    if total > max_values:
        raise ValueError(
            f"the page would hold {total:,} numbers (about {total * 5.4 / 1e6:.1f} MB), more than "
            f"max_values={max_values:,}. Hint: keep fewer steps (steps=('weights',)) or "
            "layers (layers=[0]), or raise max_values."
        )
    labels = _Labels()
    names = _call_names([call for _, call in calls])
    built = [
        _call_data(trace, call, name, labels, precision)
        for (_, call), name in zip(calls, names, strict=True)
    ]
    keep = None if steps is None else {steps} if isinstance(steps, str) else set(steps)
    for position, ((index, _), shown) in enumerate(zip(calls, built, strict=True)):
        if position >= LAB_CALLS_MAX:
            break
        lab = _lab_of(trace, whole[index], shown, labels, keep)
        if lab is not None:
            shown["lab"] = lab
    meta = trace.meta
    return {
        "format": "qkv-page",
        "version": 1,
        "title": str(meta.get("name") or "Attention, step by step"),
        "description": str(meta.get("description") or ""),
        "precision": precision,
        "labels": labels.lists,
        "calls": built,
        "modelView": model_view(
            trace, [call for _, call in calls], names, labels.id, precision=precision
        ),
    }


def _lab_of(
    trace: Trace, call: TraceCall, shown: dict[str, Any], labels: _Labels, keep: set[str] | None
) -> dict[str, Any] | None:
    """The inputs and variants of the page's edit mode for one call (see ``_lab``)."""

    def describe(small: Trace, own: TraceCall) -> tuple[dict[str, Any], list[list[str]]]:
        mine = _Labels()
        return _call_data(small, own, "", mine, 4), mine.lists

    return lab_data(trace, call, shown, labels.id, describe, keep)


def _select_calls(
    calls: list[TraceCall], layers: Sequence[int | str] | None
) -> list[tuple[int, TraceCall]]:
    indexed = list(enumerate(calls))
    if layers is None:
        return indexed
    if isinstance(layers, str | int):
        layers = [layers]
    chosen: list[tuple[int, TraceCall]] = []
    known = [c.layer for c in calls]
    for wanted in layers:
        if isinstance(wanted, int) and not isinstance(wanted, bool):
            if not -len(calls) <= wanted < len(calls):
                raise ValueError(
                    f"layers: position {wanted} is out of range; the trace has {len(calls)} "
                    f"attention call(s), 0 to {len(calls) - 1}."
                )
            chosen.append(indexed[wanted % len(calls)])
        elif isinstance(wanted, str) and wanted in known:
            chosen.extend(item for item in indexed if item[1].layer == wanted)
        else:
            names = ", ".join(repr(n) for n in dict.fromkeys(known) if n) or "none"
            raise ValueError(
                f"layers: no attention call named {wanted!r}; the layers are {names}. "
                "Hint: give a layer name or a 0-based position."
            )
    return sorted(dict(chosen).items())


def _keep_steps(
    trace: Trace, calls: list[tuple[int, TraceCall]], steps: Sequence[str]
) -> list[tuple[int, TraceCall]]:
    if isinstance(steps, str):
        steps = [steps]
    recorded = list(dict.fromkeys(s.name for _, call in calls for s in call))
    for name in steps:
        if name not in STEP_NAMES or name not in recorded:
            raise ValueError(
                f"steps: no step named {name!r} in this trace; recorded: {', '.join(recorded)}."
            )
    kept = [
        (index, dataclasses.replace(call, steps=tuple(s for s in call if s.name in steps)))
        for index, call in calls
    ]
    return [(index, call) for index, call in kept if call.steps]


def _numbers_shown(call: TraceCall) -> int:
    heads = _size(call.steps, "head") or 1
    total = 0
    for step in call:
        per_head = bool({"head", "kv_head"} & set(step.axes))
        total += int(step.select(head=0, batch=0).size) * (heads if per_head else 1)
    return total


def _call_names(calls: list[TraceCall]) -> list[str]:
    layer_names = [call.layer for call in calls]
    names = []
    for position, (call, layer) in enumerate(zip(calls, layer_names, strict=True)):
        if layer is None:
            names.append(f"call {call.index}")
        elif layer_names.count(layer) > 1:
            names.append(f"{layer} (call {layer_names[: position + 1].count(layer)})")
        else:
            names.append(layer)
    return names


class _Labels:
    """Label lists (tokens, d1, d2, ...), each stored once and referred to by position."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self._index: dict[tuple[str, ...], int] = {}

    def id(self, labels: Sequence[str]) -> int:
        key = tuple(labels)
        if key not in self._index:
            self._index[key] = len(self.lists)
            self.lists.append(list(key))
        return self._index[key]


def _call_data(
    trace: Trace, call: TraceCall, name: str, labels: _Labels, precision: int
) -> dict[str, Any]:
    # The tables hold every query (the page selects one); the worked lines are those of the
    # queries the trace asks to show (a worked example's "love"), as in `qkv explain`.
    sub = trace.subset([call])  # this call's steps (as kept), its facts over the trace's
    (own,) = sub.calls
    queries = sub.meta.pop("queries", None)
    narrative = narrate(sub, precision=precision)
    worked = narrative
    if queries is not None:
        sub.meta["queries"] = queries
        worked = narrate(sub, precision=precision)
    heads = Heads(sub, own)
    by_number = dict(enumerate(call.steps, start=1))
    sections = [
        _section_data(section, lines, head, by_number, labels)
        for section, lines, head in zip(
            narrative.sections, worked.sections, _section_heads(own, heads), strict=True
        )
    ]
    return {
        "name": name,
        "layer": call.layer,
        "heads": heads.count,
        "facts": [[fact.label, fact.plain] for fact in narrative.facts],
        "query": _first_query(trace, call.steps, sections, labels),
        "sections": sections,
    }


def _section_heads(call: TraceCall, heads: Heads) -> list[int | None]:
    """The head of each section narrate() makes for one call (its position among the heads
    recorded; the section's title gives its original number): None for the shared ones."""
    split = heads.split(call.steps)
    if split is None:
        return [None]
    before = [None] if split[0] > 0 else []
    after = [None] if split[1] < len(call.steps) - 1 else []
    return [*before, *range(heads.count), *after]


def _section_data(
    section: Section,
    worked: Section,
    head: int | None,
    by_number: dict[int, Step],
    labels: _Labels,
) -> dict[str, Any]:
    return {
        "title": section.title,
        "head": head,
        "steps": [
            _step_data(view, lines, by_number[view.number], labels)
            for view, lines in zip(section.steps, worked.steps, strict=True)
        ],
    }


def _step_data(view: StepView, worked: StepView, step: Step, labels: _Labels) -> dict[str, Any]:
    """A step as the page shows it: ``view`` has the whole table, ``worked`` the worked lines
    and notes of the queries the trace asks to show."""
    axes = [a for a in step.axes if a in _MATRIX_AXES]
    out: dict[str, Any] = {
        "name": view.name,
        "number": view.number,
        "title": view.title,
        "formula": view.formula.plain,
        "meaning": view.meaning,
        "rowAxis": axes[0] if len(axes) == 2 else None,
        "colAxis": axes[-1] if axes else None,
        "scale": "probability" if view.name in _PROBABILITIES else "signed",
        "equations": [eq.plain for eq in worked.equations],
        "notes": list(worked.notes),
    }
    if view.name == "context":
        # narrate() writes the weighted sums only after checking C = A·V with the recorded
        # numbers; the page then reads any query's context vector interactively instead.
        out["weightedSum"] = bool(view.equations)
        out["equations"], out["notes"] = [], []
    if view.table is not None:
        out.update(_table_data(view.table, labels))
    return out


def _table_data(table: Table, labels: _Labels) -> dict[str, Any]:
    values = np.ascontiguousarray(table.values, dtype="<f4")
    return {
        "corner": table.corner,
        "rows": labels.id(table.rows),
        "cols": labels.id(table.columns),
        "shape": list(values.shape),
        "data": base64.b64encode(values.tobytes()).decode("ascii"),
    }


def _first_query(
    trace: Trace, call: Sequence[Step], sections: list[dict[str, Any]], labels: _Labels
) -> int:
    """The query selected when the page opens: the trace's first shown query, else 0."""
    rows = next(
        (
            labels.lists[step["rows"]]
            for section in sections
            for step in section["steps"]
            if step.get("rowAxis") == "query" and "rows" in step
        ),
        None,
    )
    wanted = trace.meta.get("queries")
    if rows is None or wanted is None:
        return 0
    first = wanted[0] if isinstance(wanted, list | tuple) and wanted else wanted
    row = query_position(first, rows, _index(call, "query"))
    return 0 if row is None else row


# -- the page ------------------------------------------------------------------------------


def _asset(name: str) -> str:
    return resources.files("qkv.render").joinpath("assets", name).read_text(encoding="utf-8")


def _json_for_script(data: dict[str, Any]) -> str:
    """JSON that is safe inside ``<script type="application/json">``: no ``</script>``, no
    ``<!--``, no HTML entity and no JavaScript line separator can appear in it."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escaped in (
        ("&", "\\u0026"),
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


SCRIPTS = ("page.js", "lab.js", "panels.js", "decode.js", "practice.js", "model_view.js")
"""The page's scripts, inlined in this order as one ``<script>``: ``page.js`` defines
``window.qkvPage`` (the page's state and helpers); each later file adds a part of the page
with ``qkvPage.extend({...})``; the page starts once all of them are read."""

STYLES = ("page.css", "practice.css", "model_view.css")
"""The page's style sheets, inlined in this order as one ``<style>``."""

_START = "window.qkvPage.start();\n"


def page_script() -> str:
    """The page's whole script: every file of :data:`SCRIPTS`, then the line that starts it."""
    return "".join(_asset(name) for name in SCRIPTS) + _START


def page_style() -> str:
    """The page's whole style sheet: every file of :data:`STYLES`."""
    return "".join(_asset(name) for name in STYLES)


def _assemble(data: dict[str, Any]) -> str:
    main = (
        '<main id="qkv-app" aria-busy="true"><noscript>This page needs JavaScript to show the '
        "attention steps.</noscript></main>"
    )
    return self_contained(str(data["title"]), page_style(), page_script(), main, data)


def self_contained(title: str, css: str, script: str, main: str, data: dict[str, Any]) -> str:
    """A page of one file: ``main`` (HTML qkv wrote), ``data`` as escaped JSON in
    ``<script type="application/json" id="qkv-data">``, the style and the script inline and
    allowed by hash in a Content-Security-Policy that lets the page request nothing."""
    for name, text, end in (("style", css, "</style"), ("script", script, "</script")):
        if end in text.lower() or "<!--" in text:  # would end the inline element early
            raise RuntimeError(f"qkv's {name} must not contain {end!r} or '<!--'")
    policy = (
        f"default-src 'none'; style-src 'sha256-{_sha256(css)}'; "
        f"script-src 'sha256-{_sha256(script)}'; base-uri 'none'; form-action 'none'"
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        '<meta name="generator" content="qkv">\n'
        f"<title>{escape(f'{title} · qkv', quote=True)}</title>\n"
        f"<style>{css}</style>\n</head>\n<body>\n{main}\n"
        f'<script type="application/json" id="qkv-data">{_json_for_script(data)}</script>\n'
        f"<script>{script}</script>\n</body>\n</html>\n"
    )
