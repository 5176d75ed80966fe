"""The terminal renderer: the narrative laid out with rich, fitted to the console width.

Tables wider than the console are split into several tables of columns (the row labels
repeat), never wrapped cell by cell; worked equations are wrapped before ``+`` and ``=``.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterator

from rich import box
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.rule import Rule
from rich.table import Table as RichTable
from rich.text import Text

from qkv._format import MINUS_INFINITY, number, wrap_equation
from qkv.render._model import Narrative, StepView, Table
from qkv.render._narrative import narrate
from qkv.trace import Trace

__all__ = ["narrative_text", "print_text", "text"]

_MAX_LABEL = 20  # longer token labels are shortened with "…" in terminal tables


def text(trace: Trace, *, precision: int = 4, width: int = 80) -> str:
    """Every step of the trace as plain text, no line longer than ``width``.

    Args:
        trace: a recorded :class:`qkv.Trace`.
        precision: decimals of every number.
        width: the line length to fit (at least 40).

    Returns:
        The text, without colour codes, ending with a newline.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> out = text(t, precision=2)
        >>> "c_t0 = 0.67·v_t0 + 0.33·v_t1 = [0.67, 0.33]" in out
        True
    """
    return narrative_text(narrate(trace, precision=precision), width=width)


def narrative_text(narrative: Narrative, *, width: int = 80) -> str:
    """A narrative (of a trace, or of the tiled pass) as plain text within ``width``."""
    if width < 40:
        raise ValueError(f"width must be at least 40 columns, got {width}.")
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        no_color=True,
        highlight=False,
        emoji=False,
        markup=False,
    )
    _print(narrative, console)
    lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def print_text(trace: Trace, console: Console | None = None, *, precision: int = 4) -> None:
    """Print every step of the trace to a terminal, in colour when it is one.

    Args:
        trace: a recorded :class:`qkv.Trace`.
        console: where to print; by default a new ``rich.console.Console`` on stdout, which
            uses colour on a terminal and the terminal's width.
        precision: decimals of every number.
    """
    console = console or Console(highlight=False, emoji=False, markup=False)
    if not console.is_terminal:  # a file or a pipe: the plain text, no trailing spaces
        console.file.write(text(trace, precision=precision, width=max(console.width, 40)))
        return
    _print(narrate(trace, precision=precision), console)


def _print(narrative: Narrative, console: Console) -> None:
    for renderable in _renderables(narrative, console):
        console.print(renderable)


def _renderables(n: Narrative, console: Console) -> Iterator[RenderableType]:
    width = console.width
    yield Text(n.title, style="bold")
    if n.description:
        yield Text(n.description)
    if n.facts:
        yield Text("")
        label_width = max(len(f.label) for f in n.facts) + 2
        for fact in n.facts:
            yield _hanging(fact.label, fact.plain, width, label_width + 2)
    for section in n.sections:
        if section.title:
            yield Text("")
            yield Rule(Text(section.title, style="bold magenta"), characters="═", style="magenta")
        for step in section.steps:
            yield from _step(step, n.precision, console)


def _hanging(label: str, value: str, width: int, indent: int) -> Text:
    """A header line, its value wrapped into continuation lines under itself."""
    parts = textwrap.wrap(value, width - indent, break_long_words=True) or [""]
    line = Text(f"  {label:<{indent - 2}}", style="bold")
    line.append(parts[0])
    for part in parts[1:]:
        line.append("\n" + " " * indent + part)
    return line


def _step(step: StepView, precision: int, console: Console) -> Iterator[RenderableType]:
    yield Text("")
    yield Rule(Text(f"Step {step.number}. {step.title}", style="bold"), align="left", style="dim")
    yield Text(step.formula.plain, style="bold cyan")
    if step.meaning:
        yield Text(step.meaning)
    if step.table is not None:
        yield Text("")
        yield from _tables(step.table, precision, console)
    if step.equations:
        yield Text("")
        for equation in step.equations:
            for line in wrap_equation(equation.plain, console.width):
                yield Text(line, style="green", overflow="fold")
    for note in step.notes:
        yield Text(note, style="italic dim")


def _short(label: str) -> str:
    return label if len(label) <= _MAX_LABEL else label[: _MAX_LABEL - 1] + "…"


def _rich_table(table: Table, columns: list[int], with_sums: bool, precision: int) -> RichTable:
    out = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    out.add_column(Text(_short(table.corner)), style="bold", no_wrap=True)
    for j in columns:
        out.add_column(Text(_short(table.columns[j])), justify="right", no_wrap=True)
    if with_sums:
        out.add_column(Text("sum"), justify="right", no_wrap=True, style="green")
    for i, row in enumerate(table.rows):
        cells: list[Text] = [Text(_short(row))]
        for j in columns:
            cell = number(float(table.values[i, j]), precision)
            cells.append(Text(cell, style="dim" if cell == MINUS_INFINITY else ""))
        if with_sums and table.sums is not None:
            cells.append(Text(number(float(table.sums[i]), precision)))
        out.add_row(*cells)
    return out


def _tables(table: Table, precision: int, console: Console) -> Iterator[RenderableType]:
    """One rich table, or several of consecutive columns when one would be too wide."""
    n = len(table.columns)
    sums = table.sums is not None
    chunks = _chunks(table, precision, console.width)
    for k, chunk in enumerate(chunks):
        if len(chunks) > 1:
            if k:
                yield Text("")
            span = f"{chunk[0] + 1}–{chunk[-1] + 1}" if len(chunk) > 1 else f"{chunk[0] + 1}"
            plural = "s" if len(chunk) > 1 else ""
            yield Text(f"column{plural} {span} of {n}", style="italic dim")
        yield _rich_table(table, chunk, sums and k == len(chunks) - 1, precision)


def _chunks(table: Table, precision: int, width: int) -> list[list[int]]:
    """Consecutive columns, as many per table as fit in ``width``.

    The widths are computed (a column is its widest cell; columns are 3 apart), then each
    table is measured by rich to be sure; one that is still too wide is split again.
    """
    label = max(cell_len(_short(x)) for x in (table.corner, *table.rows))
    widths = [
        max(
            cell_len(_short(table.columns[j])),
            *(cell_len(number(float(v), precision)) for v in table.values[:, j]),
        )
        for j in range(len(table.columns))
    ]
    extra = 0
    if table.sums is not None:
        extra = 3 + max(3, *(cell_len(number(float(v), precision)) for v in table.sums))
    chunks: list[list[int]] = []
    current: list[int] = []
    used = label
    for j, w in enumerate(widths):
        last = j == len(widths) - 1
        if current and used + 3 + w + (extra if last else 0) > width:
            chunks.append(current)
            current, used = [], label
        current.append(j)
        used += 3 + w
    chunks.append(current)
    if table.sums is not None and used + extra > width and len(chunks[-1]) > 1:
        chunks.append([chunks[-1].pop()])
    return [
        piece
        for k, chunk in enumerate(chunks)
        for piece in _fit(table, chunk, k == len(chunks) - 1, precision, width)
    ]


def _fit(table: Table, chunk: list[int], last: bool, precision: int, width: int) -> list[list[int]]:
    """``chunk`` if rich lays it out within ``width``, else its halves, each checked again."""
    console = Console(width=width, color_system=None)
    rich_table = _rich_table(table, chunk, last and table.sums is not None, precision)
    if len(chunk) == 1 or _width(rich_table, console) <= width:
        return [chunk]
    half = len(chunk) // 2
    return _fit(table, chunk[:half], False, precision, width) + _fit(
        table, chunk[half:], last, precision, width
    )


def _width(table: RichTable, console: Console) -> int:
    # Measure without the console's limit (Measurement.get clamps to options.max_width).
    unbounded = console.options.update_width(100_000)
    return Measurement.get(console, unbounded, table).maximum
