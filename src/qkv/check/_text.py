"""The terminal report, laid out with rich: fits the width, plain text when not a terminal.

Each claimed step gets a rule; the first wrong step is marked on it. A wrong row shows its
printed numbers above the correct ones (each wrong number marked ✗, a rounding ~) and the
message; a row that matches is one line.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator, Sequence

from rich.console import Console
from rich.text import Text

from qkv._format import number
from qkv.check._findings import Finding, ReportData
from qkv.check._layout import MARKS, SYMBOLS, columns, heading, status_line, summary

__all__ = ["print_report", "text"]

_STYLES = {"ok": "green", "mismatch": "bold red", "consequential": "yellow", "note": "cyan"}
_MARK_STYLES = {"wrong": "bold red", "rounding": "cyan", "ok": ""}
_INDENT = "  "
_GAP = 3


def text(report: ReportData, *, width: int = 80) -> str:
    """The report as plain text, no line longer than ``width``.

    Raises:
        ValueError: a width under 40 columns.

    Example:
        >>> from qkv.check import check
        >>> out = text(check("i-love-statistics"), width=60)
        >>> max(len(line) for line in out.splitlines()) <= 60
        True
        >>> out.splitlines()[0]
        'qkv check: I love statistics (built-in i-love-statistics)'
    """
    if width < 40:
        raise ValueError(f"width must be at least 40 columns, got {width}")
    report = report.visible()
    return "\n".join(line.plain.rstrip() for line in _lines(report, width)) + "\n"


def print_report(report: ReportData, console: Console | None = None) -> None:
    """Print the report: in colour on a terminal, plain text into a file or a pipe."""
    console = console or Console(highlight=False, emoji=False, markup=False)
    width = max(console.width, 40)
    if not console.is_terminal:
        console.file.write(text(report, width=width))
        return
    for line in _lines(report.visible(), width):
        console.print(line, no_wrap=True, crop=False, overflow="ignore")


def _wrap(words: str, width: int, indent: str = _INDENT, style: str = "") -> Iterator[Text]:
    for line in textwrap.wrap(
        words, width - len(indent), break_long_words=True, break_on_hyphens=False
    ):
        yield Text(indent + line, style=style)


def _rule(title: str, width: int, mark: str = "") -> Iterator[Text]:
    """``title ─────── mark ──``; the mark goes on a line of its own when it does not fit."""
    tail = f" {mark} ──" if mark else ""
    if len(title) + 4 + len(tail) > width:
        yield from _rule(title, width)
        if mark:
            yield Text(mark, style="bold red")
        return
    line = Text(title + " ", style="bold")
    line.append("─" * (width - len(title) - 1 - len(tail)), style="dim")
    if mark:
        line.append(f" {mark} ", style="bold red")
        line.append("──", style="dim")
    yield line


def _lines(report: ReportData, width: int) -> Iterator[Text]:
    title = f"qkv check: {report.name}"
    if report.source:
        title += f" ({report.source})"
    yield from _wrap(title, width, indent="", style="bold")
    for sentence in summary(report):
        yield from _wrap(sentence, width, indent="")
    first = report.first_wrong
    group: tuple[str, int | None, bool] | None = None
    for k, finding in enumerate(report.findings):
        if (finding.step, finding.head, finding.tiled) != group:
            group = finding.step, finding.head, finding.tiled
            yield Text("")
            first_here = first is not None and (first.step, first.head, first.tiled) == group
            mark = "✗ first wrong step" if first_here else ""
            yield from _rule(heading(*group), width, mark)
        elif finding.status != "ok" or report.findings[k - 1].status != "ok":
            yield Text("")  # a blank line around each detailed finding
        yield from _finding(finding, report, width)
    if report.findings:
        yield Text("")
        yield from _rule("Summary", width)
        for sentence in summary(report):
            yield from _wrap(sentence, width, indent="")


def _finding(finding: Finding, report: ReportData, width: int) -> Iterator[Text]:
    symbol = SYMBOLS[finding.status]
    style = _STYLES[finding.status]
    head = f"{symbol} {status_line(finding, report)}"
    if finding.status == "ok":
        row = "[" + ", ".join(finding.printed) + "]"
        one = f"{head}  {row}"
        if len(one) <= width:
            yield Text(one, style=style)
            return
        yield Text(head, style=style)
        yield from _wrap(row, width)
        return
    for k, line in enumerate(_wrap(head, width, indent="")):
        yield Text("  " + line.plain if k else line.plain, style=style)
    yield from _grid(finding, report, width)
    yield from _wrap(finding.message, width)


def _cells(finding: Finding) -> tuple[list[str], list[str]]:
    printed = list(finding.printed)
    correct = [number(v, finding.decimals) for v in finding.expected]
    return printed, correct


def _grid(finding: Finding, report: ReportData, width: int) -> Iterator[Text]:
    """The printed and the correct numbers, column under column, split to fit the width."""
    labels = columns(finding, report)
    printed, correct = _cells(finding)
    sizes = [max(len(a), len(b), len(c)) for a, b, c in zip(labels, printed, correct, strict=True)]
    label_width = len("printed")
    chunks: list[list[int]] = [[]]
    used = len(_INDENT) + label_width
    for j, size in enumerate(sizes):
        need = _GAP + size + 2
        if chunks[-1] and used + need > width:
            chunks.append([])
            used = len(_INDENT) + label_width
        chunks[-1].append(j)
        used += need
    for k, chunk in enumerate(chunks):
        if len(chunks) > 1:
            span = f"{chunk[0] + 1}–{chunk[-1] + 1}" if len(chunk) > 1 else f"{chunk[0] + 1}"
            yield Text(f"{_INDENT}columns {span} of {len(sizes)}", style="italic dim")
        yield _grid_line("", [labels[j] for j in chunk], [sizes[j] for j in chunk], "bold")
        yield _grid_line(
            "printed",
            [printed[j] for j in chunk],
            [sizes[j] for j in chunk],
            "",
            [finding.marks[j] for j in chunk],
        )
        yield _grid_line("correct", [correct[j] for j in chunk], [sizes[j] for j in chunk], "")
        if k < len(chunks) - 1:
            yield Text("")


def _grid_line(
    label: str,
    cells: Sequence[str],
    sizes: Sequence[int],
    style: str,
    marks: Sequence[str] | None = None,
) -> Text:
    line = Text(_INDENT + label.ljust(len("printed")), style="bold")
    for j, (cell, size) in enumerate(zip(cells, sizes, strict=True)):
        mark = "" if marks is None else marks[j]
        line.append(" " * _GAP)
        line.append(cell.rjust(size), style=_MARK_STYLES.get(mark, "") or style)
        symbol = MARKS.get(mark, "")
        line.append(f" {symbol}" if symbol else "  ", style=_MARK_STYLES.get(mark, ""))
    return line
