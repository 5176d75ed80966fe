"""``qkv explain``: every step of attention on a worked example, with its numbers."""

from __future__ import annotations

import argparse
import sys

from qkv.cli._common import Command, int_in_range, write_atomic
from qkv.render import FORMATS


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--example",
        "-e",
        metavar="NAME|PATH",
        help="a built-in example (see 'qkv examples') or a YAML/JSON example file "
        "(default: the first built-in)",
    )
    parser.add_argument(
        "--query",
        "-q",
        metavar="TOKEN",
        help="show only this query: a token of the example, or its 0-based position "
        "(default: the example's queries)",
    )
    parser.add_argument(
        "--no-scale",
        action="store_true",
        help="do not divide the scores by √d_k (to see why the scaling is there)",
    )
    parser.add_argument(
        "--causal",
        action="store_true",
        help="causal mask: each token attends only to itself and the tokens before it",
    )
    parser.add_argument(
        "--heads",
        type=int_in_range(1),
        metavar="H",
        help="split into H heads; H must divide d_k (default: the example's)",
    )
    parser.add_argument(
        "--format",
        "-f",
        choices=FORMATS,
        default="text",
        help="text for the terminal, markdown for a blog post, latex for a slide, json for "
        "programs (default: text)",
    )
    parser.add_argument(
        "--precision",
        "-p",
        type=int_in_range(0, 12),
        default=4,
        metavar="N",
        help="decimals of every number (default: 4)",
    )
    parser.add_argument(
        "--width",
        type=int_in_range(40),
        metavar="COLUMNS",
        help="line length of the text format (default: the terminal's, 80 in a file)",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="write to FILE instead of the terminal (atomically: no half-written file)",
    )


def _run(args: argparse.Namespace) -> int:
    from qkv import examples, render  # imported here: 'qkv --help' stays fast

    example = examples.resolve(args.example or examples.builtin_names()[0])
    trace = examples.run(
        example,
        query=args.query,
        scale=False if args.no_scale else None,
        causal=True if args.causal else None,
        heads=args.heads,
    )
    if args.output is not None:
        text = render.render(trace, args.format, precision=args.precision, width=args.width or 80)
        write_atomic(args.output, text)
        print(f"qkv: wrote {args.output} ({args.format})", file=sys.stderr)
    elif args.format == "text":
        from rich.console import Console

        console = Console(width=args.width, highlight=False, emoji=False, markup=False)
        render.print_text(trace, console, precision=args.precision)
    else:
        sys.stdout.write(render.render(trace, args.format, precision=args.precision))
    return 0


COMMAND = Command(
    name="explain",
    summary="show every step of attention on a worked example, with its numbers",
    description=(
        "Compute softmax(Q·Kᵀ/√d_k)·V on a worked example and show every step: the\n"
        "embeddings, the query, key and value vectors, the attention scores, the scaling,\n"
        "the softmax into attention weights (each row sums to 1) and each context vector\n"
        "as the weighted sum of the value vectors."
    ),
    examples=(
        ("qkv explain", 'the built-in example "I love statistics" (seed 000)'),
        ("qkv explain --example the-cat-sat-on-the-mat --query cat", "one query of six tokens"),
        ("qkv explain --no-scale", "the same without dividing the scores by √d_k"),
        ("qkv explain --example two-heads", "two heads, their concatenation and W_o"),
        ("qkv explain --causal --query 0", "each token attends only to itself and earlier ones"),
        ("qkv explain --example my-example.yaml", "your own example (docs/example-format.md)"),
        ("qkv explain --format markdown --output attention.md", "for a blog post"),
        ("qkv explain --format latex --precision 2", "for a slide"),
    ),
    configure=_configure,
    run=_run,
)
