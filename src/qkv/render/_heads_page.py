"""The page of ``qkv heads --html``: one (layers × heads) heatmap per head statistic.

A static page: tables whose cells are coloured by value (no script), its style allowed by
hash in a Content-Security-Policy that lets it request nothing; every name is escaped.
"""

from __future__ import annotations

import math
from html import escape

from qkv._format import visible
from qkv.render._html import _sha256

__all__ = ["heads_page"]

_CSS = (
    "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1a1a1a}"
    "h1{font-size:1.3rem}h2{font-size:1.05rem;margin-top:1.4rem}"
    "table{border-collapse:collapse;font:0.8rem monospace}"
    "th,td{border:1px solid #ddd;padding:0.25rem 0.45rem;text-align:right}"
    "th{font-weight:normal;background:#f6f6f6}"
    + "".join(f".c{i}{{background:rgb({255 - 20 * i},{255 - 12 * i},255)}}" for i in range(11))
)

MEANINGS = {
    "entropy": "entropy of each row (nats): low = looks at few tokens",
    "sink": "attention on the first token",
    "previous": "attention on the token before",
    "diagonal": "attention on the token itself",
    "induction": "on a repeat, attention on the token after the earlier copy",
}


def _cell(value: float, top: float) -> str:
    if math.isnan(value):
        return '<td class="c0">–</td>'
    shade = 0 if top <= 0 else max(0, min(10, round(10 * value / top)))
    return f'<td class="c{shade}">{value:.3f}</td>'


def heads_page(title: str, layers: list[str], values: dict[str, list[list[float]]]) -> str:
    """The page: for each statistic, a table of layers (rows) by heads (columns)."""
    parts = [f"<h1>{escape(visible(title))}</h1>"]
    for name, table in values.items():
        finite = [v for row in table for v in row if not math.isnan(v)]
        top = max(finite, default=0.0)
        heads = max((len(row) for row in table), default=0)
        parts.append(f"<h2>{escape(name)}: {escape(MEANINGS.get(name, ''))}</h2>")
        parts.append(f'<table data-statistic="{escape(name, quote=True)}">')
        parts.append(
            "<tr><th>layer</th>" + "".join(f"<th>head {h}</th>" for h in range(heads)) + "</tr>"
        )
        for layer, row in zip(layers, table, strict=True):
            label = escape(visible(layer), quote=True)
            cells = "".join(_cell(v, top) for v in row)
            parts.append(f'<tr><th title="{label}">{label}</th>{cells}</tr>')
        parts.append("</table>")
    policy = f"default-src 'none'; style-src 'sha256-{_sha256(_CSS)}'; base-uri 'none'"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        f"<title>{escape(visible(title))} · qkv</title>\n<style>{_CSS}</style>\n</head>\n"
        "<body>\n" + "\n".join(parts) + "\n</body>\n</html>\n"
    )
