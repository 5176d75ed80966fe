"""``qkv patch``: activation patching of every head of a local Hugging Face model.

Each head's context (or attention pattern, ``--what weights``) is patched, one head at a
time, from the run on ``--clean`` into the run on ``--corrupt``; the table says what the
metric becomes: logit(answer) − logit(wrong) at the last token, or the answer's probability
without ``--wrong``. ``--html`` writes the heatmap page.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from typing import Any

from qkv._format import visible
from qkv.cli._common import Command, CommandError, Output
from qkv.cli._hf_model import load, show, text_writer, token_id

__all__ = ["COMMAND", "table_text"]

PAGE_VALUES = 1_000_000
"""The most numbers the page holds: every step of every head while they fit, else the
weights and contexts only."""

NO_EFFECT = 1e-6
"""A head whose patch moves the metric by no more than this has no effect."""

_BLOCK = 8  # heads per block of the text table: 6 + 9 · 8 columns fit in 80


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
                        "a head shows its steps on both prompts)")  # fmt: skip


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


def _run(args: argparse.Namespace) -> int:
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
    try:
        result = qkv.patching(
            loaded.model, clean, corrupt, metric, what=args.what, batch=args.batch, progress=True
        )
    except ValueError as error:  # a batch that does not fit: said in the CLI's words
        text = str(error).split(": ", 1)[-1]
        if "this process may still take" not in text:
            raise
        text = text.replace("Hint: batch=", "Hint: --batch ").rstrip(".")
        raise CommandError(f"--batch {args.batch or '(default)'}: {text}") from None
    facts = {
        "model": visible(str(loaded.name)),
        "family": loaded.family,
        "metric": _metric_name(args),
        "clean": {"text": args.clean, "tokens": clean_tokens, "value": result.clean},
        "corrupt": {"text": args.corrupt, "tokens": corrupt_tokens, "value": result.corrupt},
    }
    outputs = []
    if args.html is not None:
        page = _page(loaded, result, facts)
        outputs.append(Output("--html", args.html, text_writer(page), "page", (".html",)))
    rendered = _render(args.format, result, facts)
    return show(rendered, args.format, args.output, outputs)


def _number(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:+.4f}"


def _short(text: str, width: int) -> str:
    text = visible(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def table_text(result: Any, facts: dict[str, Any]) -> str:
    """The text table: what was patched, both prompts' metric, one row per layer (blocks of
    8 heads), and the head with the largest effect; lines of at most 80 columns."""
    what = "context" if result.what == "context" else "attention pattern"
    lines = [
        _short(f"qkv patch: each head's {what}, clean into corrupt ({facts['model']}, "
               f"{facts['family']})", 80),
        _short(f"metric: {facts['metric']} at the last token", 80),
        _short(f"clean   {_number(result.clean)}  {facts['clean']['text']}", 80),
        _short(f"corrupt {_number(result.corrupt)}  {facts['corrupt']['text']}", 80),
    ]  # fmt: skip
    heads = max(len(row) for row in result.values)
    for first in range(0, heads, _BLOCK):
        shown = range(first, min(first + _BLOCK, heads))
        lines += ["", "layer " + "".join(f"{'head ' + str(h):>9}" for h in shown)]
        for layer, row in enumerate(result.values):
            cells = "".join(f"{_number(row[h]):>9}" if h < len(row) else " " * 9 for h in shown)
            lines.append(f"{layer:>5} {cells}")
    layer, head = result.best()
    value = result.values[layer][head]
    if not abs(value - result.corrupt) > NO_EFFECT:
        return "\n".join([*lines, "", "no head moves the metric from the corrupt run's"]) + "\n"
    lines += ["", f"largest effect: layer {layer}, head {head}: {_number(value)}"]
    if result.barely_differ():
        from qkv.edits._patching import BARELY

        apart = abs(result.clean - result.corrupt)
        lines += [
            f"clean and corrupt barely differ ({apart:.2g} apart, within {BARELY:.0%} of the "
            "metric's",
            f"scale, {result.scale():.3g}): no share of the way between them is shown",
        ]
    else:
        share = result.normalized()[layer][head]
        lines[-1] += f", {share:.0%} of the way from corrupt to clean"
    lines.append(_short(f"layer {layer} is {result.layers[layer]}", 80))
    return "\n".join(lines) + "\n"


def _visible_side(side: dict[str, Any]) -> dict[str, Any]:
    """A prompt's text and tokens with control characters written out (for JSON)."""
    return {**side, "text": visible(side["text"]), "tokens": [visible(t) for t in side["tokens"]]}


def _render(fmt: str, result: Any, facts: dict[str, Any]) -> str:
    normalized = result.normalized()
    if fmt == "text":
        return table_text(result, facts)
    if fmt == "json":
        data = {
            "model": facts["model"],
            "family": facts["family"],
            "metric": facts["metric"],
            "what": result.what,
            **{side: _visible_side(facts[side]) for side in ("clean", "corrupt")},
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


def _page(loaded: Any, result: Any, facts: dict[str, Any]) -> str:
    from qkv.hf._text import trace_text
    from qkv.render._patch_page import PATCH_STEPS, head_steps, patching_page

    layers = list(result.layers)
    tokens = len(facts["clean"]["tokens"])
    heads = sum(len(row) for row in result.values)
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
    normalized = result.normalized()
    data = {
        "title": f"Patching {facts['model']} ({facts['family']})",
        "metric": facts["metric"],
        "what": "context" if result.what == "context" else "attention pattern",
        "clean": facts["clean"],
        "corrupt": facts["corrupt"],
        "layers": layers,
        "values": result.values,
        "normalized": [[None if math.isnan(v) else v for v in row] for row in normalized],
        "best": list(result.best()),
        "steps": {side: head_steps(trace, layers, steps) for side, trace in traces.items()},
    }
    return patching_page(data)


COMMAND = Command(
    name="patch",
    summary="activation patching of a Hugging Face model's heads",
    description=(
        "Patch each attention head, one at a time, from the run on --clean into the run\n"
        "on --corrupt, and show what the metric becomes: logit(answer) − logit(wrong) at\n"
        "the last token (or the answer's probability without --wrong). Exact, on the\n"
        "fast path (docs/interventions.md). Needs qkv[hf] (torch and transformers)."
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
    ),
    configure=_configure,
    run=_run,
)
