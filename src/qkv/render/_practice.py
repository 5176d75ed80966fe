"""Practice mode of the HTML page: the rows each slip produces, worked out before the page opens.

The learner sees a worked example's inputs (embeddings and W_q, W_k, W_v, W_o) and types the
rows of each step: Q, K, V, scores, scaled, weights, context (with several heads: the scores,
scaled scores and weights of each head, then the heads side by side) and output. The page
judges each typed row as ``qkv check`` would, but it runs no attention itself: everything it
compares with is computed in Python (:mod:`qkv.render._practice_rows`) by ``qkv check``'s own
slip reproduction, and every sentence comes from :func:`qkv.check.check` run on the row:

- the **correct** row, and the sentence ``qkv check`` says about it (``correct``);
- per **slip** (``unscaled``, ``softmax-wrong-axis``, ``wrong-query``, ... every slip
  :func:`~qkv.check.slips_for` tries for that row): the row that slip gives from
  correct earlier numbers, with its diagnosis code and sentence;
- per **consequential** row: the row a correct step gives from earlier numbers that carry one
  slip (the finite set of plausible wrong earlier values: each slip of an earlier step), with
  the earlier rows it assumes (``inputs``), which the page compares with what the learner
  typed there;
- the **sensitivity** of each number to the earlier steps (``sens``: how far it moves per unit
  change of every number of an earlier step, summed), from which the page widens the allowance
  by the rounding the learner carried, as ``qkv check`` does: ½·10⁻ⁿ of the typed digits plus
  1.5 · Σ (half unit of the learner's earlier digits) · sensitivity.

Limits (docs/page.md): one slip at a time on correct earlier numbers, or a correct step on
earlier numbers that carry one known slip; a row computed from earlier numbers with an
arithmetic mistake cannot be reproduced, and the page says so and points at that earlier row.
Examples are small (at most :data:`MAX_TOKENS` tokens), as practice by hand is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from qkv.check import DIAGNOSES, Setup
from qkv.examples import Example
from qkv.render._practice_rows import (
    INPUTS,
    SCORE_STEPS,
    Judge,
    View,
    candidates,
    page_feeds,
    row_of,
    row_sens,
    sensitivities,
    starts_of,
    views_of,
)
from qkv.steps import WORDS

__all__ = ["MAX_TOKENS", "practice_data"]

MAX_TOKENS = 8
"""The most tokens a practice page takes: every row is typed by hand."""

_STARTS = {"qk": "Q and K only (no V)", "scores": "its scores"}

_ASK = {
    "Q": ("Q = X·W_q", "each token's query vector: its embedding times W_q"),
    "K": ("K = X·W_k", "each token's key vector: its embedding times W_k"),
    "V": ("V = X·W_v", "each token's value vector: its embedding times W_v"),
    "scores": ("S = Q·Kᵀ", "each query's dot products with every key vector, q_i·k_j"),
    "scaled": ("S' = S × scale", "each row of scores times the scale"),
    "weights": ("A = softmax(S') row by row", "the softmax of each row of scaled scores"),
    "context": ("C = A·V", "each query's weighted sum of the value vectors, Σ_j w_j·v_j"),
    "output": ("O = C·W_o", "each context vector times W_o"),
}


def _scale_words(example: Example, setup: Setup) -> str:
    if example.scale is True:
        return f"divide the scores by √d_k = √{setup.d_k} (d_k = {setup.d_k} per head)"
    if example.scale is False:
        return "leave the scores as they are (this example does not scale them)"
    return f"multiply the scores by {example.scale:g}"


def _scaled_words(example: Example, setup: Setup) -> str:
    if example.scale is True:
        return f"divided by √d_k = √{setup.d_k}"
    if example.scale is False:
        return "as it is (this example does not scale the scores)"
    return f"multiplied by {example.scale:g}"


def _columns(view: View, step: str, heads: int) -> list[str]:
    if step in SCORE_STEPS:
        return [str(token) for token in view.example.tokens]
    width = view.exact[step].shape[1]
    if step == "output":
        return [f"o{i + 1}" for i in range(width)]
    return _dims(width, heads)


def practice_data(example: Example, *, precision: int = 4) -> dict[str, Any]:
    """What the page's practice mode needs, as plain JSON-able data (see the module).

    Args:
        example: a worked example, its options as the page shows it (``scale``, ``causal``,
            ``heads``: use :func:`dataclasses.replace` for ``--no-scale`` and the others).
        precision: the decimals of the sentences and of the rows "show me" reveals.

    Returns:
        ``{"id", "tokens", "inputs", "facts", "steps"}``; each step has its rows, each row its
        correct numbers, its sentence, its sensitivities and its candidates.

    Raises:
        ValueError: more than :data:`MAX_TOKENS` tokens; an example that starts from Q and K
            only or from scores, or whose queries are not its tokens.

    Example:
        >>> from qkv.examples import builtin
        >>> data = practice_data(builtin("i-love-statistics"))
        >>> [s["key"] for s in data["steps"]]
        ['Q', 'K', 'V', 'scores', 'scaled', 'weights', 'context']
        >>> love = data["steps"][5]["rows"][1]
        >>> [round(x, 4) for x in love["correct"]]
        [0.3046, 0.3387, 0.3567]
        >>> sorted({c["code"] for c in love["candidates"] if c["kind"] == "slip"})[:2]
        ['query-key-swapped', 'scaled-by-dk']
    """
    length = len(example.tokens)
    if length > MAX_TOKENS:
        raise ValueError(
            f"this example has {length} tokens, more than {MAX_TOKENS}; practice "
            "pages are for examples worked by hand. Hint: pick a smaller example "
            "(qkv examples)"
        )
    if example.inputs not in ("embeddings", "qkv"):
        raise ValueError(
            "a practice page starts from embeddings and weights, or from Q, K and V; this "
            f"example starts from {_STARTS.get(example.inputs, 'its inputs')}. Hint: give Q, "
            "K and V (or embeddings and weights)"
        )
    if example.query_tokens is not None:
        raise ValueError(
            "a practice page has one query per token; this example has queries of its own "
            f"(query_tokens: {len(example.query_tokens)} queries, {length} keys). Hint: give "
            "Q, K and V for the same tokens; qkv explain --example FILE shows its steps"
        )
    # Judged by the newest rules of qkv check (format 2): every slip it knows.
    example = dataclasses.replace(
        example, claimed={}, head_claimed=(), assumed={}, queries=None, format=2
    )
    given = () if example.inputs == "embeddings" else ("Q", "K", "V")
    views = views_of(example)
    sens = [sensitivities(view) for view in views]
    heads = example.heads
    own = [s for s in views[0].steps if s in ("Q", "K", "V")]
    order: list[tuple[View, str]] = [(views[0], s) for s in own]
    if heads > 1:
        order += [(view, s) for view in views[1:] for s in SCORE_STEPS]
    order += [(views[0], s) for s in views[0].steps[len(own) :]]
    judges = {id(view): Judge(view, precision) for view in views}
    starts = {id(view): starts_of(views, view) for view in views}
    steps: list[dict[str, Any]] = []
    for view, step in order:
        judge = judges[id(view)]
        formula, ask = _ASK[step]
        title = WORDS["concat" if step == "context" and heads > 1 else step].title
        if view.head is not None:
            title += f", head {view.head}"
        if step == "scaled":
            ask = "the scaled scores: each row of scores " + _scaled_words(example, view.setup)
        rows: list[dict[str, Any]] = [
            {
                "t": t,
                "correct": [float(x) for x in row_of(view.exact, step, t)],
                "says": judge.correct(step, t),
                "sens": row_sens(views, view, sens, step, t),
                "feeds": page_feeds(view, heads, step, t),
                "candidates": candidates(views, view, judge, starts[id(view)], step, t),
            }
            for t in range(length)
        ]
        inputs = [view.key(s) for s in INPUTS[step]]
        if heads > 1 and view.head is None and step == "context":
            inputs = [f"weights/{h}" for h in range(heads)] + ["V"]
        inputs = [key for key in inputs if key not in given]
        steps.append(
            {
                "key": view.key(step),
                "step": step,
                "head": view.head,
                "title": title,
                "formula": formula,
                "ask": ask,
                "cols": _columns(view, step, heads),
                "inputs": inputs,
                "causal": bool(example.causal) and step == "weights",
                "rows": rows,
            }
        )
    if given:  # Q, K and V are given: no row of theirs is typed, none is assumed
        for entry in steps:
            for row in entry["rows"]:
                row["feeds"] = [f for f in row["feeds"] if f[0] not in given]
                row["candidates"] = [
                    c
                    for c in row["candidates"]
                    if c["kind"] == "slip" or all(i[0] not in given for i in c["inputs"])
                ]
    data: dict[str, Any] = {
        "tokens": [str(token) for token in example.tokens],
        "inputs": _inputs(example),
        "facts": _facts(example, views[0].setup),
        "diagnoses": dict(DIAGNOSES),
        "safety": 1.5,
        "precision": precision,
        "steps": steps,
    }
    text = json.dumps(data, sort_keys=True, ensure_ascii=True)
    data["id"] = hashlib.sha256(text.encode("ascii")).hexdigest()[:16]
    return data


def _inputs(example: Example) -> list[dict[str, Any]]:
    """The matrices the learner starts from: X (its columns e1, e2, ... are the rows of
    W_q, W_k and W_v), the projections (their columns d1, d2, ... those of Q, K and V)."""
    tokens = [str(t) for t in example.tokens]
    if example.inputs == "embeddings":
        embedding = [f"e{i + 1}" for i in range(example.d_model)]
        matrices = [("embeddings", "X", example.embeddings, tokens, embedding)]
        for name in ("W_q", "W_k", "W_v"):
            value = getattr(example, name)
            matrices.append((name, name, value, embedding, _dims(value.shape[1], example.heads)))
    else:  # Q, K and V given
        matrices = [
            (
                name,
                name,
                example.given[name],
                tokens,
                _dims(example.given[name].shape[1], example.heads),
            )
            for name in ("Q", "K", "V")
        ]
    if example.W_o is not None:
        rows = _dims(example.W_o.shape[0], example.heads)
        cols = [f"o{j + 1}" for j in range(example.W_o.shape[1])]
        matrices.append(("W_o", "W_o", example.W_o, rows, cols))
    return [
        {
            "name": name,
            "title": WORDS[name].title,
            "symbol": symbol,
            "rows": rows,
            "cols": cols,
            "values": [[float(x) for x in line] for line in value],
        }
        for name, symbol, value, rows, cols in matrices
    ]


def _dims(width: int, heads: int) -> list[str]:
    """Column labels of a row of all heads side by side: d1, d2 or h0.d1, h0.d2, h1.d1 (heads
    from 0, components from 1, as qkv explain labels them)."""
    if heads == 1:
        return [f"d{i + 1}" for i in range(width)]
    per = width // heads
    return [f"h{i // per}.d{i % per + 1}" for i in range(width)]


def _facts(example: Example, setup: Setup) -> list[str]:
    width = f"d_model = {example.d_model}, " if example.inputs == "embeddings" else ""
    facts = [
        f"{len(example.tokens)} tokens, {width}d_k = {setup.d_k} per head",
        f"scaling: {_scale_words(example, setup)}",
    ]
    if example.heads > 1:
        facts.append(
            f"{example.heads} heads: head h uses its own columns of W_q, W_k and W_v; the "
            "context vectors of the heads are put side by side, then times W_o"
        )
    if example.causal:
        facts.append("causal: each token attends only to itself and the tokens before it")
    return facts
