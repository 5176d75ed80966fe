"""The page of ``qkv explain --tiled --html``: the tiles as a grid, lit as they are visited.

The grid has a row per query block and a column per key block; each cell is a button (its
kind: full, masked or skipped). Stepping through the forward pass (the buttons "Previous"
and "Next", or the arrow keys on the grid) lights the tiles visited so far and shows the
selected tile's numbers: its scaled scores, tile maximum, running maximum before and after,
rescale factor, P̃, running sum and accumulator. Below: the output O / l, the log-sum-exp,
the comparison with the plain softmax, and the backward of one key block.

One self-contained file, as every page of qkv: data in an escaped JSON block, style and
script inline and allowed by hash, no request; text is set with ``textContent`` only.
"""

from __future__ import annotations

from typing import Any

from qkv._format import visible
from qkv.render._html import _asset, self_contained
from qkv.render._tiled import TiledRun, tiled_data

__all__ = ["tiled_page", "tiled_page_data"]


def tiled_page_data(run: TiledRun, *, precision: int = 4) -> dict[str, Any]:
    """What the page's script reads: :func:`~qkv.render._tiled.tiled_data` with the title,
    the precision and every label made visible (control characters written out)."""
    data = tiled_data(run)
    data["title"] = visible(f"FlashAttention, tile by tile: {run.name}")
    data["name"] = visible(run.name)
    data["queries"] = [visible(t) for t in run.queries]
    data["keys"] = [visible(t) for t in run.keys]
    data["mask"] = None if not run.mask else visible(run.mask)
    data["causal"] = run.causal
    data["precision"] = precision
    return data


def tiled_page(run: TiledRun, *, precision: int = 4, practice: dict[str, Any] | None = None) -> str:
    """The HTML page of a tiled run (one file, works offline); with ``practice`` (the data of
    :func:`~qkv.render._practice_tiled.tiled_practice_data`), a section below where the
    learner types m, l and O tile by tile, each row judged as ``qkv check`` judges it.

    Example:
        >>> from qkv import examples
        >>> from qkv.render._tiled import tiled_run
        >>> page = tiled_page(tiled_run(examples.run(examples.builtin("two-heads"))))
        >>> page.startswith("<!DOCTYPE html>"), 'id="qkv-tiled"' in page
        (True, True)
    """
    data = tiled_page_data(run, precision=precision)
    script = _asset("tiled.js")
    if practice is not None:
        data["practice"] = _visible_practice(practice)
        script += "\n" + _asset("tiled_practice.js")
    main = (
        '<main id="qkv-tiled"><noscript>This page needs JavaScript to show the tiles.'
        "</noscript></main>"
    )
    return self_contained(str(data["title"]), _asset("tiled.css"), script, main, data)


def _visible_practice(practice: dict[str, Any]) -> dict[str, Any]:
    """The practice data with every token label made visible (control characters written
    out); the sentences come from ``qkv check``, which already quotes tokens visibly."""
    out = dict(practice)
    out["tokens"] = [visible(t) for t in practice["tokens"]]
    out["tiles"] = [
        {
            **tile,
            "keys": [visible(t) for t in tile["keys"]],
            "queries": [visible(t) for t in tile["queries"]],
            "rows": [{**row, "label": visible(row["label"])} for row in tile["rows"]],
        }
        for tile in practice["tiles"]
    ]
    out["final"] = [{**row, "label": visible(row["label"])} for row in practice["final"]]
    return out
