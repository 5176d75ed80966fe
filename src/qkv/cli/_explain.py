"""``qkv explain``: every step of attention on a worked example, with its numbers."""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qkv import _io
from qkv.cli._common import (
    Command,
    CommandError,
    Output,
    add_output_options,
    emit,
    int_in_range,
    refuse_options,
    write_all,
)
from qkv.render import FORMATS, MATRIX_STEPS, TITLES
from qkv.steps import STEP_NAMES
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
    parser.add_argument(
        "--hf",
        metavar="MODEL",
        help="explain a Hugging Face transformers model on --text: a folder written by "
        "save_pretrained, or a model id already in the local cache; never downloaded "
        "without --online (needs qkv[hf]; docs/hf.md)",
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="with --hf: download MODEL from the Hugging Face Hub if it is not cached",
    )
    parser.add_argument("--text", metavar="TEXT", help="with --model or --hf: the text to explain")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="show one decoding step with a KV cache: the cached keys and values, the new "
        "token's query attending all of them (bottom-right alignment), and that it equals "
        "the last row of the full causal pass; --query picks the new token (default: the "
        "last); formats text, markdown, json",
    )
    parser.add_argument(
        "--layer",
        metavar="NAME",
        help="with --model: which attention layer (default: the self-attention; 'pool' for "
        "a classifier's attention pooling); with --hf: a position among the attention "
        "layers (-1: the last) or a module path (default: 0)",
    )
    parser.add_argument(
        "--head",
        type=int,
        metavar="H",
        help="with --hf: which head of --layer, from 0 (-1: the last; default: 0)",
    )
    parser.add_argument(
        "--query",
        "-q",
        metavar="TOKEN",
        help="show only this query: a token of the example, or its 0-based position "
        "(default: the example's queries; with --hf: every token of a text of up to 64 "
        "tokens, else the last)",
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
        "--steps",
        "-s",
        metavar="STEP,...",
        type=_step_list,
        help="show only these steps, e.g. weights,context (a model's trace is long); the "
        f"steps: {', '.join(STEP_NAMES)}",
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="write an interactive page (head view, every step) to FILE: one file, no "
        "network; the terminal then shows nothing",
    )
    parser.add_argument(
        "--practice",
        action="store_true",
        help="with --html: a practice page of the example: the learner types the rows of "
        "each step and hears which slip a wrong row shows (docs/page.md)",
    )
    parser.add_argument(
        "--tiled",
        action="store_true",
        help="compute the example the way FlashAttention does, tile by tile: each tile's "
        "scores, row maximum, running maximum m, rescale factor, running sum l and "
        "accumulator O, then O / l, the log-sum-exp and one key block of the backward "
        "(docs/flash.md); with --html, a page of the tiles",
    )
    parser.add_argument(
        "--block-size",
        type=int_in_range(1, MAX_BLOCK),
        metavar="N",
        help=f"with --tiled: queries and keys per tile, 1 to {MAX_BLOCK} (default: 2)",
    )
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also say (on stderr) which attention backend computed it and why the others "
        "were not used",
    )


MAX_BLOCK = 4096
"""The largest ``--block-size``: beyond it every worked example is one tile."""

_POSITION = re.compile(r"-?[0-9]+")
"""A 0-based position given to --query (ASCII digits only: '²' is a token, not 2)."""


def _step_list(text: str) -> tuple[str, ...]:
    """An argparse ``type``: step names separated by commas (``weights,context``)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in STEP_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected step names separated by commas, got {text!r}"
            + (f" ({unknown[0]!r} is no step)" if unknown else "")
            + f"; the steps are {', '.join(STEP_NAMES)}"
        )
    return names


def _run(args: argparse.Namespace) -> int:
    from qkv import render  # imported here: 'qkv --help' stays fast

    if args.tiled:
        _tiled(args)
        return 0
    if args.block_size is not None:
        raise CommandError(
            f"--block-size {args.block_size}: the size of a tile goes with --tiled. Hint: "
            f"qkv explain --tiled --block-size {args.block_size}"
        )
    if args.practice and not args.decode:
        _practice_allowed(args)
    if args.decode:
        _decode(args)
        return 0
    if args.hf is None and (args.head is not None or args.online):
        given = "--head" if args.head is not None else "--online"
        raise CommandError(
            f"{given} goes with --hf MODEL. Hint: qkv explain --hf MODEL --text TEXT {given}"
            + (f" {args.head}" if args.head is not None else "")
        )
    if args.hf is not None:
        from qkv.cli._explain_hf import hf_trace  # transformers, PyTorch

        trace = hf_trace(args)
    elif args.model is not None or args.text is not None or args.layer is not None:
        from qkv.cli._train import model_trace  # a trained model: qkv.train, PyTorch

        trace = model_trace(args)
    elif args.trace is not None:
        trace = _saved_trace(args)
    else:
        trace = _example_trace(args)
    if args.steps is not None:
        trace = _keep_steps(trace, args.steps)
    practice = _practice(args) if args.practice else None
    if args.plot is not None or args.html is not None:
        _pictures(trace, args, practice)
        return 0
    emit(
        args,
        lambda width: render.render(trace, args.format, precision=args.precision, width=width),
        lambda console: render.print_text(trace, console, precision=args.precision),
    )
    return 0


def _decode(args: argparse.Namespace) -> None:
    """``--decode``: one decoding step with a KV cache on ``--example``, in ``--format``."""
    from qkv import examples
    from qkv.render._decode import DECODE_FORMATS, render_decode

    refuse_options(
        {
            "--trace": args.trace,
            "--model": args.model,
            "--hf": args.hf,
            "--text": args.text,
            "--layer": args.layer,
            "--causal": args.causal,
            "--steps": args.steps,
            "--plot": args.plot,
            "--html": args.html,
            "--practice": args.practice,
            "--verbose": args.verbose,
        },
        alongside="--decode",
        reason="it shows one decoding step of a worked example, causal by construction. "
        "Hint: qkv explain --decode --example NAME --query TOKEN",
    )
    if args.format not in DECODE_FORMATS:
        raise CommandError(
            f"--format {args.format}: --decode is shown as {', '.join(DECODE_FORMATS)}, "
            f"not {args.format}. Hint: --format markdown for a document"
        )
    example = examples.resolve(args.example or examples.builtin_names()[0])
    query = None if args.query is None else _query_of(example, args.query)
    try:
        step = examples.decode_step(
            example, query=query, scale=False if args.no_scale else None, heads=args.heads
        )
    except ValueError as error:
        text = str(error)
        if text.startswith("query:"):
            raise CommandError("--query" + text.removeprefix("query")) from None
        if text.startswith("heads:"):
            raise CommandError("--heads" + text.removeprefix("heads")) from None
        raise
    emit(
        args,
        lambda width: render_decode(step, args.format, precision=args.precision, width=width),
        lambda console: console.out(
            render_decode(step, "text", precision=args.precision, width=console.width),
            end="",
            highlight=False,
        ),
    )


def _tiled(args: argparse.Namespace) -> None:
    """``--tiled``: the example computed tile by tile, in ``--format`` or as ``--html``."""
    from qkv.render._tiled import DEFAULT_BLOCK, render_tiled, tiled_run

    refuse_options(
        {
            "--trace": args.trace,
            "--model": args.model,
            "--hf": args.hf,
            "--text": args.text,
            "--layer": args.layer,
            "--head": args.head is not None,
            "--online": args.online,
            "--decode": args.decode,
            "--query": args.query,
            "--steps": args.steps,
            "--plot": args.plot,
        },
        alongside="--tiled",
        reason="it shows every tile of a worked example, every query row included. Hint: "
        "qkv explain --tiled --example NAME --block-size N",
    )
    if args.practice:
        _practice_allowed(args)
    trace = _example_trace(args)
    block = DEFAULT_BLOCK if args.block_size is None else args.block_size
    try:
        run = tiled_run(trace, block_size=block)
    except ValueError as error:
        raise CommandError(f"--tiled: {error}") from None
    if args.html is not None:
        from qkv.render._tiled_page import tiled_page

        practice = _tiled_practice(args, block) if args.practice else None
        outputs = [
            Output(
                "--html",
                args.html,
                lambda path: _io.write_atomic(
                    path, tiled_page(run, precision=args.precision, practice=practice)
                ),
                "open it in a browser",
            )
        ]
        if args.output is not None:
            text = render_tiled(run, args.format, precision=args.precision, width=args.width or 80)
            outputs.append(
                Output(
                    "--output",
                    args.output,
                    lambda path: _io.write_atomic(path, text),
                    args.format,
                )
            )
        write_all(outputs)
        return
    emit(
        args,
        lambda width: render_tiled(run, args.format, precision=args.precision, width=width),
        lambda console: console.out(
            render_tiled(run, "text", precision=args.precision, width=max(console.width, 40)),
            end="",
            highlight=False,
        ),
    )


def _query_of(example: Any, query: str) -> str:
    """``--query``: a token of the example, or a position (negative counts from the end);
    with Lq ≠ Lk (Q, K and V given), a query token or a position among the queries."""
    named = example.queries_named
    if query not in named and _POSITION.fullmatch(query):
        count = len(named)
        position = int(query)
        if not -count <= position < count:
            tokens = ", ".join(f"{i} {t}" for i, t in enumerate(named[:20]))
            raise CommandError(
                f"--query {query}: expected a token or a position from 0 to {count - 1} (or "
                f"from -{count} to -1, counted from the end), got {position}. Hint: the "
                f"{'query ' if example.query_tokens else ''}tokens are {tokens}"
                + (", ..." if count > 20 else "")
            )
        return str(position % count)
    return query


def _example_trace(args: argparse.Namespace) -> Trace:
    """The trace of ``--example`` (a built-in or a file) with the options given."""
    from qkv import examples

    example = examples.resolve(args.example or examples.builtin_names()[0])
    query = args.query
    if query is not None:
        query = _query_of(example, query)
    try:
        trace = examples.run(
            example,
            query=query,
            scale=False if args.no_scale else None,
            causal=True if args.causal else None,
            heads=args.heads,
        )
    except ValueError as error:
        text = str(error)
        if text.startswith("query:"):
            raise CommandError("--query" + text.removeprefix("query")) from None
        raise
    if args.verbose:
        from qkv.attention import dispatch_of_trace

        print(dispatch_of_trace(trace), file=sys.stderr)
    return trace


def _keep_steps(trace: Trace, steps: Sequence[str]) -> Trace:
    """A copy of ``trace`` with only ``steps`` (``--steps``), or an error naming what is there."""
    kept = [step for step in trace.steps if step.name in steps]
    if not kept:
        recorded = ", ".join(dict.fromkeys(step.name for step in trace.steps))
        raise CommandError(
            f"--steps {','.join(steps)}: none of these steps is in the trace. Hint: it "
            f"holds {recorded}"
        )
    shown = copy.copy(trace)  # the same tokens and meta, fewer steps
    shown.steps = kept
    return shown


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
        trace.meta["queries"] = [_recorded_query(trace, args.query)]
    return trace


def _recorded_query(trace: Trace, text: str) -> int | str:
    """``--query`` for a saved trace: a query label, or a 0-based position among the rows
    recorded; an error naming what the trace holds when no attention call has it."""
    from qkv.render._narrative import query_labels, query_position

    wanted: int | str = int(text) if _POSITION.fullmatch(text) else text
    described: list[str] = []
    for call in _calls(trace):
        lq = _axis_size(call, "query")
        if lq is None:
            continue
        rows = _kept_rows(call, "query")
        labels = query_labels(trace, lq, rows)
        if query_position(wanted, labels, rows) is not None:
            return wanted
        positions = rows if rows is not None and len(rows) == lq else list(range(lq))
        described = [f"{p} {label}" for p, label in zip(positions, labels, strict=True)]
    if not described:
        raise CommandError(
            f"--query {text}: the trace records no query rows (no step with a query axis). "
            "Hint: leave out --query"
        )
    shown = ", ".join(described[:20]) + (", ..." if len(described) > 20 else "")
    raise CommandError(
        f"--query {text}: not a query the trace recorded; expected a token or a 0-based "
        f"position among the recorded rows: {shown}. Hint: record the row you want, e.g. "
        "qkv.tracing(queries=[...])"
    )


def _calls(trace: Trace) -> list[list[Any]]:
    """The trace's attention calls: a new call starts when a step name comes again."""
    calls: list[list[Any]] = []
    for step in trace.steps:
        current = calls[-1] if calls else None
        if (
            current is None
            or step.layer != current[0].layer
            or any(s.name == step.name for s in current)
        ):
            calls.append([step])
        else:
            current.append(step)
    return calls


def _axis_size(call: Sequence[Any], axis: str) -> int | None:
    for step in call:
        if axis in step.axes:
            return int(step.value.shape[step.axes.index(axis)])
    return None


def _kept_rows(call: Sequence[Any], axis: str) -> list[int] | None:
    for step in call:
        if step.index and axis in step.index and axis in step.axes:
            return [int(i) for i in step.index[axis]]
    return None


_HINTS = {
    "masked": "the masked scores exist only with a mask: add --causal (or a mask in the "
    "example), or draw --plot-step scaled",
    "bias": "the bias exists only when the example or model adds one (e.g. ALiBi); draw "
    "--plot-step scaled",
}


def _practice_allowed(args: argparse.Namespace) -> None:
    """``--practice`` needs a worked example and ``--html``."""
    refuse_options(
        {"--trace": args.trace, "--model": args.model, "--hf": args.hf, "--text": args.text},
        alongside="--practice",
        reason="a practice page is made from a worked example. Hint: qkv explain --example "
        "NAME --html practice.html --practice",
    )
    if args.html is None:
        raise CommandError(
            "--practice: it makes a practice page, which needs --html FILE. Hint: qkv explain "
            "--html practice.html --practice"
        )


def _tiled_practice(args: argparse.Namespace, block: int) -> dict[str, Any]:
    """``--tiled --practice``: the tiled practice data of ``--example`` with the options given."""
    import dataclasses

    from qkv import examples
    from qkv.render._practice_tiled import tiled_practice_data

    example = examples.resolve(args.example or examples.builtin_names()[0])
    options: dict[str, Any] = {"scale": False} if args.no_scale else {}
    if args.causal:
        options["causal"] = True
    if args.heads is not None:
        options["heads"] = args.heads
    try:
        return tiled_practice_data(
            dataclasses.replace(example, **options), block_size=block, precision=args.precision
        )
    except ValueError as error:
        raise CommandError(f"--practice: {error}") from None


def _practice(args: argparse.Namespace) -> dict[str, Any]:
    """``--practice``: the practice data of ``--example`` with the options given."""
    import dataclasses

    from qkv import examples
    from qkv.render._practice import practice_data

    example = examples.resolve(args.example or examples.builtin_names()[0])
    options: dict[str, Any] = {"scale": False} if args.no_scale else {}
    if args.causal:
        options["causal"] = True
    if args.heads is not None:
        options["heads"] = args.heads
    try:
        return practice_data(dataclasses.replace(example, **options), precision=args.precision)
    except ValueError as error:
        raise CommandError(f"--practice: {error}") from None


def _pictures(
    trace: Trace, args: argparse.Namespace, practice: dict[str, Any] | None = None
) -> None:
    """Write the --plot, --html and --output files: all or none (:func:`write_all`)."""

    outputs: list[Output] = []
    if args.plot is not None:
        if args.plot_step not in trace:
            recorded = ", ".join(dict.fromkeys(s.name for s in trace.steps))
            hint = _HINTS.get(args.plot_step, "choose one of the recorded steps")
            raise CommandError(
                f"--plot-step {args.plot_step}: the trace has no {args.plot_step} step "
                f"(recorded: {recorded}). Hint: {hint}"
            )
        outputs.append(
            Output(
                "--plot",
                args.plot,
                lambda path: _heatmap(trace, path, args.plot_step),
                f"the {TITLES[args.plot_step].lower()}, one panel per head",
                suffixes=(".png", ".svg"),
            )
        )
    if args.html is not None:
        outputs.append(
            Output(
                "--html",
                args.html,
                lambda path: _html_page(trace, path, args.precision, practice),
                "open it in a browser",
            )
        )
    if args.output is not None:
        outputs.append(
            Output(
                "--output",
                args.output,
                lambda path: _text_file(trace, path, args),
                args.format,
            )
        )
    write_all(outputs)


def _text_file(trace: Trace, path: Path, args: argparse.Namespace) -> None:
    from qkv import render

    width = args.width or 80
    text = render.render(trace, args.format, precision=args.precision, width=width)
    _io.write_atomic(path, text)


def _heatmap(trace: Trace, path: Path, step: str) -> None:
    from qkv import render

    render.heatmap(trace, path, step=step)


def _html_page(
    trace: Trace, path: Path, precision: int, practice: dict[str, Any] | None = None
) -> None:
    from qkv import render

    render.html(trace, path, precision=precision, practice=practice)


COMMAND = Command(
    name="explain",
    summary="show every step of attention on a worked example, with numbers",
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
        ("qkv explain --html practice.html --practice", "a page to practise every step on"),
        ("qkv explain --model runs/classify --text 'not bad at all'", "a trained model"),
        ("qkv explain --hf ./my-model --text 'The cat sat' --layer -1 --head 3", "a HF model"),
        ("qkv explain --hf ./my-model --text 'The cat sat' --html model.html", "every head"),
        ("qkv explain --example two-heads --steps weights,context", "only these steps"),
        ("qkv explain --decode", "one decoding step with a KV cache = the full pass's last row"),
        ("qkv explain --tiled --causal", "the FlashAttention algorithm, tile by tile"),
    ),
    configure=_configure,
    run=_run,
)
