"""``qkv heads``: what each head of a local Hugging Face model attends to, over many prompts.

Per layer and head: entropy, attention on the first token (sink), on the token before
(previous), on itself (diagonal), and the induction score on repeated random tokens
(:func:`qkv.head_stats`). A table per statistic; ``--html`` a page of heatmaps; ``--plot``
a figure (matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from qkv._format import visible
from qkv.cli._common import Command, CommandError, Output
from qkv.cli._hf_model import load, show, text_writer

__all__ = ["COMMAND"]

TEXTS_LIMIT = 1 << 20  # bytes of --texts
PROMPTS_LIMIT = 1000
_BLOCK = 8


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf",
        required=True,
        metavar="DIR",
        help="a local model folder (save_pretrained); read offline",
    )
    parser.add_argument(
        "--texts",
        required=True,
        metavar="FILE",
        help="the prompts, one a line (UTF-8; blank lines are skipped)",
    )
    parser.add_argument(
        "--format",
        "-f",
        choices=("text", "json", "csv"),
        default="text",
        help="the tables' format on the terminal or in --output",
    )
    parser.add_argument("--output", "-o", metavar="FILE", help="write the tables to FILE")
    parser.add_argument("--html", metavar="FILE", help="write a page of heatmaps")
    parser.add_argument(
        "--plot", metavar="FILE", help="write a figure of heatmaps, .png or .svg (needs qkv[viz])"
    )
    parser.add_argument("--induction-length", type=int, default=20, metavar="T",
                        help="random tokens repeated twice for the induction score "
                        "(default 20)")  # fmt: skip


def _prompts(path: str) -> list[str]:
    from qkv._read import read_bytes

    try:
        data = read_bytes(path, limit=TEXTS_LIMIT, what="a file of prompts")
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CommandError(
            f"--texts '{visible(path)}' is not UTF-8 text (byte {error.start}). Hint: save "
            "the prompts as UTF-8, one a line"
        ) from None
    except (ValueError, OSError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise CommandError(f"--texts '{visible(path)}': {reason}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CommandError(f"--texts '{visible(path)}' holds no prompt. Hint: one prompt a line")
    if len(prompts) > PROMPTS_LIMIT:
        raise CommandError(
            f"--texts '{visible(path)}' holds {len(prompts)} prompts, more than "
            f"{PROMPTS_LIMIT}. Hint: a sample of them"
        )
    return prompts


def _run(args: argparse.Namespace) -> int:
    if not 2 <= args.induction_length <= 512:
        raise CommandError(
            f"--induction-length must be from 2 to 512, got {args.induction_length}. Hint: "
            "the default 20"
        )
    prompts = _prompts(args.texts)
    loaded = load(args.hf, "qkv heads")
    from qkv.hf._text import _max_positions, tokenize

    ids = []
    for number, prompt in enumerate(prompts, start=1):
        try:
            ids.append(tokenize(loaded, prompt)[0])
        except ValueError as error:
            raise CommandError(f"--texts line {number}: {error}") from None
    import qkv

    length = args.induction_length
    limit = _max_positions(loaded.model.config)
    if limit is not None and 2 * length > limit:
        length = limit // 2
    stats = qkv.head_stats(loaded.model, ids, induction_length=length)
    title = f"Heads of {Path(str(loaded.name)).name} ({loaded.family}), {stats.prompts} prompts"
    outputs = []
    if args.html is not None:
        from qkv.render._heads_page import heads_page

        page = heads_page(title, list(stats.layers), stats.values)
        outputs.append(Output("--html", args.html, text_writer(page), "page", (".html",)))
    if args.plot is not None:
        outputs.append(
            Output("--plot", args.plot, lambda p: _plot(p, stats, title), "figure",
                   (".png", ".svg"))
        )  # fmt: skip
    rendered = _render(args.format, stats, title)
    return show(rendered, args.format, args.output, outputs)


def _number(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.3f}"


def _render(fmt: str, stats: Any, title: str) -> str:
    if fmt == "json":
        data = {
            "title": visible(title),
            "prompts": stats.prompts,
            "tokens": stats.tokens,
            "layers": [visible(layer) for layer in stats.layers],
            "statistics": {
                name: [[None if math.isnan(v) else v for v in row] for row in table]
                for name, table in stats.values.items()
            },
        }
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        names = list(stats.values)
        writer.writerow(["layer", "module", "head", *names])
        for layer, path in enumerate(stats.layers):
            for head in range(len(stats.values[names[0]][layer])):
                cells = [stats.values[n][layer][head] for n in names]
                writer.writerow(
                    [layer, visible(path), head, *("" if math.isnan(v) else repr(v) for v in cells)]
                )
        return out.getvalue()
    from qkv.render._heads_page import MEANINGS

    lines: list[str] = [visible(title)[:80], f"{stats.tokens} tokens; layers:"]
    lines += [visible(f"  {i}: {path}")[:80] for i, path in enumerate(stats.layers)]
    for name, table in stats.values.items():
        heads = max((len(row) for row in table), default=0)
        lines += ["", f"{name}: {MEANINGS[name]}"[:80]]
        for first in range(0, heads, _BLOCK):
            shown = range(first, min(first + _BLOCK, heads))
            lines.append("layer " + "".join(f"{'head ' + str(h):>9}" for h in shown))
            for layer, row in enumerate(table):
                numbers = "".join(f"{_number(row[h]):>9}" for h in shown if h < len(row))
                lines.append(f"{layer:>5} {numbers}")
    return "\n".join(lines) + "\n"


def _plot(path: Path, stats: Any, title: str) -> None:
    from qkv._extras import MissingExtraError, require

    try:
        matplotlib = require("matplotlib", feature="qkv heads --plot", extra="viz")
    except MissingExtraError as error:
        raise CommandError(str(error)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(stats.values)
    figure, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2))
    for axis, name in zip(axes, names, strict=True):
        table = np.array(stats.values[name], dtype=float)
        image = axis.imshow(table, cmap="Blues", aspect="auto")
        axis.set_title(name)
        axis.set_xlabel("head")
        axis.set_ylabel("layer")
        figure.colorbar(image, ax=axis, shrink=0.8)
    figure.suptitle(visible(title))
    figure.tight_layout()
    figure.savefig(path, format=path.suffix.lstrip(".").lower() or "png")
    plt.close(figure)


COMMAND = Command(
    name="heads",
    summary="what each head of a Hugging Face model attends to",
    description=(
        "Per layer and head of a local model: the entropy of its attention, the share\n"
        "on the first token (sink), on the token before (previous), on itself (diagonal)\n"
        "and the induction score on repeated random tokens. Exact, on the fast path\n"
        "(docs/interventions.md). Needs qkv[hf] (torch and transformers)."
    ),
    examples=(
        ("qkv heads --hf DIR --texts prompts.txt", "the tables, one prompt a line"),
        ("qkv heads --hf DIR --texts prompts.txt --html heads.html", "a page of heatmaps"),
        ("qkv heads --hf DIR --texts prompts.txt -f csv -o heads.csv", "one row per head"),
    ),
    configure=_configure,
    run=_run,
)
