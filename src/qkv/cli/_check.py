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

from qkv._format import visible
from qkv.cli._common import Command, CommandError, add_output_options, emit

_FORMATS = ("text", "markdown", "json")  # qkv.check.FORMATS, without importing it for --help
_KINDS = ("attention", "causal", "multi-head", "gqa", "flash")  # qkv.check._probes.KINDS, flash
_CONTRACTS = ("full", "cs336")  # qkv.check._flash.CONTRACTS
_MASK_MEANINGS = ("allow", "ignore", "additive")
_ARRAYS = ("auto", "numpy", "torch")
_ALIGNMENTS = ("top-left", "bottom-right")
_ISOLATIONS = ("auto", "bubblewrap", "namespaces")  # qkv.check.ISOLATIONS


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
        "--module",
        metavar="FILE.py:CLASS",
        help="check the attention class CLASS (a torch nn.Module) of FILE.py: built with "
        "d_model 16, its projections set from the probes (docs/check-function.md). --kind "
        "causal or multi-head says whether it must be causal (default: as the class says)",
    )
    group.add_argument(
        "--kind",
        choices=_KINDS,
        default=None,
        help="attention: NAME(Q, K, V) or NAME(Q, K, V, mask); causal: NAME(Q, K, V) is causal; "
        "multi-head: NAME(X, W_q, W_k, W_v, W_o, num_heads), row vectors; gqa: "
        "NAME(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads), grouped-query; flash: a "
        "FlashAttention NAME(Q, K, V, is_causal) returning (O, L) or O, or a "
        "torch.autograd.Function (NAME.apply(Q, K, V, is_causal), L saved; its backward "
        "checked too) (default: attention)",
    )
    group.add_argument(
        "--contract",
        choices=_CONTRACTS,
        default="full",
        help="with --kind flash: what the assignment promises; cs336 = CS336's part (a): "
        "is_causal may be ignored, (batch, n, d) with power-of-2 lengths >= 16; nothing "
        "outside it is marked wrong (default: full, every probe)",
    )
    group.add_argument(
        "--num-kv-heads",
        type=int,
        metavar="N",
        help="with --kind multi-head: grouped-query attention with the multi-head signature; "
        "W_k and W_v hold N key/value heads (1, 2, 4 or 8)",
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
        help="stop after SECONDS of the file's own code: loading it and the calls "
        "on the probes (default: 20)",
    )
    group.add_argument(
        "--isolation",
        choices=_ISOLATIONS,
        default="auto",
        help="how the file's code is kept from this machine: bubblewrap, or namespaces (a "
        "private root of its own; both: read-only system, no network, no qkv); auto takes "
        "the strongest available (default: auto; docs/isolation.md)",
    )
    add_output_options(parser, "write the report to FILE instead of the terminal (atomically)")


def _function_options(args: argparse.Namespace) -> list[str]:
    """The options of ``--function``'s probes that were given: a class (``--module``) and
    ``--kind flash`` are probed their own way and refuse them."""
    return [
        option
        for option, given in (
            ("--num-kv-heads", args.num_kv_heads is not None),
            ("--mask-means", args.mask_means != "allow"),
            ("--array", args.array != "auto"),
            ("--causal-alignment", args.causal_alignment != "top-left"),
            ("--batched", args.batched),
        )
        if given
    ]


def _run_module(args: argparse.Namespace) -> int:
    if args.kind not in (None, "causal", "multi-head", "attention"):
        raise CommandError(
            f"--kind {args.kind} does not go with --module: a class is checked as multi-head "
            "attention, or as one head without an output projection. Hint: --kind causal (it "
            "must be causal), --kind multi-head (it must not be), --kind attention (one "
            "head), or leave --kind out (as the class says)"
        )
    unused = _function_options(args)
    if unused:
        raise CommandError(
            f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not go with "
            "--module: a class is built with its own key/value heads and driven in float64 "
            "torch tensors, self-attention, one batch. "
            "Hint: leave it out, or check a function with --function"
        )
    from qkv.check import check_module_file

    path, colon, name = args.module.rpartition(":")
    if not colon or not path or not name.isidentifier():
        raise CommandError(
            f"--module must be FILE.py:CLASS, got {visible(args.module)!r}. Hint: "
            f"'qkv check --module {visible(args.module if not colon else path)}:"
            "MultiHeadAttention', with the name of the class"
        )
    causal = None if args.kind in (None, "attention") else args.kind == "causal"
    report = check_module_file(
        args.module,
        causal=causal,
        timeout=args.timeout,
        isolation=args.isolation,
        kind="attention" if args.kind == "attention" else None,
    )
    emit(args, lambda width: report.render(args.format, width=width), report.print)
    return 0 if report.ok else 1


def _run_flash(args: argparse.Namespace) -> int:
    unused = _function_options(args)
    if unused:
        raise CommandError(
            f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not go with --kind "
            "flash: a FlashAttention is probed with float32 torch tensors of shape (batch, n, "
            "d) and (batch, heads, n, d), causal top-left. Hint: leave it out"
        )
    from qkv.check import check_flash_file

    report = check_flash_file(
        args.function if args.function is not None else args.module,
        contract=args.contract,
        timeout=args.timeout,
        isolation=args.isolation,
    )
    emit(args, lambda width: report.render(args.format, width=width), report.print)
    return 0 if report.ok else 1


def _run_function(args: argparse.Namespace) -> int:
    given = [x for x in (args.file, args.example, args.function, args.module) if x is not None]
    if len(given) > 1:
        raise CommandError(
            "give one of --function FILE.py:NAME, --module FILE.py:CLASS or an example, not "
            "both. Hint: 'qkv check --function student.py:attention --kind attention'"
        )
    if args.kind == "flash":
        return _run_flash(args)
    if args.contract != "full":
        raise CommandError(
            "--contract goes with --kind flash. Hint: 'qkv check --function "
            "flash.py:FlashAttention --kind flash --contract cs336'"
        )
    if args.module is not None:
        return _run_module(args)
    from qkv.check import check_function_file

    report = check_function_file(
        args.function,
        args.kind or "attention",
        mask_means=args.mask_means,
        array=args.array,
        alignment=args.causal_alignment,
        timeout=args.timeout,
        batched=args.batched,
        num_kv_heads=args.num_kv_heads,
        isolation=args.isolation,
    )
    emit(args, lambda width: report.render(args.format, width=width), report.print)
    return 0 if report.ok else 1


def _run(args: argparse.Namespace) -> int:
    if args.function is not None or args.module is not None:
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
    code = args.file if args.file is not None else args.example
    if code.lower().endswith((".py", ".ipynb")):
        shown = visible(code)
        raise CommandError(
            f"{shown} is code, not a worked example (YAML or JSON). Hint: to check code, "
            f"use --function {shown}:NAME (or --module {shown}:CLASS for a class)"
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
        "its slip (docs/check-function.md); --module FILE.py:CLASS an attention class.\n"
        "WARNING: this imports FILE.py, which runs its code; it runs sandboxed\n"
        "(--isolation: bubblewrap where installed), in a fresh temporary folder, with a\n"
        "time limit (--timeout) and resource limits."
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
        (
            "qkv check --function flash.py:FlashAttention --kind flash",
            "the slip in a FlashAttention forward and backward (runs flash.py)",
        ),
        (
            "qkv check --module student.py:MultiHeadAttention",
            "the same for an attention class, an nn.Module (runs student.py)",
        ),
    ),
    configure=_configure,
    run=_run,
)
