"""One decoding step with a KV cache (``qkv explain --decode``): text, Markdown and JSON.

Each format shows, head by head, the cache (the K and V rows of the tokens already seen and
the new token's row), the new query attending every cached key with bottom-right alignment,
its weights and context vector, and the same row of the full causal pass with the largest
difference between the two.
"""

from __future__ import annotations

import json as _json
from collections.abc import Sequence

import numpy as np

from qkv._format import json_safe, markdown_escape, number, visible, wrap_equation
from qkv.examples import DecodeStep

__all__ = ["DECODE_FORMATS", "decode_json", "decode_markdown", "decode_text", "render_decode"]

DECODE_FORMATS = ("text", "markdown", "json")
"""The formats of ``qkv explain --decode``."""


def render_decode(step: DecodeStep, format: str, *, precision: int = 4, width: int = 80) -> str:
    """The step in one of :data:`DECODE_FORMATS`.

    Raises:
        ValueError: another format, naming the ones there are.
    """
    if format == "text":
        return decode_text(step, precision=precision, width=width)
    if format == "markdown":
        return decode_markdown(step, precision=precision)
    if format == "json":
        return decode_json(step)
    raise ValueError(f"format {format!r}: a decoding step is shown as {', '.join(DECODE_FORMATS)}.")


def _vector(values: Sequence[float] | np.ndarray, precision: int) -> str:
    return "[" + ", ".join(number(float(x), precision) for x in values) + "]"


def _terms(weights: np.ndarray, tokens: Sequence[str], precision: int) -> str:
    """``0.3029·v_I + 0.3397·v_love + …``: the context vector as a weighted sum."""
    pairs = zip(weights, tokens, strict=True)
    return " + ".join(f"{number(float(w), precision)}·v_{t}" for w, t in pairs)


def _difference(value: float) -> str:
    return f"{value:.1e}"


def _alignment(tokens: Sequence[str]) -> str:
    """Bottom-right alignment, in the seeds' words."""
    count = len(tokens)
    if count == 1:
        return (
            "The cache was empty: the first token attends only to itself, as in the full "
            "causal pass."
        )
    return (
        "Bottom-right alignment: the new query is the last position of the causal mask, so "
        '"each token attends only to itself and the tokens before it" lets it see all '
        f"{count} cached keys. Top-left alignment would take the one query for position 0: "
        f'it would see only "{tokens[0]}", a wrong answer.'
    )


def _sentences(text: str, width: int, indent: str = "") -> list[str]:
    """Wrap plain words to ``width`` columns."""
    lines: list[str] = []
    current = indent
    for word in text.split(" "):
        if current.strip() and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = indent + word
        else:
            current = current + (" " if current.strip() else "") + word
    lines.append(current)
    return lines


def _intro(step: DecodeStep, tokens: Sequence[str]) -> str:
    new = tokens[-1]
    seen = ", ".join(f'"{t}"' for t in tokens[:-1])
    heads = "one head" if step.heads == 1 else f"{step.heads} heads"
    cache = (
        f"is decoded with the keys and values of {seen} already in the cache"
        if seen
        else "is the first: the cache is empty"
    )
    return (
        f'The new token "{new}" (position {step.position}) {cache}: {heads}, '
        f"d_k = {step.d_k}, scores times {number(step.scale, 4)}."
    )


def _keys(count: int) -> str:
    return "the 1 cached key" if count == 1 else f"all {count} cached keys"


def _tokens(count: int) -> str:
    return "1 token" if count == 1 else f"{count} tokens"


def decode_text(step: DecodeStep, *, precision: int = 4, width: int = 80) -> str:
    """The step as plain text that fits ``width`` columns (at the default precision).

    Example:
        >>> from qkv.examples import builtin, decode_step
        >>> text = decode_text(decode_step(builtin("i-love-statistics")))
        >>> text.splitlines()[0]
        'One decoding step with a KV cache: I love statistics'
    """
    tokens = [visible(t) for t in step.tokens]
    new = tokens[-1]
    out = [f"One decoding step with a KV cache: {visible(step.name)}", ""]
    out += _sentences(_intro(step, tokens), width)
    label = max(len("position"), *(len(f"{i} (new)") for i in range(len(tokens))))
    name = max(len("token"), *(len(t) for t in tokens))
    for h in range(step.heads):
        head = "" if step.heads == 1 else f" (head {h} of {step.heads} heads)"
        out += ["", f"The cache: the K and V rows so far, then the new token's{head}"]
        keys = [_vector(row, precision) for row in step.keys[h]]
        kw = max(len("k_j"), *(len(k) for k in keys))
        out.append(f"  {'position':<{label}}  {'token':<{name}}  {'k_j':<{kw}}  v_j")
        for j, token in enumerate(tokens):
            where = f"{j} (new)" if j == step.position else str(j)
            value = _vector(step.values[h, j], precision)
            out.append(f"  {where:<{label}}  {token:<{name}}  {keys[j]:<{kw}}  {value}".rstrip())
        out += ["", f"The new query attends {_keys(len(tokens))}{head}"]
        query = f"  q_{new} = x_{new}·W_q = {_vector(step.query[h], precision)}"
        out += wrap_equation(query, width, indent=6)
        out += _sentences(_alignment(tokens), width, indent="  ")
        out.append("")
        out.append(f"  {'key':<{name}}  {'q·k_j':>10}  {'scaled':>10}  {'weight':>10}")
        for j, token in enumerate(tokens):
            score = float(step.scores[h, j])
            cells = [number(x, precision) for x in (score, score * step.scale)]
            cells.append(number(float(step.weights[h, j]), precision))
            out.append(f"  {token:<{name}}  " + "  ".join(f"{c:>10}" for c in cells))
        terms = _terms(step.weights[h], tokens, precision)
        context = f"  c_{new} = {terms} = {_vector(step.context[h], precision)}"
        out += wrap_equation(context, width, indent=6)
        out += ["", f"The full causal pass over the {_tokens(len(tokens))}, its last row{head}"]
        rows = (
            ("weights, decoding step", step.weights[h]),
            ("weights, full pass", step.full_weights[h]),
            ("context, decoding step", step.context[h]),
            ("context, full pass", step.full_context[h]),
        )
        for what, values in rows:
            out += wrap_equation(f"  {what:<22} = {_vector(values, precision)}", width, indent=6)
    out += [
        "",
        f"max |decoding step − full pass|: weights {_difference(step.weights_difference)}, "
        f"context {_difference(step.context_difference)}",
    ]
    out += _sentences(
        "The step computes one row instead of all of them: the same numbers, up to float64 "
        "rounding.",
        width,
    )
    return "\n".join(out) + "\n"


def decode_markdown(step: DecodeStep, *, precision: int = 4) -> str:
    """The step as GitHub-flavoured Markdown: a heading, the cache and weights as tables.

    Example:
        >>> from qkv.examples import builtin, decode_step
        >>> md = decode_markdown(decode_step(builtin("i-love-statistics")))
        >>> md.splitlines()[0]
        '## One decoding step with a KV cache: I love statistics'
    """
    tokens = [markdown_escape(t) for t in step.tokens]
    new = tokens[-1]
    out = [f"## One decoding step with a KV cache: {markdown_escape(step.name)}", ""]
    out += [*_sentences(_intro(step, tokens), 80), ""]
    for h in range(step.heads):
        head = "" if step.heads == 1 else f" (head {h} of {step.heads} heads)"
        out += [f"### The cache{head}", "", "| position | token | k_j | v_j |", "|---|---|---|---|"]
        for j, token in enumerate(tokens):
            where = f"{j} (new)" if j == step.position else str(j)
            keys, values = (_vector(a[h, j], precision) for a in (step.keys, step.values))
            out.append(f"| {where} | {token} | {keys} | {values} |")
        query = _vector(step.query[h], precision)
        out += ["", f"### The new query attends {_keys(len(tokens))}{head}", ""]
        out += [f"q_{new} = x_{new}·W_q = {query}", "", *_sentences(_alignment(tokens), 80), ""]
        out += ["| key | q·k_j | scaled | weight |", "|---|---:|---:|---:|"]
        for j, token in enumerate(tokens):
            score = float(step.scores[h, j])
            cells = [number(x, precision) for x in (score, score * step.scale)]
            cells.append(number(float(step.weights[h, j]), precision))
            out.append(f"| {token} | " + " | ".join(cells) + " |")
        terms = _terms(step.weights[h], tokens, precision)
        context = f"c_{new} = {terms} = {_vector(step.context[h], precision)}"
        out += ["", *_sentences(context, 80), ""]
        out += [f"### The full causal pass, its last row{head}", ""]
        out += ["| row | values |", "|---|---|"]
        for what, values in (
            ("weights, decoding step", step.weights[h]),
            ("weights, full pass", step.full_weights[h]),
            ("context, decoding step", step.context[h]),
            ("context, full pass", step.full_context[h]),
        ):
            out.append(f"| {what} | {_vector(values, precision)} |")
        out.append("")
    out.append(
        f"max \\|decoding step − full pass\\|: weights {_difference(step.weights_difference)}, "
        f"context {_difference(step.context_difference)}."
    )
    return "\n".join(out) + "\n"


def decode_json(step: DecodeStep) -> str:
    """The step as JSON: the tokens and, per head, every array (full float64 precision).

    Example:
        >>> import json
        >>> from qkv.examples import builtin, decode_step
        >>> data = json.loads(decode_json(decode_step(builtin("i-love-statistics"))))
        >>> data["position"], data["alignment"], len(data["heads"][0]["weights"])
        (2, 'bottom-right', 3)
    """
    data = {
        "kind": "decode-step",
        "name": step.name,
        "tokens": list(step.tokens),
        "position": step.position,
        "alignment": "bottom-right",
        "num_heads": step.heads,
        "d_k": step.d_k,
        "scale": step.scale,
        "heads": [
            {
                "query": step.query[h].tolist(),
                "keys": step.keys[h].tolist(),
                "values": step.values[h].tolist(),
                "scores": step.scores[h].tolist(),
                "weights": step.weights[h].tolist(),
                "context": step.context[h].tolist(),
                "full_pass_weights": step.full_weights[h].tolist(),
                "full_pass_context": step.full_context[h].tolist(),
            }
            for h in range(step.heads)
        ],
        "max_difference": {
            "weights": step.weights_difference,
            "context": step.context_difference,
        },
    }
    return json_safe(_json.dumps(data, indent=2, ensure_ascii=False)) + "\n"
