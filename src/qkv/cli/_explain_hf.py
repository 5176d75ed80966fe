"""``qkv explain --hf MODEL --text TEXT``: a Hugging Face model's attention on a text.

The text formats and ``--plot`` trace one layer, one head and the query rows asked for.
``--html`` traces every layer and head for those rows, so that the page's model view can
show them all; its size stays bounded (:data:`PAGE_VALUES`): every step of every layer
when they fit, else every step of the chosen layer and the weights of the others, else the
weights alone.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from qkv.cli._common import CommandError, refuse_options
from qkv.trace import Trace

__all__ = ["ALL_ROWS", "PAGE_VALUES", "hf_trace"]

ALL_ROWS = 64
"""Without --query, a text of up to this many tokens shows every query row; a longer one
shows its last token's row."""

PAGE_VALUES = 1_000_000
"""The most numbers ``--html`` puts on the page (about 5.4 MB) before it keeps only the
weights of the layers other than the chosen one."""

_POSITION = re.compile(r"-?[0-9]+")
_MARKS = ("Ġ", "▁", "##", "Ċ")  # how tokenizers mark a word's start or its continuation


def hf_trace(args: argparse.Namespace) -> Trace:
    """The trace of ``qkv explain --hf MODEL --text TEXT`` (``--layer``, ``--head``,
    ``--query``, ``--steps``), labelled with the tokenizer's tokens."""
    if args.text is None:
        raise CommandError(
            f"--hf {args.hf} needs --text TEXT, the text the model reads. Hint: "
            f"qkv explain --hf {args.hf} --text 'The cat sat on the mat'"
        )
    refuse_options(
        {
            "--example": args.example,
            "--trace": args.trace,
            "--model": args.model,
            "--no-scale": args.no_scale,
            "--causal": args.causal,
            "--heads": args.heads,
            "--verbose": args.verbose,
            "--practice": getattr(args, "practice", False),
        },
        alongside="--hf",
        reason="the model's attention is shown as the model computes it. Hint: leave it out",
    )
    from qkv._extras import MissingExtraError

    try:
        from qkv.hf._load import load_model
        from qkv.hf._text import text_layers, tokenize
    except MissingExtraError as error:
        raise CommandError(str(error).replace("qkv.hf needs", "--hf needs", 1)) from None
    try:
        loaded = load_model(args.hf, online=args.online)
    except ValueError as error:
        raise CommandError(f"--hf {error}") from None
    try:
        _, tokens = tokenize(loaded, args.text)
    except ValueError as error:
        raise CommandError(f"--{error}") from None
    layers = text_layers(loaded)
    if not layers:
        raise CommandError(
            f"--hf {args.hf}: the {loaded.family} model has no attention module that reads "
            "the text. Hint: see docs/hf.md for the families qkv supports"
        )
    layer = _layer(layers, args.layer)
    head = 0 if args.head is None else args.head
    if args.query is not None:
        rows: list[int] | None = [_query(tokens, args.query)]
    else:
        rows = None if len(tokens) <= ALL_ROWS else [len(tokens) - 1]
    steps = list(args.steps) if args.steps is not None else None
    try:
        if args.html is None:
            trace = _one_head(loaded, args.text, layer, head, rows, steps)
        else:
            trace = _every_head(loaded, args.text, layers, layer, head, rows, steps)
    except ValueError as error:
        raise CommandError(_option_error(str(error), args)) from None
    return trace


def _one_head(
    loaded: Any,
    text: str,
    layer: str,
    head: int,
    rows: list[int] | None,
    steps: list[str] | None,
) -> Trace:
    from qkv.hf._text import trace_text

    return trace_text(loaded, text, layers=[layer], heads=[head], queries=rows, steps=steps)


def _every_head(
    loaded: Any,
    text: str,
    layers: Sequence[str],
    layer: str,
    head: int,
    rows: list[int] | None,
    steps: list[str] | None,
) -> Trace:
    """Every layer and head for ``rows``, in a page of at most PAGE_VALUES numbers."""
    from qkv.hf._text import trace_text

    def run(**what: Any) -> Trace:
        return trace_text(loaded, text, layers=list(layers), queries=rows, **what)

    note = ""
    if steps is not None:
        trace = run(steps=steps)
    else:
        # Every step of the chosen layer and the weights of the others, first: the layers'
        # heads and head sizes (meta["layers"]) then tell whether more fits on the page.
        trace = run(steps_of_layer=lambda name: None if name == layer else ("weights",))
        facts = trace.meta.get("layers", {})
        n = len(trace.tokens or ())
        r = n if rows is None else len(rows)

        def every_step(info: dict[str, Any]) -> int:
            h, d = int(info.get("num_heads", 1)), int(info.get("head_dim", 1))
            return h * (2 * r * d + 2 * n * d + 5 * r * n)

        def weights_only(info: dict[str, Any]) -> int:
            return int(info.get("num_heads", 1)) * r * n

        whole = sum(every_step(info) for info in facts.values())
        chosen = every_step(facts.get(layer, {})) + sum(
            weights_only(info) for name, info in facts.items() if name != layer
        )
        if whole <= PAGE_VALUES:
            trace = run()
        elif chosen <= PAGE_VALUES:
            note = (
                f" The page holds every step of {layer} and the attention weights of the "
                "other layers (every step of every layer would not fit): choose another "
                "layer with --layer, or fewer rows with --query."
            )
        else:
            trace = run(steps=["weights"])
            note = (
                " The page holds the attention weights only (every step would not fit): see "
                "the steps of one head with --format text, or fewer rows with --query."
            )
    heads = int(trace.meta.get("layers", {}).get(layer, {}).get("num_heads", 0))
    if not -heads <= head < heads:
        raise ValueError(
            f"tracing heads=[{head}]: index {head} does not exist in layer {layer!r}, which "
            f"has {heads} heads. Hint: choose indices from 0 to {heads - 1} (or negative ones "
            "from the end)."
        )
    trace.meta["selected"] = {"layer": layer, "head": head % heads}
    if rows is None and trace.tokens:  # the page opens on the last token, a model's next step
        trace.meta["queries"] = [len(trace.tokens) - 1]
    trace.meta["description"] = str(trace.meta.get("description", "")) + note
    return trace


def _layer(layers: Sequence[str], given: str | None) -> str:
    """``--layer``: a position among the attention layers (negative from the end), or a
    module path (a layer, or a block holding exactly one attention module)."""
    if given is None:
        return layers[0]
    if _POSITION.fullmatch(given):
        position = int(given)
        if -len(layers) <= position < len(layers):
            return layers[position]
    else:
        inside = [name for name in layers if name == given or name.startswith(given + ".")]
        if len(inside) == 1:
            return inside[0]
    shown = ", ".join(layers[:3]) + (f", ..., {layers[-1]}" if len(layers) > 3 else "")
    raise CommandError(
        f"--layer {given}: expected a position from 0 to {len(layers) - 1} (or from "
        f"-{len(layers)} to -1) or the module path of one attention layer, got {given!r}. "
        f"Hint: the {len(layers)} attention layers are {shown}"
    )


def _query(tokens: Sequence[str], given: str) -> int:
    """``--query``: a token of the text (the first one, if it repeats) or its position."""
    if given in tokens:
        return list(tokens).index(given)
    bare = [_bare(token) for token in tokens]
    if given not in tokens and _POSITION.fullmatch(given):
        position = int(given)
        if -len(tokens) <= position < len(tokens):
            return position % len(tokens)
        raise CommandError(
            f"--query {given}: expected a position from 0 to {len(tokens) - 1} (or from "
            f"-{len(tokens)} to -1), got {position}. Hint: the tokens are "
            f"{_listed(tokens)}"
        )
    if _bare(given) in bare:
        return bare.index(_bare(given))
    raise CommandError(
        f"--query {given!r} is not a token of --text. Hint: give a token or its 0-based "
        f"position; the tokens are {_listed(tokens)}"
    )


def _bare(token: str) -> str:
    """A token without the marks tokenizers put on it (``Ġcat`` and ``▁cat`` are ``cat``)."""
    for mark in _MARKS:
        token = token.replace(mark, "")
    return token.strip()


def _listed(tokens: Sequence[str]) -> str:
    shown = ", ".join(f"{i} {t}" for i, t in enumerate(tokens[:20]))
    return shown + (", ..." if len(tokens) > 20 else "")


def _option_error(text: str, args: argparse.Namespace) -> str:
    """A tracing error in the words of the command line (``--head``, ``--query``)."""
    if text.startswith("tracing heads="):
        return f"--head {args.head}: " + text.split(": ", 1)[-1]
    if text.startswith("tracing queries="):
        return f"--query {args.query}: " + text.split(": ", 1)[-1]
    return text
