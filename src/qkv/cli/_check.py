"""``qkv check``: compare the numbers a worked example claims with the correct ones.

Exit status: 0 when every claimed row matches (rounding notes allowed), 1 when one does not,
2 for an unusable file (one line ``qkv: error: ...`` naming the field and the line; nothing
is printed as a result).

``qkv check --function FILE.py:NAME --kind KIND`` checks an attention function instead: 0 when
it is right, 1 when it makes a mistake, 2 when it cannot be loaded or called
(docs/check-function.md).
"""

from __future__ import annotations

import argparse
import math

from qkv.cli._common import Command, CommandError, add_output_options, emit

_FORMATS = ("text", "markdown", "json")  # qkv.check.FORMATS, without importing it for --help
_KINDS = ("attention", "causal", "multi-head")  # qkv.check._probes.KINDS
_MASK_MEANINGS = ("allow", "ignore", "additive")
_ARRAYS = ("auto", "numpy", "torch")
_ALIGNMENTS = ("top-left", "bottom-right")
_ISOLATIONS = ("auto", "bubblewrap", "namespaces", "process")  # qkv.check.ISOLATIONS


def _seconds(text: str) -> float:
    """An argparse ``type``: a positive finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive finite number of seconds, got {text!r}"
        )
    return value


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
    group = parser.add_argument_group(
        "checking an attention function (RUNS the file's code, in its own process)"
    )
    group.add_argument(
        "--function",
        metavar="FILE.py:NAME",
        help="check the function NAME of FILE.py instead of an example: which slip it makes. "
        "Loading FILE.py runs its code, like 'python FILE.py': only check code you would run",
    )
    group.add_argument(
        "--kind",
        choices=_KINDS,
        default="attention",
        help="attention: NAME(Q, K, V) or NAME(Q, K, V, mask); causal: NAME(Q, K, V) is causal; "
        "multi-head: NAME(X, W_q, W_k, W_v, W_o, num_heads), row vectors (default: attention)",
    )
    group.add_argument(
        "--mask-means",
        choices=_MASK_MEANINGS,
        default="allow",
        help="the mask given to NAME(Q, K, V, mask): allow = True may attend, ignore = True is "
        "masked out, additive = 0 or -inf added to the scores (default: allow)",
    )
    group.add_argument(
        "--array",
        choices=_ARRAYS,
        default="auto",
        help="probe with NumPy arrays or torch tensors; auto tries NumPy, then torch "
        "(default: auto)",
    )
    group.add_argument(
        "--causal-alignment",
        choices=_ALIGNMENTS,
        default="top-left",
        help="the causal rule meant when Lq != Lk: top-left (query i sees keys 0..i, "
        "PyTorch's is_causal) or bottom-right (default: top-left)",
    )
    group.add_argument(
        "--batched",
        action="store_true",
        help="also require batched (B, H, L, d) inputs to work (attention, causal); without "
        "it the probes are (L, d)",
    )
    group.add_argument(
        "--timeout",
        type=_seconds,
        default=20.0,
        metavar="SECONDS",
        help="stop the function's process after SECONDS (default: 20)",
    )
    group.add_argument(
        "--isolation",
        choices=_ISOLATIONS,
        default="auto",
        help="how the file's code is kept from this machine: bubblewrap (read-only system, "
        "no network), namespaces (no network, no signal out), process (a process tree "
        "qkv ends); auto takes the strongest available (default: auto)",
    )
    add_output_options(parser, "write the report to FILE instead of the terminal (atomically)")


def _run_function(args: argparse.Namespace) -> int:
    if args.file is not None or args.example is not None:
        raise CommandError(
            "give --function FILE.py:NAME or an example, not both. Hint: 'qkv check --function "
            "student.py:attention --kind attention'"
        )
    from qkv.check import check_function_file

    report = check_function_file(
        args.function,
        args.kind,
        mask_means=args.mask_means,
        array=args.array,
        alignment=args.causal_alignment,
        timeout=args.timeout,
        batched=args.batched,
        isolation=args.isolation,
    )
    emit(args, lambda width: report.render(args.format, width=width), report.print)
    return 0 if report.ok else 1


def _run(args: argparse.Namespace) -> int:
    if args.function is not None:
        return _run_function(args)
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
        "Compare every number a worked example claims (Q, K, V, scores, scaled, exp,\n"
        "exp_sum, weights, products, context, output) with the correct one, in the order\n"
        "of computation. Each number is judged to its printed precision, widened by the\n"
        "rounding carried from the steps before (format 2: exact numbers carry none, and\n"
        "inputs declared rounded widen it). A wrong step is named: the common slip that\n"
        "reproduces it (unscaled, scaled-by-dk, transposed-weights, softmax-wrong-axis,\n"
        "query-key-swapped, context-not-summed, wrong-query; format 2 adds\n"
        "scaled-by-dmodel, sum-normalised, mask-ignored, mask-inverted,\n"
        "causal-misaligned, other-weights, heads-averaged, not-softmax, digit-slip) or an\n"
        "arithmetic mistake; a step done right on wrong numbers is 'consequential'.\n\n"
        "Exit status: 0 all match, 1 something does not, 2 the file cannot be used.\n"
        "See docs/check.md.\n\n"
        "With --function FILE.py:NAME it checks an attention function instead and names\n"
        "its slip (docs/check-function.md). WARNING: this imports FILE.py, which runs its\n"
        "code; it runs sandboxed (--isolation: bubblewrap where installed), in a fresh\n"
        "temporary folder, with a time limit (--timeout) and resource limits."
    ),
    examples=(
        ("qkv check --example i-love-statistics", "seed 000: which of its numbers are wrong"),
        ("qkv check my-example.yaml", "your own example, with the numbers under 'claimed:'"),
        ("qkv check my-example.yaml --format json", "for programs (a stable schema)"),
        ("qkv check --example i-love-statistics -f markdown -o check.md", "a page to share"),
        ("qkv examples --show i-love-statistics > mine.yaml", "a start for your own"),
        (
            "qkv check --function student.py:attention --kind attention",
            "which slip a student's attention(Q, K, V[, mask]) makes (runs student.py)",
        ),
    ),
    configure=_configure,
    run=_run,
)
