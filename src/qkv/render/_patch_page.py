"""The page of ``qkv patch --html``: the (layers × heads) heatmap of a patching sweep, and a
click on a head opens its step-by-step on both prompts with the difference.

The page is one self-contained file, as the explain page is: its data in a
``<script type="application/json">`` (escaped), its style and script inline and allowed by
hash in a Content-Security-Policy that lets it request nothing. The script sets text with
``textContent`` only, so a token of the prompts is never read as HTML.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qkv._format import visible
from qkv.render._html import _asset, self_contained
from qkv.trace import Trace

__all__ = ["PATCH_STEPS", "head_steps", "patching_page"]

PATCH_STEPS = ("Q", "K", "V", "scaled", "weights", "context")
"""The steps a head's step-by-step shows, each on both prompts."""


def _rounded(matrix: np.ndarray) -> list[list[float | None]]:
    """A 2-D step as nested lists, 4 decimals; −∞ (a masked score) becomes None."""
    out: list[list[float | None]] = []
    for row in np.asarray(matrix, dtype=np.float64):
        out.append([round(float(v), 4) if np.isfinite(v) else None for v in row])
    return out


def head_steps(trace: Trace, layers: list[str], steps: tuple[str, ...]) -> list[list[Any]]:
    """For each layer and query head, ``{step: 2-D list}`` of batch element 0: the numbers
    a head's step-by-step shows (key/value steps of the head's key/value head)."""
    out: list[list[Any]] = []
    for layer in layers:
        call = trace.call(layer=layer, index=0)
        facts = call.meta.get("layers", {}).get(layer, {})
        heads = int(facts.get("num_heads") or call.meta.get("num_heads") or 1)
        kv_heads = int(facts.get("num_kv_heads") or call.meta.get("num_kv_heads") or heads)
        group = max(heads // max(kv_heads, 1), 1)
        per_head = []
        for head in range(heads):
            shown = {}
            for name in steps:
                step = call.get(name)
                if step is not None:
                    shown[name] = _rounded(step.select(head=head, group_size=group))
            per_head.append(shown)
        out.append(per_head)
    return out


def patching_page(data: dict[str, Any]) -> str:
    """The HTML page of a sweep. ``data``: ``title``, ``metric`` (its description),
    ``what``, ``clean`` and ``corrupt`` (each ``{"text", "tokens", "value"}``), ``layers``
    (module paths), ``values`` and ``normalized`` ((layers × heads), None for NaN), ``best``
    (the cell opened first), and ``steps``: ``{"clean": head_steps(...), "corrupt":
    head_steps(...)}``. A table of other rows and columns (a sweep by position) gives
    ``rows`` (each ``{"label", "layer", "head"}``), ``columns`` (labels) and ``corner``;
    ``values`` and ``normalized`` are then (rows × columns)."""
    data = dict(data)
    if "rows" in data:
        data["rows"] = [{**row, "label": visible(str(row["label"]))} for row in data["rows"]]
        data["columns"] = [visible(str(label)) for label in data["columns"]]
        data["corner"] = visible(str(data.get("corner", "")))
    for side in ("clean", "corrupt"):
        part = dict(data[side])
        part["text"] = visible(str(part["text"]))
        part["tokens"] = [visible(str(t)) for t in part["tokens"]]
        data[side] = part
    data["layers"] = [visible(str(layer)) for layer in data["layers"]]
    main = (
        '<main id="qkv-patch"><noscript>This page needs JavaScript to draw the heatmap.'
        "</noscript></main>"
    )
    title = visible(str(data["title"]))
    return self_contained(title, _asset("patch.css"), _asset("patch.js"), main, data)
