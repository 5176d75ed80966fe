"""The JSON report: the stable schema of docs/check.md, as text that is safe on a terminal."""

from __future__ import annotations

import json

from qkv._format import json_safe
from qkv.check._findings import ReportData

__all__ = ["to_json"]


def to_json(report: ReportData, *, indent: int | None = 2) -> str:
    """The report as JSON (UTF-8 text, ending with a newline); control characters and
    bidirectional overrides in strings are ``\\uXXXX`` escapes, inert on a terminal.

    Example:
        >>> from qkv.check import check
        >>> to_json(check("i-love-statistics")).startswith('{\\n  "ok": false,')
        True
    """
    return json_safe(json.dumps(report.to_dict(), indent=indent, ensure_ascii=False)) + "\n"
