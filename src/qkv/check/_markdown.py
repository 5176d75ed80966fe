"""The Markdown report: a section per claimed step, a table of printed vs correct numbers."""

from __future__ import annotations

from qkv._format import markdown_escape, number
from qkv.check._findings import Finding, ReportData
from qkv.check._layout import MARKS, SYMBOLS, columns, heading, status_line, summary

__all__ = ["markdown"]


def markdown(report: ReportData) -> str:
    """The report as GitHub-flavoured Markdown (tokens and messages escaped).

    Example:
        >>> from qkv.check import check
        >>> md = markdown(check("i-love-statistics"))
        >>> md.splitlines()[0]
        '# qkv check: I love statistics'
        >>> "## Q · Query vectors (first wrong step)" in md
        True
    """
    report = report.visible()
    out = [f"# qkv check: {markdown_escape(report.name)}", ""]
    if report.source:
        out += [f"Source: {markdown_escape(report.source)}", ""]
    out += [" ".join(markdown_escape(s) for s in summary(report)), ""]
    first = report.first_wrong
    group: tuple[str, int | None, bool] | None = None
    for finding in report.findings:
        if (finding.step, finding.head, finding.tiled) != group:
            group = finding.step, finding.head, finding.tiled
            first_here = first is not None and (first.step, first.head, first.tiled) == group
            mark = " (first wrong step)" if first_here else ""
            out += [f"## {markdown_escape(heading(*group))}{mark}", ""]
        out += _finding(finding, report)
    return "\n".join(out).rstrip("\n") + "\n"


def _finding(finding: Finding, report: ReportData) -> list[str]:
    head = f"**{SYMBOLS[finding.status]} {markdown_escape(status_line(finding, report))}**"
    if finding.status == "ok":
        return [f"{head}: \\[{', '.join(markdown_escape(p) for p in finding.printed)}\\]", ""]
    labels = columns(finding, report)
    printed = []
    for text, mark in zip(finding.printed, finding.marks, strict=True):
        symbol = MARKS.get(mark, "")
        text = markdown_escape(text)
        printed.append(f"**{text}** {symbol}" if symbol else text)
    correct = [number(v, finding.decimals) for v in finding.expected]
    lines = [
        head,
        "",
        "| | " + " | ".join(markdown_escape(label) for label in labels) + " |",
        "|:--" + "|--:" * len(labels) + "|",
        "| printed | " + " | ".join(printed) + " |",
        "| correct | " + " | ".join(correct) + " |",
        "",
        markdown_escape(finding.message),
        "",
    ]
    return lines
