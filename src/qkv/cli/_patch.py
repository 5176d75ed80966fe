"""``qkv patch``: activation patching of the heads of a local Hugging Face model.

Each head's context (or attention pattern, ``--what weights``) is patched, one head at a
time, from the run on ``--clean`` into the run on ``--corrupt``; the table says what the
metric becomes: logit(answer) − logit(wrong) at the last token, or the answer's probability
without ``--wrong``. ``--by position`` patches one head at one token at a time, ``--by
path`` each head along its path into one later head's queries, keys or values
(:mod:`qkv.cli._patch_modes`). ``--html`` writes the heatmap page.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from typing import Any

from qkv._format import visible
from qkv.cli._common import Command, CommandError, Output, refuse_options
from qkv.cli._hf_model import load, show, text_writer, token_id
from qkv.cli._patch_modes import (
    THROUGH,
    effect_lines,
    grid,
    number,
    path_render,
    position_page,
    position_render,
    positions_type,
    receiver,
    receiver_type,
    resolve_positions,
    select,
    short,
    sweeping,
    visible_side,
)

__all__ = ["COMMAND", "table_text"]

PAGE_VALUES = 1_000_000
"""The most numbers the page holds: every step of every head while they fit, else the
weights and contexts only."""


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf",
        required=True,
        metavar="DIR",
        help="a local model folder (save_pretrained) with a language-model head; read offline",
    )
    parser.add_argument(
        "--clean", required=True, metavar="TEXT", help="the prompt whose contexts are patched in"
    )
    parser.add_argument(
        "--corrupt",
        required=True,
        metavar="TEXT",
        help="the prompt that runs, one head patched at a time (as many tokens)",
    )
    parser.add_argument(
        "--answer", required=True, metavar="TOKEN", help="the token the clean prompt should predict"
    )
    parser.add_argument(
        "--wrong",
        metavar="TOKEN",
        help="the token the corrupt prompt "
        "predicts; the metric is then logit(answer) − logit(wrong), else "
        "the answer's probability",
    )
    parser.add_argument(
        "--what",
        choices=("context", "weights"),
        default="context",
        help="patch each head's context (default) or its attention pattern",
    )
    parser.add_argument(
        "--format",
        "-f",
        choices=("text", "json", "csv"),
        default="text",
        help="the table's format on the terminal or in --output",
    )
    parser.add_argument(
        "--batch",
        type=_positive,
        metavar="N",
        help="heads run at once, one per batch row (default: a layer's heads, as memory allows)",
    )
    parser.add_argument("--output", "-o", metavar="FILE", help="write the table to FILE")
    parser.add_argument("--html", metavar="FILE", help="write the heatmap page (a click on "
                        "a cell shows its head's steps on both prompts)")  # fmt: skip
    modes = parser.add_argument_group("by position and by path")
    modes.add_argument(
        "--by",
        choices=("head", "position", "path"),
        default="head",
        help="head: each head in turn (default); position: each head at one token at a "
        "time; path: each head along its path into --receiver's queries, keys or values",
    )
    modes.add_argument(
        "--layer",
        metavar="L",
        help="the layer whose heads the table shows: a position among the attention layers "
        "(-1: the last) or a module path (default: every layer; the senders' with --by path)",
    )
    modes.add_argument(
        "--head",
        type=int,
        metavar="H",
        help="the head the table shows in each chosen layer, from 0 (-1: the last; "
        "default: every head)",
    )
    modes.add_argument(
        "--positions",
        type=positions_type,
        metavar="LIST",
        help="with --by position: the tokens patched, e.g. 0,3,5-9 (-1: the last; "
        "default: every token)",
    )
    modes.add_argument(
        "--receiver",
        type=receiver_type,
        metavar="L.H",
        help="with --by path: the head that reads the senders, e.g. 1.0 (head 0 of layer 1; "
        "negative from the end, or MODULE.H)",
    )
    modes.add_argument(
        "--through",
        choices=tuple(THROUGH),
        default="k",
        help="with --by path: what the receiver reads of them: its queries, keys (default) "
        "or values",
    )


def _positive(text: str) -> int:
    """``--batch``: a positive integer (argparse names the option and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _inputs(loaded: Any, text: str, option: str) -> tuple[Any, list[str]]:
    from qkv.hf._text import tokenize

    try:
        ids, tokens = tokenize(loaded, text)
    except ValueError as error:
        raise CommandError(f"{option} {error}") from None
    return ids, tokens


def _metric_name(args: argparse.Namespace) -> str:
    if args.wrong is None:
        return f"prob({visible(args.answer)})"
    return f"logit_diff({visible(args.answer)} − {visible(args.wrong)})"


def _check_mode(args: argparse.Namespace) -> None:
    """Refuse the options the chosen ``--by`` does not read."""
    by = args.by
    if by == "head":
        chosen = {"--layer": args.layer is not None, "--head": args.head is not None}
        reason = "--by head patches every head at every token. Hint: add --by position or --by path"
        refuse_options(chosen, alongside="--by head", reason=reason)
    if by != "position" and args.positions is not None:
        raise CommandError(
            f"--positions cannot be used with --by {by}: it chooses the tokens of --by "
            "position. Hint: add --by position"
        )
    if by != "path" and args.receiver is not None:
        raise CommandError(
            f"--receiver cannot be used with --by {by}: it names the receiver of --by path. "
            "Hint: add --by path"
        )
    if by == "path" and args.receiver is None:
        raise CommandError(
            "--by path needs --receiver L.H, the head that reads the senders, got none. "
            "Hint: --receiver 1.0 is head 0 of layer 1"
        )
    if by != "head" and args.what != "context":
        raise CommandError(
            f"--what {args.what} cannot be used with --by {by}: position and path patching "
            "patch each head's context. Hint: leave out --what"
        )


def _run(args: argparse.Namespace) -> int:
    _check_mode(args)
    loaded = load(args.hf, "qkv patch")
    import qkv

    if loaded.encoder_only or loaded.model.get_output_embeddings() is None:
        raise CommandError(
            f"--hf {args.hf}: the {loaded.family} model ({type(loaded.model).__name__}) has "
            "no language-model head, so no logits for --answer. Hint: a causal language "
            "model folder (e.g. LlamaForCausalLM, GPT2LMHeadModel)"
        )
    clean, clean_tokens = _inputs(loaded, args.clean, "--clean")
    corrupt, corrupt_tokens = _inputs(loaded, args.corrupt, "--corrupt")
    if clean.shape != corrupt.shape:
        raise CommandError(
            f"--corrupt has {corrupt.shape[1]} tokens and --clean {clean.shape[1]}: patching "
            "copies each position. Hint: change one word for another of one token"
        )
    answer = token_id(loaded, args.answer, "--answer")
    if args.wrong is None:
        metric = qkv.prob(answer)
    else:
        metric = qkv.logit_diff(answer, token_id(loaded, args.wrong, "--wrong"))
    facts = {
        "model": visible(str(loaded.name)),
        "family": loaded.family,
        "metric": _metric_name(args),
        "clean": {"text": args.clean, "tokens": clean_tokens},
        "corrupt": {"text": args.corrupt, "tokens": corrupt_tokens},
    }
    if args.by == "position":
        return _by_position(loaded, args, (clean, corrupt, metric), facts)
    if args.by == "path":
        return _by_path(loaded, args, (clean, corrupt, metric), facts)
    result = sweeping(
        lambda: qkv.patching(
            loaded.model, clean, corrupt, metric, what=args.what, batch=args.batch, progress=True
        ),
        args.batch,
    )
    _values(facts, result)
    outputs = []
    if args.html is not None:
        what = "context" if result.what == "context" else "attention pattern"
        outputs.append(_html(args.html, _grid_page(loaded, result, facts, ("Patching", what))))
    rendered = _render(args.format, result, facts)
    return show(rendered, args.format, args.output, outputs)


def _html(path: str, page: str) -> Output:
    """``--html PATH``: the page, written with the table (all or none)."""
    return Output("--html", path, text_writer(page), "page", (".html",))


def _values(facts: dict[str, Any], result: Any) -> None:
    """Both prompts' metric, into ``facts``."""
    facts["clean"]["value"], facts["corrupt"]["value"] = result.clean, result.corrupt


def _by_position(
    loaded: Any, args: argparse.Namespace, run: tuple[Any, Any, Any], facts: dict[str, Any]
) -> int:
    """``--by position``: :func:`qkv.edits.position_patching`, the heads chosen shown."""
    from qkv.edits import position_patching
    from qkv.edits._model import layers_of

    chosen = select(layers_of(loaded.model, "qkv patch"), args)
    positions = resolve_positions(args.positions, facts["clean"]["tokens"])
    clean, corrupt, metric = run
    result = sweeping(
        lambda: position_patching(
            loaded.model, clean, corrupt, metric, positions=positions, batch=args.batch,
            progress=True,
        ),
        args.batch,
    )  # fmt: skip
    _values(facts, result)
    counts = [len(row[0]) if row else 0 for row in result.values]
    cells = chosen.cells(counts)
    outputs = []
    if args.html is not None:
        table = position_page(result, cells, facts["clean"]["tokens"])
        outputs.append(
            _html(args.html, _page(loaded, facts, list(result.layers), sum(counts), table))
        )
    rendered = position_render(args.format, result, cells, facts)
    return show(rendered, args.format, args.output, outputs)


def _by_path(
    loaded: Any, args: argparse.Namespace, run: tuple[Any, Any, Any], facts: dict[str, Any]
) -> int:
    """``--by path``: :func:`qkv.edits.path_patching` into ``--receiver``, the senders
    chosen shown (the page holds every sender)."""
    from qkv.edits import path_patching
    from qkv.edits._model import layers_of

    layers = layers_of(loaded.model, "qkv patch")
    named = ".".join(str(part) for part in args.receiver)
    layer, head = receiver(layers, args.receiver, named)
    chosen = select(layers, args, before=layer)
    through = THROUGH[args.through]
    clean, corrupt, metric = run
    try:
        result = sweeping(
            lambda: path_patching(
                loaded.model, clean, corrupt, metric, receiver=(layer, head), through=through,
                batch=args.batch, progress=True,
            ),
            args.batch,
        )  # fmt: skip
    except ValueError as error:  # the receiver's projection not found: in the CLI's words
        if not str(error).startswith("path_patching("):
            raise
        raise CommandError(f"--receiver {named}: " + str(error).split(": ", 1)[-1]) from None
    _values(facts, result)
    receiving = {"layer": layer, "module": layers.paths[layer], "head": head, "through": through}
    cells = chosen.cells([len(row) for row in result.values])
    outputs = []
    if args.html is not None:
        what = f"output, along its path into layer {layer} head {head}'s {through},"
        title = f"Path patching (into {layer}.{head}'s {through}) of"
        outputs.append(_html(args.html, _grid_page(loaded, result, facts, (title, what))))
    rendered = path_render(args.format, result, cells, facts, receiving)
    return show(rendered, args.format, args.output, outputs)


def table_text(result: Any, facts: dict[str, Any]) -> str:
    """The text table: what was patched, both prompts' metric, one row per layer (blocks of
    8 heads), and the head with the largest effect; lines of at most 80 columns."""
    what = "context" if result.what == "context" else "attention pattern"
    lines = [
        short(f"qkv patch: each head's {what}, clean into corrupt ({facts['model']}, "
              f"{facts['family']})", 80),
        short(f"metric: {facts['metric']} at the last token", 80),
        short(f"clean   {number(result.clean)}  {facts['clean']['text']}", 80),
        short(f"corrupt {number(result.corrupt)}  {facts['corrupt']['text']}", 80),
    ]  # fmt: skip
    heads = max(len(row) for row in result.values)
    header = [("layer", [f"head {h}" for h in range(heads)])]
    lines += grid(header, [(str(layer), row) for layer, row in enumerate(result.values)])
    nothing = "no head moves the metric from the corrupt run's"
    lines += effect_lines(result, lambda layer, head: f"layer {layer}, head {head}", nothing)
    if lines[-1] != nothing:
        layer = result.best()[0]
        lines.append(short(f"layer {layer} is {result.layers[layer]}", 80))
    return "\n".join(lines) + "\n"


def _render(fmt: str, result: Any, facts: dict[str, Any]) -> str:
    normalized = result.normalized()
    if fmt == "text":
        return table_text(result, facts)
    if fmt == "json":
        data = {
            "by": "head",
            "model": facts["model"],
            "family": facts["family"],
            "metric": facts["metric"],
            "what": result.what,
            **{side: visible_side(facts[side]) for side in ("clean", "corrupt")},
            "layers": list(result.layers),
            "values": result.values,
            "normalized": [[None if math.isnan(v) else v for v in row] for row in normalized],
            "barely_differ": result.barely_differ(),
        }
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["layer", "module", "head", "value", "normalized"])
    for layer, row in enumerate(result.values):
        for head, value in enumerate(row):
            share = normalized[layer][head]
            writer.writerow(
                [layer, visible(result.layers[layer]), head, repr(value),
                 "" if math.isnan(share) else repr(share)]
            )  # fmt: skip
    return out.getvalue()


def _page(
    loaded: Any, facts: dict[str, Any], layers: list[str], heads: int, table: dict[str, Any]
) -> str:
    """The heatmap page: ``table`` (its ``title``, ``what``, ``values``, ``normalized``,
    ``best``; ``rows``, ``columns`` and ``corner`` for a table by position) and the steps
    of every head of ``layers`` (``heads`` in all) on both prompts."""
    from qkv.hf._text import trace_text
    from qkv.render._patch_page import PATCH_STEPS, head_steps, patching_page

    tokens = len(facts["clean"]["tokens"])
    every = 2 * heads * tokens * (tokens * 2 + 4 * 64)
    steps = PATCH_STEPS if every <= PAGE_VALUES else ("weights", "context")
    if 2 * heads * tokens * (tokens + 64) > PAGE_VALUES:
        raise CommandError(
            f"--html: {tokens} tokens in {heads} heads make a page too large to open. Hint: "
            "shorter prompts, or the table alone (leave out --html)"
        )
    traces = {
        side: trace_text(loaded, facts[side]["text"], layers=layers, steps=list(steps))
        for side in ("clean", "corrupt")
    }
    data = {
        **table,
        "title": f"{table['title']} {facts['model']} ({facts['family']})",
        "metric": facts["metric"],
        "clean": facts["clean"],
        "corrupt": facts["corrupt"],
        "layers": layers,
        "normalized": [[None if math.isnan(v) else v for v in row] for row in table["normalized"]],
        "steps": {side: head_steps(trace, layers, steps) for side, trace in traces.items()},
    }
    return patching_page(data)


def _grid_page(loaded: Any, result: Any, facts: dict[str, Any], words: tuple[str, str]) -> str:
    """The page of a layer x head ``result``; ``words``: its title and what a cell patched."""
    table = {
        "title": words[0],
        "what": words[1],
        "values": result.values,
        "normalized": result.normalized(),
        "best": list(result.best()),
    }
    heads = sum(len(row) for row in result.values)
    return _page(loaded, facts, list(result.layers), heads, table)


COMMAND = Command(
    name="patch",
    summary="activation patching of a Hugging Face model's heads",
    description=(
        "Patch each attention head, one at a time, from the run on --clean into the run\n"
        "on --corrupt, and show what the metric becomes: logit(answer) − logit(wrong) at\n"
        "the last token (or the answer's probability without --wrong). --by position\n"
        "patches one head at one token at a time; --by path each head along its path\n"
        "into a later head's queries, keys or values (--receiver, --through). Exact, on\n"
        "the fast path (docs/interventions.md). Needs qkv[hf] (torch and transformers)."
    ),
    examples=(
        (
            "qkv patch --hf DIR --clean 'a cat sat' --corrupt 'a dog sat' --answer on",
            "the layer x head table of the probability of 'on'",
        ),
        (
            "qkv patch --hf DIR --clean ... --corrupt ... --answer on --wrong to",
            "logit(on) − logit(to), head by head",
        ),
        (
            "qkv patch --hf DIR ... --what weights --html patch.html",
            "patch attention patterns only; the heatmap page (click a head)",
        ),
        (
            "qkv patch --hf DIR --clean 'a cat sat' --corrupt 'a dog sat' --answer on \\\n"
            "    --by position --head 0 --positions 1,-1",
            "head 0 of each layer, patched at the animal alone, then at the last token",
        ),
        (
            "qkv patch --hf DIR --clean 'a cat sat' --corrupt 'a dog sat' --answer on \\\n"
            "    --by path --receiver -1.0 --through v",
            "each earlier head patched only along its path into the values of head 0 of\n"
            "      the last layer",
        ),
    ),
    configure=_configure,
    run=_run,
)
