"""``qkv check``: compare the numbers a worked example claims with the correct ones.

Exit status: 0 when every claimed row matches (rounding notes allowed), 1 when one does not,
2 for an unusable file (one line ``qkv: error: ...`` naming the field and the line; nothing
is printed as a result).
"""

from __future__ import annotations

import argparse

from qkv.cli._common import Command, CommandError, add_output_options, emit

_FORMATS = ("text", "markdown", "json")  # qkv.check.FORMATS, without importing it for --help


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help="a YAML or JSON example file with claimed numbers (docs/example-format.md)",
    )
    parser.add_argument(
        "--example",
        "-e",
        metavar="NAME",
        help="a built-in example (see 'qkv examples') or the path of an example file",
    )
    parser.add_argument(
        "--format",
        "-f",
        choices=_FORMATS,
        default="text",
        help="text for the terminal, markdown for a page, json for programs (default: text)",
    )
    add_output_options(parser, "write the report to FILE instead of the terminal (atomically)")


def _run(args: argparse.Namespace) -> int:
    if args.file is not None and args.example is not None:
        raise CommandError(
            "give an example FILE or --example NAME, not both. Hint: 'qkv check mine.yaml' "
            "or 'qkv check --example i-love-statistics'"
        )
    if args.file is None and args.example is None:
        raise CommandError(
            "nothing to check: give an example FILE or --example NAME. Hint: try "
            "'qkv check --example i-love-statistics' (seed 000 and its printed numbers), "
            "or see 'qkv check --help'"
        )
    from qkv import examples  # imported here: 'qkv --help' stays fast
    from qkv.check import check

    # FILE is always a path (even one named like a built-in); --example a name or a path.
    example = examples.load(args.file) if args.file is not None else examples.resolve(args.example)
    report = check(example)
    emit(args, lambda width: report.render(args.format, width=width), report.print)
    return 0 if report.ok else 1


COMMAND = Command(
    name="check",
    summary="check the numbers of a hand-worked example and name the mistake",
    description=(
        "Compare every number a worked example claims (Q, K, V, scores, scaled, weights,\n"
        "context, output) with the correct one, in the order of computation. Each number\n"
        "is judged to its printed precision, widened by the rounding carried from the\n"
        "steps before. A wrong step is named: the common slip that reproduces it\n"
        "(unscaled, scaled-by-dk, transposed-weights, softmax-wrong-axis,\n"
        "query-key-swapped, context-not-summed, wrong-query) or an arithmetic mistake; a\n"
        "step done right on wrong numbers is 'consequential'.\n\n"
        "Exit status: 0 all match, 1 something does not, 2 the file cannot be used.\n"
        "See docs/check.md."
    ),
    examples=(
        ("qkv check --example i-love-statistics", "seed 000: which of its numbers are wrong"),
        ("qkv check my-example.yaml", "your own example, with the numbers under 'claimed:'"),
        ("qkv check my-example.yaml --format json", "for programs (a stable schema)"),
        ("qkv check --example i-love-statistics -f markdown -o check.md", "a page to share"),
        ("qkv examples --show i-love-statistics > mine.yaml", "a start for your own"),
    ),
    configure=_configure,
    run=_run,
)
