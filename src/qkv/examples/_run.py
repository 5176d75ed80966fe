"""Run a worked example through the attention core and return its trace."""

from __future__ import annotations

import math

import numpy as np

from qkv.attention import multi_head_attention
from qkv.examples._model import Example
from qkv.examples._run_given import run_given
from qkv.examples._tokens import TokenRefError, token_index
from qkv.trace import Trace


def run(
    example: Example,
    *,
    query: str | int | None = None,
    scale: bool | float | None = None,
    causal: bool | None = None,
    heads: int | None = None,
    trace: Trace | None = None,
) -> Trace:
    """Compute every step of the example's attention and record it in a trace.

    Calls ``qkv.multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads=heads, ...)`` with the
    example's embeddings X (L, E) and weights, so the trace holds ``embeddings``, ``W_q``,
    ``W_k``, ``W_v``, ``Q``, ``K``, ``V``, ``scores``, ``scaled``, ``weights``, ``context``
    and, for several heads or a ``W_o``, ``concat`` and ``output``; for each query all L rows
    are computed, ``meta["queries"]`` says which to show.

    An example that gives Q (Lq, H·D), K (Lk, H·D) and V (Lk, H·Dv) directly (format 2)
    runs ``qkv.scaled_dot_product_attention`` on them, split into heads, with the same
    steps from ``Q`` on (no embeddings or projections); its keys are ``tokens`` and its
    queries ``query_tokens`` when Lq ≠ Lk (``trace.query_tokens``).

    Args:
        example: the worked example.
        query: show only this query: a token's text or its 0-based position (a text of
            digits that is no token is read as a position; with Lq ≠ Lk, among the query
            tokens). Default: the example's queries.
        scale: True divides the scores by √d_k, False does not scale, a number multiplies
            the scores. Default: the example's.
        causal: each token attends only to itself and the tokens before it. Default: the
            example's.
        heads: the number of heads; it must divide the columns of W_q, W_k and W_v (of Q, K
            and V when they are given). Default: the example's.
        trace: the trace to record into; a new one by default.

    Returns:
        The trace, with ``tokens`` set and ``meta`` holding ``name``, ``description``,
        ``example`` (the built-in name or the file), ``queries`` (positions, or None for
        all) and ``example_queries`` (the example's own, which its description is about),
        besides what the attention core records (``num_heads``, ``d_k``, ``scale``, ...).

    Raises:
        ValueError: an unknown, ambiguous or out-of-range ``query``; ``heads`` that does not
            divide d_k; a ``scale`` that is not positive; an example given by Q and K only or
            by its scores (it has no V).

    Example:
        >>> from qkv.examples import builtin
        >>> t = run(builtin("i-love-statistics"))
        >>> t.meta["queries"], t["weights"].select()[1].round(4)
        ([1], array([0.3046, 0.3387, 0.3567]))
    """
    if example.inputs not in ("embeddings", "qkv"):
        raise ValueError(
            f"this example gives {_GIVEN[example.inputs]} directly, without V; run() and qkv "
            "explain need embeddings and weights, or Q, K and V. Hint: qkv check checks such "
            "an example"
        )
    num_heads = _heads(example, example.heads if heads is None else heads)
    scale = example.scale if scale is None else scale
    causal = example.causal if causal is None else causal
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    queries = example.queries if query is None else (_query(example, query),)
    trace = Trace() if trace is None else trace
    if example.inputs == "qkv":
        run_given(
            example,
            heads=num_heads,
            scale=_scale_factor(scale),
            causal=causal,
            mask=allowed_keys(example),
            trace=trace,
        )
    else:
        multi_head_attention(
            example.embeddings,
            example.W_q,
            example.W_k,
            example.W_v,
            example.W_o,
            num_heads=num_heads,
            mask=allowed_keys(example),
            is_causal=causal,
            causal_alignment="bottom-right" if example.alignment == "bottom-right" else "top-left",
            scale=_scale_factor(scale),
            trace=trace,
        )
    trace.tokens = list(example.tokens)
    trace.query_tokens = None if example.query_tokens is None else list(example.query_tokens)
    trace.meta["name"] = example.name
    trace.meta["description"] = example.description
    trace.meta["example"] = example.slug or example.source
    trace.meta["queries"] = None if queries is None else list(queries)
    trace.meta["example_queries"] = None if example.queries is None else list(example.queries)
    return trace


_GIVEN = {"qk": "Q and K", "scores": "its scores"}


def allowed_keys(example: Example) -> np.ndarray | None:
    """The (Lq, Lk) keys each query may attend by ``key_length`` and ``mask`` (True = may
    attend; the causal rule aside), or None when neither is given.

    Example:
        >>> from qkv.examples import loads
        >>> ex = loads("format: 2\\ninputs: {scores: [[1, 2], [3, 4]]}\\n"
        ...            "options: {key_length: 1, scale: false}")
        >>> allowed_keys(ex)
        array([[ True, False],
               [ True, False]])
    """
    lq = len(example.queries_named)
    lk = len(example.tokens)
    if example.key_length is None and example.mask is None:
        return None
    allowed = np.ones((lq, lk), dtype=bool)
    if example.key_length is not None:
        allowed[:, example.key_length :] = False
    if example.mask is not None:
        allowed &= example.mask
    return allowed


def _scale_factor(scale: bool | float) -> float | None:
    """The core's ``scale``: None for 1/√d_k, else the factor that multiplies the scores."""
    if isinstance(scale, bool):
        return None if scale else 1.0
    if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"scale must be True (divide by √d_k), False (no scaling) or a positive number "
            f"that multiplies the scores; got {scale!r}. Hint: scale=1/√d_k is the default "
            "(True)"
        )
    return float(scale)


def _heads(example: Example, heads: int) -> int:
    d_k, d_v = example.W_q.shape[1], example.W_v.shape[1]
    valid = [h for h in range(1, d_k + 1) if d_k % h == 0 and d_v % h == 0]
    if isinstance(heads, bool) or not isinstance(heads, int) or heads not in valid:
        q_k, v = ("Q and K", "V") if example.inputs == "qkv" else ("W_q and W_k", "W_v")
        raise ValueError(
            f"heads must divide d_k = {d_k} (the columns of {q_k}) and d_v = {d_v} "
            f"(the columns of {v}); got {heads!r}. Hint: this example can run with heads = "
            + ", ".join(map(str, valid))
        )
    return heads


def _query(example: Example, query: str | int) -> int:
    if isinstance(query, bool) or not isinstance(query, str | int):
        raise TypeError(
            f"query must be a token (its text or 0-based position), got {type(query).__name__}"
        )
    try:
        return token_index(query, example.queries_named)
    except TokenRefError as error:
        raise ValueError(f"query: {error.problem}. Hint: {error.hint}") from None
