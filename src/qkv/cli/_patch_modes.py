"""``qkv patch --by position`` and ``--by path``, and the table pieces every mode shares.

``--by position`` runs :func:`qkv.edits.position_patching`: each head patched at one token
at a time; its table has a row per head (``layer.head``) and a column per position.
``--by path`` runs :func:`qkv.edits.path_patching`: each earlier head patched along one
path only, as the ``--receiver`` head reads it through its ``--through`` (queries, keys or
values); its table is the senders' layer x head table. ``--layer`` and ``--head`` choose
the heads the table shows (counted from the end when negative, as ``--layer`` counts
elsewhere); ``--positions`` the tokens patched.

The text tables fit 80 columns: columns come in blocks, as many as fit beside the row
labels (8 of 9 characters beside labels of 5).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from qkv._format import visible
from qkv.cli._common import CommandError

__all__ = [
    "NO_EFFECT",
    "THROUGH",
    "Selection",
    "effect_lines",
    "grid",
    "number",
    "path_render",
    "position_grid",
    "position_page",
    "position_render",
    "positions_type",
    "receiver",
    "receiver_type",
    "resolve_positions",
    "select",
    "short",
    "sweeping",
    "visible_side",
]

T = TypeVar("T")

NO_EFFECT = 1e-6
"""A head whose patch moves the metric by no more than this has no effect."""

WIDTH = 80
"""The text table's most columns."""

CELL = 9
"""The width of one number of a table (``  +5.5705``)."""

THROUGH = {"q": "queries", "k": "keys", "v": "values"}
"""``--through``: what the receiver reads, in the words of ``path_patching``."""

_INTEGER = re.compile(r"-?[0-9]+")
_POSITIONS = re.compile(r"(-?[0-9]+|[0-9]+-[0-9]+)(,(-?[0-9]+|[0-9]+-[0-9]+))*")
_RECEIVER = re.compile(r"(.+)\.(-?[0-9]+)")


def number(value: float) -> str:
    """A metric's value as the tables write it: a sign and 4 decimals (``nan``)."""
    return "nan" if math.isnan(value) else f"{value:+.4f}"


def short(text: str, width: int) -> str:
    """``text`` (control characters written out) cut to ``width`` columns with an ellipsis."""
    text = visible(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def visible_side(side: dict[str, Any]) -> dict[str, Any]:
    """A prompt's text and tokens with control characters written out (for JSON)."""
    return {**side, "text": visible(side["text"]), "tokens": [visible(t) for t in side["tokens"]]}


def grid(
    header: Sequence[tuple[str, Sequence[str]]],
    rows: Sequence[tuple[str, Sequence[float | None]]],
) -> list[str]:
    """A table of numbers in blocks of columns that fit :data:`WIDTH`.

    ``header``: one or more lines, each (its corner text, a label per column); ``rows``:
    (a label, a number per column; None leaves the cell blank). Each block starts with an
    empty line. Example:

        >>> print("\\n".join(grid([("layer", ["head 0"])], [("0", [1.5])])))
        <BLANKLINE>
        layer    head 0
            0   +1.5000
    """
    label = max([5, *(len(text) for text, _ in rows), *(len(c) for c, _ in header)])
    per_block = max(1, (WIDTH - label - 1) // CELL)
    columns = max((len(labels) for _, labels in header), default=0)
    lines: list[str] = []
    for first in range(0, columns, per_block):
        shown = range(first, min(first + per_block, columns))
        lines.append("")
        for corner, labels in header:
            cells = "".join(f"{short(labels[c], CELL - 1):>{CELL}}" for c in shown)
            lines.append(f"{corner:<{label}} {cells}".rstrip())
        for text, values in rows:
            cells = "".join(_cell(values[c] if c < len(values) else None) for c in shown)
            lines.append(f"{text:>{label}} {cells}".rstrip())
    return lines


def _cell(value: float | None) -> str:
    """One number of a table, :data:`CELL` wide (blank for None)."""
    return " " * CELL if value is None else f"{number(value):>{CELL}}"


def effect_lines(result: Any, name: Callable[[int, int], str], nothing: str) -> list[str]:
    """The table's last lines: the cell (row, column) of ``result`` (a
    :class:`~qkv.edits.PatchingResult`) that moves the metric furthest, named by ``name``,
    and its share of the way from corrupt to clean, or why no share is shown."""
    from qkv.edits._patching import BARELY

    row, column = result.best()
    value = result.values[row][column]
    if not abs(value - result.corrupt) > NO_EFFECT:
        return ["", nothing]
    lines = ["", f"largest effect: {name(row, column)}: {number(value)}"]
    if result.barely_differ():
        apart = abs(result.clean - result.corrupt)
        return [
            *lines,
            f"clean and corrupt barely differ ({apart:.2g} apart, within {BARELY:.0%} of the "
            "metric's",
            f"scale, {result.scale():.3g}): no share of the way between them is shown",
        ]
    part = result.normalized()[row][column]
    share = f"{part if round(part * 100) else 0.0:.0%} of the way from corrupt to clean"
    if len(lines[-1]) + 2 + len(share) <= WIDTH:
        lines[-1] += ", " + share
    else:
        lines.append(share)
    return lines


def sweeping(run: Callable[[], T], batch: int | None) -> T:
    """``run()``, a sweep of :mod:`qkv.edits`; a batch that does not fit in memory is
    said in the command line's words (``--batch``)."""
    try:
        return run()
    except ValueError as error:
        text = str(error).split(": ", 1)[-1]
        if "this process may still take" not in text:
            raise
        text = text.replace("Hint: batch=", "Hint: --batch ").rstrip(".")
        raise CommandError(f"--batch {batch or '(default)'}: {text}") from None


# -- the options -----------------------------------------------------------------------------


def positions_type(text: str) -> list[int]:
    """``--positions``: positions and ranges, ``0,3,5-9`` (from 0; a single one may be
    negative, from the end). argparse names the option and exits 2 on a bad one."""
    spaced = text.replace(" ", "")
    if not _POSITIONS.fullmatch(spaced):
        raise argparse.ArgumentTypeError(
            f"expected positions such as 0,3,5-9 (a single one may be negative: -1 is the "
            f"last token), got {text!r}"
        )
    found: list[int] = []
    for item in spaced.split(","):
        if _INTEGER.fullmatch(item):
            found.append(int(item))
            continue
        low, high = (int(part) for part in item.split("-"))
        if low > high:
            raise argparse.ArgumentTypeError(
                f"expected a range from low to high such as 5-9, got {item!r} in {text!r}"
            )
        found += range(low, high + 1)
    return found


def receiver_type(text: str) -> tuple[int | str, int]:
    """``--receiver LAYER.HEAD``: the layer (a position among the attention layers, negative
    from the end, or a module path) and the head (negative from the end)."""
    matched = _RECEIVER.fullmatch(text.strip())
    if matched is None:
        raise argparse.ArgumentTypeError(
            f"expected LAYER.HEAD, such as 1.0 (head 0 of layer 1) or "
            f"model.layers.1.self_attn.0, got {text!r}"
        )
    layer, head = matched.group(1), int(matched.group(2))
    return (int(layer) if _INTEGER.fullmatch(layer) else layer), head


def resolve_positions(given: list[int] | None, tokens: Sequence[str]) -> list[int] | None:
    """``--positions`` against the prompt's tokens: each from 0, in order, once."""
    if given is None:
        return None
    count = len(tokens)
    chosen: list[int] = []
    for position in given:
        if not -count <= position < count:
            listed = ", ".join(f"{i} {visible(t)}" for i, t in enumerate(tokens[:12]))
            raise CommandError(
                f"--positions: position {position} is outside the {count} tokens, expected "
                f"0 to {count - 1} (or -{count} to -1). Hint: the tokens are {listed}"
                + (", ..." if count > 12 else "")
            )
        if position % count not in chosen:
            chosen.append(position % count)
    return chosen


def _layer_value(text: str) -> int | str:
    return int(text) if _INTEGER.fullmatch(text) else text


@dataclass(frozen=True)
class Selection:
    """The heads the table shows: ``layers`` (indices; None: every one) and ``head`` (an
    index, negative from the end; None: every one)."""

    layers: tuple[int, ...] | None
    head: int | None

    def cells(self, counts: Sequence[int]) -> list[tuple[int, int]]:
        """The (layer, head) pairs shown, for a table of ``counts[layer]`` heads."""
        cells = []
        for layer, count in enumerate(counts):
            if self.layers is not None and layer not in self.layers:
                continue
            if self.head is None:
                cells += [(layer, h) for h in range(count)]
            elif -count <= self.head < count:
                cells.append((layer, self.head % count))
            else:
                raise CommandError(
                    f"--head {self.head}: layer {layer} has {count} query heads, expected a "
                    f"head from 0 to {count - 1} (or negative from the end). Hint: leave out "
                    "--head for every head"
                )
        return cells


def select(layers: Any, args: argparse.Namespace, before: int | None = None) -> Selection:
    """``--layer`` and ``--head`` checked against the model's attention ``layers`` (a
    :class:`~qkv.edits._model.Layers`); ``before``: the layers must come before this one
    (the senders of a path)."""
    index = None
    if args.layer is not None:
        try:
            index = layers.index(_layer_value(args.layer), f"--layer {args.layer}")
        except ValueError as error:
            raise CommandError(str(error).rstrip(".")) from None
        if before is not None and index >= before:
            raise CommandError(
                f"--layer {args.layer}: the senders of a path are the layers before the "
                f"receiver's (0 to {before - 1}), got layer {index}. Hint: a layer before "
                f"{before}, or a later --receiver"
            )
    if args.head is not None:
        for checked in (index,) if index is not None else range(before or len(layers.paths)):
            try:
                layers.head(checked, args.head, f"--head {args.head}")
            except ValueError as error:
                raise CommandError(str(error).rstrip(".")) from None
    return Selection(None if index is None else (index,), args.head)


def receiver(layers: Any, given: tuple[int | str, int], text: str) -> tuple[int, int]:
    """``--receiver`` as (layer index, head from 0), checked against the model."""
    where = f"--receiver {text}"
    try:
        layer = layers.index(given[0], where)
        head = layers.head(layer, given[1], where)
    except ValueError as error:
        raise CommandError(str(error).rstrip(".")) from None
    if layer == 0:
        raise CommandError(
            f"{where}: layer 0 has no earlier heads to send to it, expected a receiver in "
            "layer 1 or later. Hint: --receiver 1.0 is head 0 of layer 1"
        )
    return layer, head


# -- by position -----------------------------------------------------------------------------


def position_grid(result: Any, cells: list[tuple[int, int]]) -> Any:
    """A :class:`~qkv.edits.PatchingResult` of a sweep by position: a row per (layer,
    head) of ``cells``, a column per position (its scale, share and best cell those of the
    rows shown)."""
    from qkv.edits import PatchingResult

    rows = [[row[h] for row in result.values[layer]] for layer, h in cells]
    return PatchingResult(rows, result.layers, result.clean, result.corrupt, "context")


def position_page(
    result: Any, cells: list[tuple[int, int]], tokens: Sequence[str]
) -> dict[str, Any]:
    """The heatmap page's table of a sweep by position (:mod:`qkv.render._patch_page`): a
    row per (layer, head) of ``cells`` labelled ``layer.head``, a column per position
    labelled with its clean token; a click on a cell opens its head's steps."""
    shown = position_grid(result, cells)
    return {
        "title": "Patching by position",
        "what": "context at that position",
        "values": shown.values,
        "normalized": shown.normalized(),
        "best": list(shown.best()),
        "rows": [{"label": f"{layer}.{h}", "layer": layer, "head": h} for layer, h in cells],
        "columns": [f"{p} {tokens[p]}" for p in result.positions],
        "corner": "layer.head",
    }


def position_render(
    fmt: str, result: Any, cells: list[tuple[int, int]], facts: dict[str, Any]
) -> str:
    """The table of a :class:`~qkv.edits.PositionPatchingResult`, one row per (layer, head)
    of ``cells`` and one column per position, in ``fmt`` (text, json or csv)."""
    tokens = facts["clean"]["tokens"]
    table = position_grid(result, cells)
    rows, normalized = table.values, table.normalized()
    if fmt == "text":
        lines = _title("each head's context at one position", facts, result)
        lines.append("rows: layer.head; columns: the position patched and its clean token")
        header = [
            ("L.H", [f"pos {p}" for p in result.positions]),
            ("", [tokens[p] for p in result.positions]),
        ]
        labels = [f"{layer}.{h}" for layer, h in cells]
        lines += grid(header, list(zip(labels, rows, strict=True)))

        def name(row: int, column: int) -> str:
            layer, head = cells[row]
            position = result.positions[column]
            return (
                f"layer {layer}, head {head} at position {position} ({short(tokens[position], 12)})"
            )

        nothing = "no head at any position moves the metric from the corrupt run's"
        lines += effect_lines(table, name, nothing)
        if lines[-1] != nothing:
            layer = cells[table.best()[0]][0]
            lines.append(short(f"layer {layer} is {result.layers[layer]}", WIDTH))
        return "\n".join(lines) + "\n"
    if fmt == "json":
        data = {
            **_head_facts(facts, "position"),
            "positions": list(result.positions),
            "rows": [
                {
                    "layer": layer,
                    "module": visible(result.layers[layer]),
                    "head": h,
                    "values": row,
                    "normalized": [None if math.isnan(v) else v for v in share],
                }
                for (layer, h), row, share in zip(cells, rows, normalized, strict=True)
            ],
            "barely_differ": table.barely_differ(),
        }
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["layer", "module", "head", "position", "token", "value", "normalized"])
    for (layer, h), row, share in zip(cells, rows, normalized, strict=True):
        for position, value, part in zip(result.positions, row, share, strict=True):
            writer.writerow(
                [layer, visible(result.layers[layer]), h, position, visible(tokens[position]),
                 repr(value), "" if math.isnan(part) else repr(part)]
            )  # fmt: skip
    return out.getvalue()


# -- by path ---------------------------------------------------------------------------------


def path_render(
    fmt: str,
    result: Any,
    cells: list[tuple[int, int]],
    facts: dict[str, Any],
    receiving: dict[str, Any],
) -> str:
    """The table of :func:`~qkv.edits.path_patching`'s result (the senders' layer x head),
    the heads of ``cells`` only, in ``fmt``; ``receiving``: the receiver's ``layer``,
    ``module``, ``head`` and ``through``."""
    from qkv.edits import PatchingResult

    values = [result.values[layer][h] for layer, h in cells]
    table = PatchingResult([values], result.layers, result.clean, result.corrupt, "path")
    normalized = table.normalized()[0]
    if fmt == "text":
        into = f"layer {receiving['layer']} head {receiving['head']}'s {receiving['through']}"
        lines = _title(f"paths into {into}", facts, result)
        heads = sorted({h for _, h in cells})
        found = dict(zip(cells, values, strict=True))
        rows = [
            (str(layer), [found.get((layer, h)) for h in heads])
            for layer in sorted({layer for layer, _ in cells})
        ]
        lines += grid([("layer", [f"head {h}" for h in heads])], rows)

        def name(_: int, column: int) -> str:
            return f"layer {cells[column][0]}, head {cells[column][1]}"

        nothing = "no path moves the metric from the corrupt run's"
        lines += effect_lines(table, name, nothing)
        if lines[-1] != nothing:
            layer = cells[table.best()[1]][0]
            lines.append(short(f"layer {layer} is {result.layers[layer]}", WIDTH))
        lines += [
            short(f"receiver: head {receiving['head']} of {receiving['module']}", WIDTH),
            "each head patched along that path only, the layers between frozen to corrupt",
        ]
        return "\n".join(lines) + "\n"
    if fmt == "json":
        data = {
            **_head_facts(facts, "path"),
            "receiver": {k: receiving[k] for k in ("layer", "module", "head")},
            "through": receiving["through"],
            "rows": [
                {
                    "layer": layer,
                    "module": visible(result.layers[layer]),
                    "head": h,
                    "value": value,
                    "normalized": None if math.isnan(share) else share,
                }
                for (layer, h), value, share in zip(cells, values, normalized, strict=True)
            ],
            "barely_differ": table.barely_differ(),
        }
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["layer", "module", "head", "value", "normalized"])
    for (layer, h), value, share in zip(cells, values, normalized, strict=True):
        writer.writerow(
            [layer, visible(result.layers[layer]), h, repr(value),
             "" if math.isnan(share) else repr(share)]
        )  # fmt: skip
    return out.getvalue()


def _title(what: str, facts: dict[str, Any], result: Any) -> list[str]:
    """The first lines of a text table: what was patched, the metric, both prompts'."""
    return [
        short(f"qkv patch: {what}, clean into corrupt ({facts['model']}, {facts['family']})",
              WIDTH),
        short(f"metric: {facts['metric']} at the last token", WIDTH),
        short(f"clean   {number(result.clean)}  {facts['clean']['text']}", WIDTH),
        short(f"corrupt {number(result.corrupt)}  {facts['corrupt']['text']}", WIDTH),
    ]  # fmt: skip


def _head_facts(facts: dict[str, Any], by: str) -> dict[str, Any]:
    """The JSON's first keys: the mode, the model, the metric and both prompts."""
    return {
        "by": by,
        "model": facts["model"],
        "family": facts["family"],
        "metric": facts["metric"],
        "what": "context",
        **{side: visible_side(facts[side]) for side in ("clean", "corrupt")},
    }
