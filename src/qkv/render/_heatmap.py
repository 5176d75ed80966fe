"""Heatmaps of attention with matplotlib (``qkv[viz]``): PNG for the web, SVG for papers.

One panel per head, in a grid (one row per attention call when the trace spans several
layers), the query tokens down the side and the key tokens along the bottom, the numbers in
the cells when the matrix is small. Weights by default; scores or scaled scores on request.
matplotlib is imported only here, when a picture is asked for, and draws off screen (Agg).
Text from the trace (tokens, layer names, the title) is drawn as written: matplotlib's math
parsing is off for it, so a token with ``$`` is neither a formula nor an error.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qkv._extras import require
from qkv._format import visible
from qkv._io import write_atomic
from qkv.render._narrative import Heads, _index, _labels, query_labels, trace_calls
from qkv.render._vocabulary import TITLES
from qkv.trace import Step, Trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MATRIX_STEPS", "heatmap"]

MATRIX_STEPS = ("scores", "scaled", "bias", "masked", "weights", "dropout")
"""The steps a heatmap can show: one value per (query, key)."""

_PROBABILITIES = ("weights", "dropout")
_MAX_PANELS = 64
_VALUES_UP_TO = 12  # numbers are written in the cells when Lq and Lk are at most this
_TICKS_UP_TO = 48  # every token is labelled up to this length; beyond, every n-th


def heatmap(
    trace: Trace,
    path: str | os.PathLike[str] | None = None,
    *,
    step: str = "weights",
    layer: int | str | None = None,
    heads: Sequence[int] | None = None,
    values: bool | None = None,
    precision: int = 2,
    title: str | None = None,
    dpi: int = 150,
) -> Figure:
    """Draw a step of the trace as heatmaps, one panel per head; optionally save PNG or SVG.

    Each panel is one (Lq, Lk) matrix of batch element 0: query tokens on the vertical axis,
    key tokens on the horizontal one. Weights are coloured on a fixed scale from 0 (white)
    to 1 (dark blue), so that near-uniform weights look pale; scores from orange (negative)
    through white to purple (positive); masked scores (−∞) are grey. All panels share one
    colour scale, shown in a colour bar (under a panel of a few query rows).

    Args:
        trace: a recorded :class:`qkv.Trace`.
        path: a file ending in ``.png`` or ``.svg`` to write (atomically); SVG keeps its text
            as text, so the tokens can be searched and edited.
        step: one of :data:`MATRIX_STEPS` (default ``"weights"``).
        layer: which attention call: a 0-based position or a ``layer`` name; default every
            call that recorded ``step`` (one row of panels each).
        heads: 0-based heads to draw; default all. A trace that recorded only some heads
            (``qkv.tracing(heads=[2, 5])``) names them by their original numbers (2 and 5),
            as the panel titles do (``head 2``, ``head 5``).
        values: write the numbers in the cells; default only when Lq and Lk are at most 12.
        precision: decimals of those numbers.
        title: the title above the panels; default the step's title and the example's name.
        dpi: resolution of a PNG.

    Returns:
        The matplotlib ``Figure`` (not shown on any screen).

    Raises:
        MissingExtraError: matplotlib is not installed (``pip install 'qkv[viz]'``).
        ValueError: a step that is not recorded or not a (query, key) matrix, an unknown
            layer or head, too many panels, or a path that is not ``.png``/``.svg``.

    Example:
        >>> import numpy as np, qkv
        >>> from qkv import render
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> t.tokens = ["hello", "world"]
        >>> fig = render.heatmap(t)
        >>> [label.get_text() for label in fig.axes[0].get_xticklabels()]
        ['hello', 'world']
    """
    suffix = _suffix(path)
    if not isinstance(precision, int) or not 0 <= precision <= 12:
        raise ValueError(f"precision must be an integer from 0 to 12, got {precision!r}.")
    panels = _panels(trace, step, layer, heads)
    require("matplotlib", feature="qkv.render.heatmap", extra="viz")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = max(p.row for p in panels) + 1
    per_row = [sum(1 for p in panels if p.row == r) for r in range(rows)]
    if rows == 1:
        columns = min(per_row[0], 4)
        rows = math.ceil(per_row[0] / columns)
        for index, panel in enumerate(panels):
            panel.row, panel.column = divmod(index, columns)
    else:
        columns = max(per_row)
    lq, lk = (max(p.matrix.shape[axis] for p in panels) for axis in (0, 1))
    side = min(6.0, max(2.6, 0.42 * max(lq, lk) + 1.2))
    # each panel is sized to its cells: a single query row is a strip, not a white square
    flat = lk >= 3 * lq  # a strip of a few query rows: the colour bar goes under it
    if flat:
        cell = (side - 1.2) / lk
        width, height = cell * lk + 1.2, cell * lq + 1.1
    else:
        width = height = max(side, 3.2)  # room for the colour bar's label beside the panels
    figure = Figure(
        figsize=(columns * width + (0.3 if flat else 1.2), rows * height + (1.0 if flat else 0.6)),
        dpi=dpi,
        layout="constrained",
    )
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, columns, squeeze=False)
    for ax in grid.flat:
        ax.set_visible(False)
    write = values if values is not None else (lq <= _VALUES_UP_TO and lk <= _VALUES_UP_TO)
    image = None
    cmap, norm = _colours(step, panels)
    for panel in panels:
        ax = grid[panel.row][panel.column]
        ax.set_visible(True)
        ax.set_gid(f"qkv-panel-{panel.row + 1}-{panel.column + 1}")
        matrix = np.ma.masked_invalid(panel.matrix)
        image = ax.imshow(matrix, cmap=cmap, norm=norm, aspect="equal", interpolation="nearest")
        ax.set_title(panel.title, fontsize=10, parse_math=False)
        _ticks(ax, panel)
        ax.set_xlabel("key")
        if panel.column == 0:
            ax.set_ylabel("query")
        if write:
            _write_values(ax, panel.matrix, cmap, norm, precision)
    assert image is not None  # there is at least one panel
    label = "attention weight (0 to 1)" if step in _PROBABILITIES else TITLES[step].lower()
    figure.colorbar(
        image,
        ax=[ax for ax in grid.flat if ax.get_visible()],
        shrink=0.6 if flat else 0.9,
        label=label,
        location="bottom" if flat else "right",
        aspect=30 if flat else 20,
    )
    name = visible(str(trace.meta.get("name") or ""))
    figure.suptitle(
        title if title is not None else TITLES[step] + (f": {name}" if name else ""),
        parse_math=False,
    )
    if path is not None:
        write_atomic(path, _encode(figure, suffix))
    return figure


class _Panel:
    def __init__(
        self, row: int, column: int, title: str, matrix: np.ndarray, qs: list[str], ks: list[str]
    ) -> None:
        self.row, self.column, self.title = row, column, title
        self.matrix, self.query_labels, self.key_labels = matrix, qs, ks


def _suffix(path: str | os.PathLike[str] | None) -> str | None:
    if path is None:
        return None
    suffix = Path(path).suffix.lower()
    if suffix not in (".png", ".svg"):
        raise ValueError(
            f"path must end in .png or .svg, got {str(path)!r}. "
            "Hint: PNG for a web page or slides, SVG (vector) for a paper."
        )
    return suffix[1:]


def _panels(
    trace: Trace, step: str, layer: int | str | None, heads: Sequence[int] | None
) -> list[_Panel]:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a qkv.Trace, got {type(trace).__name__}.")
    if step not in MATRIX_STEPS:
        raise ValueError(
            f"step must be one of {', '.join(MATRIX_STEPS)} (a value per query and key), "
            f"got {step!r}."
        )
    calls = trace_calls(trace)
    if layer is None:
        chosen = [(i, c) for i, c in enumerate(calls) if step in c]
    elif isinstance(layer, int) and not isinstance(layer, bool):
        if not -len(calls) <= layer < len(calls):
            raise ValueError(
                f"layer {layer} is out of range: the trace has {len(calls)} attention call(s)."
            )
        chosen = [(layer % len(calls), calls[layer])]
    else:
        chosen = [(i, c) for i, c in enumerate(calls) if c.layer == layer]
        if not chosen:
            names = ", ".join(repr(c.layer) for c in calls if c.layer) or "none"
            raise ValueError(f"no layer named {layer!r} in the trace; the layers are {names}.")
    found = [(i, next((s for s in c if s.name == step), None)) for i, c in chosen]
    if not any(s is not None for _, s in found):
        recorded = ", ".join(dict.fromkeys(s.name for s in trace.steps)) or "none"
        raise ValueError(
            f"the trace has no step {step!r} to draw (recorded: {recorded}). "
            "Hint: weights are recorded by every attention call."
        )
    panels: list[_Panel] = []
    several = len(found) > 1
    for row, (index, recorded_step) in enumerate((i, s) for i, s in found if s is not None):
        name = calls[index].layer or f"call {index}"
        numbers = Heads(trace, calls[index]).numbers  # original head numbers, 0-based
        for column, head in enumerate(_heads(recorded_step, heads, numbers)):
            matrix, qs, ks = _matrix(trace, recorded_step, head)
            title = f"head {numbers[head]}" if _has_heads(recorded_step) else "single head"
            panels.append(
                _Panel(row, column, f"{name}, {title}" if several else title, matrix, qs, ks)
            )
    if len(panels) > _MAX_PANELS:
        raise ValueError(
            f"{len(panels)} panels are too many for one picture (at most {_MAX_PANELS}). "
            "Hint: choose a layer (layer=0) or some heads (heads=[0, 1])."
        )
    return panels


def _has_heads(step: Step) -> bool:
    return "head" in step.axes


def _heads(step: Step, wanted: Sequence[int] | None, numbers: list[int]) -> list[int]:
    """The positions (in the recorded values) of the heads to draw; ``wanted`` names heads by
    their original 0-based numbers, ``numbers`` (one per recorded head)."""
    count = step.value.shape[step.axes.index("head")] if _has_heads(step) else 1
    if len(numbers) != count:
        numbers = list(range(count))
    if wanted is None:
        return list(range(count))
    chosen = []
    for head in wanted:
        if (
            isinstance(head, bool)
            or not isinstance(head, int | np.integer)
            or int(head) not in numbers
        ):
            if numbers == list(range(count)):
                known = f"its heads are 0 to {count - 1} (0-based)"
            else:
                known = f"it recorded heads {', '.join(map(str, numbers))} (0-based)"
            raise ValueError(f"heads: {head!r} is not a head of this trace; {known}.")
        chosen.append(numbers.index(int(head)))
    return chosen


def _matrix(trace: Trace, step: Step, head: int) -> tuple[np.ndarray, list[str], list[str]]:
    if "query" not in step.axes or "key" not in step.axes:
        raise ValueError(
            f"step {step.name!r} has axes {step.axes}; a heatmap needs a query and a key axis."
        )
    matrix = np.asarray(step.select(head=head, batch=0), dtype=np.float64)
    order = [a for a in step.axes if a in ("query", "key")]
    if order == ["key", "query"]:
        matrix = matrix.T
    lq, lk = matrix.shape
    qs = query_labels(trace, lq, _index([step], "query"))  # original positions' tokens
    ks = _labels(trace.tokens, lk, "t")
    return matrix, qs, ks


def _colours(step: str, panels: list[_Panel]) -> tuple[Any, Any]:
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    finite = [p.matrix[np.isfinite(p.matrix)] for p in panels]
    largest = max((float(np.abs(f).max()) for f in finite if f.size), default=1.0) or 1.0
    if step in _PROBABILITIES:  # a fixed scale: near-uniform weights look pale, not strong
        cmap, norm = colormaps["Blues"], Normalize(0.0, max(1.0, largest))
    else:
        cmap, norm = colormaps["PuOr"], Normalize(-largest, largest)
    return cmap.with_extremes(bad="#e0e0e0"), norm


def _ticks(ax: Any, panel: _Panel) -> None:
    for axis, labels, setter in (
        ("x", panel.key_labels, ax.set_xticks),
        ("y", panel.query_labels, ax.set_yticks),
    ):
        every = max(1, math.ceil(len(labels) / _TICKS_UP_TO))
        positions = list(range(0, len(labels), every))
        size = 9 if len(labels) <= 12 else (7 if len(labels) <= 32 else 6)
        rotate = axis == "x" and (len(labels) > 8 or any(len(t) > 4 for t in labels))
        setter(
            positions,
            [labels[i] for i in positions],
            fontsize=size,
            rotation=90 if rotate else 0,
            parse_math=False,  # a token is shown as written: "$x$" is not a formula
        )


def _write_values(ax: Any, matrix: np.ndarray, cmap: Any, norm: Any, precision: int) -> None:
    from qkv._format import number

    lq, lk = matrix.shape
    size = 9 if max(lq, lk) <= 6 else 7
    for i in range(lq):
        for j in range(lk):
            v = float(matrix[i, j])
            colour = _ink(cmap(norm(v))) if math.isfinite(v) else "#444444"
            ax.text(
                j, i, number(v, precision), ha="center", va="center", fontsize=size, color=colour
            )


def _ink(rgba: tuple[float, float, float, float]) -> str:
    """White or black text, whichever contrasts more with the cell (WCAG relative
    luminance); the contrast ratio is then at least 4.58 on any colour."""
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    lum = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    return "white" if 1.05 / (lum + 0.05) >= (lum + 0.05) / 0.05 else "black"


def _encode(figure: Any, suffix: str | None) -> bytes:
    from matplotlib import rc_context

    buffer = io.BytesIO()
    metadata: dict[str, str | None] = {"Date": None} if suffix == "svg" else {"Software": None}
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "qkv"}):
        figure.savefig(buffer, format=suffix, metadata=metadata)
    return buffer.getvalue()
