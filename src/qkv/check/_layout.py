"""What the text and Markdown reports share: titles, column labels, marks and the summary."""

from __future__ import annotations

from qkv.check._findings import Finding, ReportData
from qkv.check._steps import words_of

__all__ = ["SYMBOLS", "columns", "heading", "status_line", "summary"]

SYMBOLS = {"ok": "✓", "mismatch": "✗", "consequential": "↳", "note": "~"}
"""The symbol of each status, at the start of a finding."""
MARKS = {"ok": "", "rounding": "~", "wrong": "✗"}
"""The mark after a printed number: wrong, or off by a rounding."""
_MAX_LABEL = 12


def heading(step: str, head: int | None = None, tiled: bool = False) -> str:
    """``Q · Query vectors``; ``weights · Attention weights, head 1`` for the rows of head 1,
    the second (heads are counted from 0, as everywhere in qkv: docs/explain.md)."""
    where = "" if head is None else f", head {head}"
    if tiled:
        where = " (tiled)"
    return f"{step} · {words_of(step, tiled=tiled).title}{where}"


def token_label(finding: Finding, report: ReportData) -> str:
    """The token, with its position when it appears more than once (and the key block of a
    per-tile row of a tiled example)."""
    label = finding.token
    if report.tokens.count(finding.token) > 1:
        label = f"{finding.token} ({finding.position})"
    if finding.key_block is not None:
        label += f", key block {finding.key_block}"
    return label


def _short(label: str) -> str:
    return label if len(label) <= _MAX_LABEL else label[: _MAX_LABEL - 1] + "…"


def columns(finding: Finding, report: ReportData) -> list[str]:
    """Column labels: the keys (tokens) of a score row, else d1, d2, ..."""
    if finding.step in ("scores", "scaled", "exp", "weights"):
        return [_short(token) for token in report.tokens]
    if finding.step == "exp_sum":
        return ["sum"]
    if finding.step == "products":
        width = len(finding.claimed) // max(len(report.tokens), 1)
        return [
            _short(f"{token}.d{i + 1}") if width > 1 else _short(token)
            for token in report.tokens
            for i in range(width)
        ]
    return [f"d{i + 1}" for i in range(len(finding.claimed))]


def status_line(finding: Finding, report: ReportData) -> str:
    """``love · mismatch: arithmetic · line 28`` (without the symbol)."""
    parts = [token_label(finding, report)]
    if finding.status == "mismatch":
        parts.append(f"mismatch: {finding.diagnosis}")
    elif finding.status == "note":
        parts.append(f"note: {finding.diagnosis}")
    elif finding.status == "consequential" and finding.cause is not None:
        step, position = finding.cause
        names = report.tokens
        if report.query_tokens is not None and step not in ("K", "V"):
            names = report.query_tokens
        parts.append(f"consequential, follows from {step} of {names[position]}")
    else:
        parts.append(finding.status)
    if finding.line is not None:
        parts.append(f"line {finding.line}")
    return " · ".join(parts)


def summary(report: ReportData) -> list[str]:
    """The verdict in one to three sentences."""
    counts = report.counts()
    total = len(report.findings)
    if total == 0:
        return [
            "Nothing to check: the example claims no numbers. Add the numbers a text printed "
            "under 'claimed:' (see docs/example-format.md)."
        ]
    notes = counts["note"]
    noted = f"; {notes} rounding note{'s' * (notes != 1)}" if notes else ""
    if report.ok:
        rows = "row matches" if total == 1 else f"{total} claimed rows match"
        return [f"✓ {'The claimed ' + rows if total == 1 else 'All ' + rows}{noted}."]
    wrong = counts["mismatch"] + counts["consequential"]
    codes: dict[str, int] = {}
    for f in report.findings:
        if f.status == "mismatch" and f.diagnosis:
            codes[f.diagnosis] = codes.get(f.diagnosis, 0) + 1
    listed = ", ".join(f"{code} {n}" for code, n in codes.items())
    mistakes = f"{counts['mismatch']} mistake{'s' * (counts['mismatch'] != 1)} ({listed})"
    follow = ""
    if counts["consequential"] == 1:
        follow = ", 1 following from an earlier mistake"
    elif counts["consequential"]:
        follow = f", {counts['consequential']} following from earlier mistakes"
    if total == 1:
        rows = "The claimed row is wrong"
    elif wrong == 1:
        rows = f"1 of {total} claimed rows is wrong"
    else:
        rows = f"{wrong} of {total} claimed rows are wrong"
    lines = [f"✗ {rows}: {mistakes}{follow}{noted}."]
    first = report.first_wrong
    if first is not None:
        where = f" (line {first.line})" if first.line is not None else ""
        noun = words_of(first.step, tiled=first.tiled).noun(1)
        lines.append(f'First wrong step: {first.step}, the {noun} of "{first.token}"{where}.')
    return lines
