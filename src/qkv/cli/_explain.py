"""``qkv explain``: every step of attention on a worked example, with its numbers."""

from __future__ import annotations

import argparse
import sys

from qkv.cli._common import (
    Command,
    CommandError,
    add_output_options,
    emit,
    int_in_range,
    refuse_options,
)
from qkv.render import FORMATS, MATRIX_STEPS
from qkv.trace import Trace


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--example",
        "-e",
        metavar="NAME|PATH",
        help="a built-in example (see 'qkv examples') or a YAML/JSON example file "
        "(default: the first built-in)",
    )
    parser.add_argument(
        "--trace",
        "-t",
        metavar="FILE",
        help="show a saved trace instead of an example: a JSON file from Trace.save, e.g. "
        "of a model under qkv.tracing(model=...)",
    )
    parser.add_argument(
        "--model",
        "-m",
        metavar="RUN",
        help="explain a model trained with 'qkv train' (its --out folder or a checkpoint) "
        "on --text (docs/training.md)",
    )
    parser.add_argument("--text", metavar="TEXT", help="with --model: the sentence to explain")
    parser.add_argument(
        "--layer",
        metavar="NAME",
        help="with --model: which attention layer (default: the self-attention; 'pool' for "
        "a classifier's attention pooling)",
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
    add_output_options(
        parser, "write to FILE instead of the terminal (atomically: no half-written file)"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="draw the attention weights as heatmaps, one panel per head, to a .png or .svg "
        "file (needs qkv[viz]); the terminal then shows nothing",
    )
    parser.add_argument(
        "--plot-step",
        choices=MATRIX_STEPS,
        default="weights",
        metavar="STEP",
        help="what --plot draws: weights (default), scores, scaled, masked, ...",
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="write an interactive page (head view, every step) to FILE: one file, no "
        "network; the terminal then shows nothing",
    )
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also say (on stderr) which attention backend computed it and why the others "
        "were not used",
    )


def _run(args: argparse.Namespace) -> int:
    from qkv import examples, render  # imported here: 'qkv --help' stays fast

    if args.model is not None or args.text is not None or args.layer is not None:
        from qkv.cli._train import model_trace  # a trained model: qkv.train, PyTorch

        trace = model_trace(args)
    elif args.trace is not None:
        trace = _saved_trace(args)
    else:
        example = examples.resolve(args.example or examples.builtin_names()[0])
        trace = examples.run(
            example,
            query=args.query,
            scale=False if args.no_scale else None,
            causal=True if args.causal else None,
            heads=args.heads,
        )
        if args.verbose:
            from qkv.attention import dispatch_of_trace

            print(dispatch_of_trace(trace), file=sys.stderr)
    if args.plot is not None or args.html is not None:
        _pictures(trace, args)
        if args.output is None:
            return 0
    emit(
        args,
        lambda width: render.render(trace, args.format, precision=args.precision, width=width),
        lambda console: render.print_text(trace, console, precision=args.precision),
    )
    return 0


def _saved_trace(args: argparse.Namespace) -> Trace:
    """The trace of ``--trace FILE``, shown as recorded (``--query`` picks one query row)."""
    refuse_options(
        {
            "--example": args.example,
            "--no-scale": args.no_scale,
            "--causal": args.causal,
            "--heads": args.heads,
        },
        alongside="--trace",
        reason="a saved trace is shown as it was recorded. Hint: record what you want to see, "
        "e.g. qkv.tracing(heads=[0])",
    )
    try:
        trace = Trace.load(args.trace)
    except OSError as error:
        raise CommandError(
            f"--trace {args.trace!r}: cannot read the trace ({error.strerror or error})"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise CommandError(
            f"--trace {args.trace!r}: {error}. Hint: save one with trace.save('trace.json')"
        ) from None
    if args.query is not None:
        trace.meta["queries"] = [
            int(args.query) if args.query.lstrip("-").isdigit() else args.query
        ]
    return trace


def _pictures(trace: Trace, args: argparse.Namespace) -> None:
    """Write the --plot and --html files, one line each on stderr."""
    from qkv import render
    from qkv._extras import MissingExtraError

    if args.plot is not None:
        try:
            render.heatmap(trace, args.plot, step=args.plot_step)
        except MissingExtraError as error:
            raise CommandError(str(error)) from None
        print(f"qkv: wrote {args.plot} (the {args.plot_step}, one panel per head)", file=sys.stderr)
    if args.html is not None:
        render.html(trace, args.html, precision=args.precision)
        print(f"qkv: wrote {args.html} (open it in a browser)", file=sys.stderr)


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
        ("qkv explain --trace trace.json", "a trace saved with Trace.save (docs/nn.md)"),
        ("qkv explain --example two-heads --plot weights.png", "a heatmap per head (or .svg)"),
        ("qkv explain --html explain.html", "an interactive page to open in a browser"),
        ("qkv explain --model runs/classify --text 'not bad at all'", "a trained model"),
    ),
    configure=_configure,
    run=_run,
)
