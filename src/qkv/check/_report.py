"""The result of a check, :class:`Report`: the plain data of :mod:`~qkv.check._findings` and
its formats (text, Markdown, JSON).

The formatters are functions beside the data (``_text``, ``_markdown``, ``_json``) that read
a :class:`~qkv.check._findings.ReportData`; :class:`Report` only adds methods that call them,
so no formatter imports this module.

The JSON form (``Report.to_json``) is a stable, documented schema (docs/check.md)::

    {"ok": bool,
     "findings": [{"step", "token", "claimed", "expected", "status", "diagnosis", "message"}]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.check import _json, _markdown, _text
from qkv.check._findings import DIAGNOSES, STATUSES, Finding, ReportData

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["DIAGNOSES", "FORMATS", "STATUSES", "Finding", "Report", "render"]

FORMATS = ("text", "markdown", "json")
"""The output formats of a report, as ``qkv check --format`` names them."""


def render(report: ReportData, format: str = "text", *, width: int = 80) -> str:
    """The report in one of :data:`FORMATS`.

    Raises:
        ValueError: an unknown format, naming the ones there are.
    """
    if format == "text":
        return _text.text(report, width=width)
    if format == "markdown":
        return _markdown.markdown(report)
    if format == "json":
        return _json.to_json(report)
    raise ValueError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")


class Report(ReportData):
    """The check of one worked example (see :class:`~qkv.check._findings.ReportData` for its
    fields), with a method for each of its formats."""

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON (UTF-8 text, ending with a newline); control characters and
        bidirectional overrides in strings are ``\\uXXXX`` escapes, inert on a terminal."""
        return _json.to_json(self, indent=indent)

    def text(self, *, width: int = 80) -> str:
        """The report as plain text, no line longer than ``width`` (at least 40)."""
        return _text.text(self, width=width)

    def markdown(self) -> str:
        """The report as GitHub-flavoured Markdown."""
        return _markdown.markdown(self)

    def render(self, format: str = "text", *, width: int = 80) -> str:
        """The report in one of :data:`FORMATS`.

        Raises:
            ValueError: an unknown format, naming the ones there are.
        """
        return render(self, format, width=width)

    def print(self, console: Console | None = None) -> None:
        """Print the text report: in colour on a terminal, plain text into a file or a pipe."""
        _text.print_report(self, console)
