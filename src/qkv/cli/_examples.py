"""``qkv examples``: the built-in worked examples, one line each, or one of them in full."""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from qkv.cli._common import Command

_WIDTH = 80


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--show",
        metavar="NAME",
        help="print the YAML file of a built-in example (a start for your own)",
    )


def _fit(line: str) -> str:
    return line if len(line) <= _WIDTH else line[: _WIDTH - 1] + "…"


def _run(args: argparse.Namespace) -> int:
    from qkv import examples

    if args.show:
        slug = examples.builtin(args.show).slug or args.show
        data = resources.files("qkv.examples").joinpath("data", f"{slug}.yaml")
        sys.stdout.write(data.read_text(encoding="utf-8"))
        return 0
    rows = []
    for slug in examples.builtin_names():
        example = examples.builtin(slug)
        first = " ".join(example.description.split()).split(". ")[0].rstrip(".")
        rows.append((slug, str(len(example.tokens)), str(example.heads), example.name, first))
    header = ("NAME", "TOKENS", "HEADS", "TITLE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        line = f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}"
        print(_fit(line))
        if len(row) > 4 and row[4]:
            print(_fit(f"    {row[4]}."))
    print()
    print("Run one with: qkv explain --example NAME")
    return 0


COMMAND = Command(
    name="examples",
    summary="list the built-in worked examples",
    description="List the built-in worked examples of 'qkv explain', or print one as YAML.",
    examples=(
        ("qkv examples", "one line per built-in example"),
        ("qkv examples --show i-love-statistics > mine.yaml", "a start for your own example"),
        ("qkv explain --example mine.yaml", "explain it"),
    ),
    configure=_configure,
    run=_run,
)
