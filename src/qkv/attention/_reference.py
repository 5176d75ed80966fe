"""Scaled dot-product attention: the readable reference implementation.

Shape legend (as PyTorch's SDPA):

    B   batch                 Lq  query length            D   head dim (d_k)
    H   query heads           Lk  key / value length      Dv  value dim (d_v)
    Hkv key/value heads (GQA: H is a multiple of Hkv)

    query (..., H, Lq, D)   key (..., Hkv, Lk, D)   value (..., Hkv, Lk, Dv)
    scores, weights (..., H, Lq, Lk)             context (..., H, Lq, Dv)

The algorithm, step by step (each step is recorded in the trace under its name):

    scores  S  = Q·Kᵀ
    scaled  S' = S · scale            scale = 1/√d_k unless given
    bias    S' = S' + bias            when a bias is given
            S' = score_mod(S', b, h, i, j)   when a score modifier is given (ALiBi, softcap)
    masked  S' = S' where allowed, −∞ elsewhere
    weights A  = softmax(S') row by row (a row with no allowed key: all zeros); with sinks,
               A_ij = exp(S'_ij) / (Σ_j exp(S'_ij) + exp(sink_h)): the sink is one more key
               with score sink_h and value 0, so a row sums to less than 1
    dropout A  = A · keep / (1 − p)   when dropout_p > 0 (keep: qkv.masks.dropout_keep)
    context C  = A·V

The public :func:`qkv.scaled_dot_product_attention` (in ``_dispatch.py``) checks the inputs
once (``_options.make_call``) and runs :func:`attend` on them, or a fast backend proven equal
to it. ``attend`` holds only the mathematics: the options come as one checked
:class:`~qkv.attention._options.Options`, the trace's settings as one ``Recorder``.
"""

from __future__ import annotations

import math
from typing import Any

from qkv._array import Array, compute_dtype, device
from qkv.attention._guards import check_overflow, clean_scores, quiet, weighted_sum
from qkv.attention._options import Call, Options, make_call
from qkv.attention._recorder import Positions, Recorder
from qkv.attention._softmax import _softmax
from qkv.masks import Alignment, Mask, ScoreMod, dropout_keep
from qkv.trace import Trace

__all__ = ["attend", "attend_call", "reference_attention", "scale_formula", "weighted_sum"]

_NO_RECORD = Recorder()


def reference_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | Mask | None = None,
    bias: Array | None = None,
    score_mod: ScoreMod | None = None,
    is_causal: bool = False,
    causal_alignment: Alignment = "top-left",
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    generator: Any = None,
    sinks: Array | None = None,
    return_weights: bool = False,
    trace: Trace | None = None,
) -> Any:
    """Attention(Q, K, V) = softmax(Q·Kᵀ · scale + bias, masked) · V, the reference.

    The readable reference: every step is plain array code, and every fast path of qkv is
    tested against it. NumPy arrays give NumPy results, PyTorch tensors give tensors on the
    same device and dtype; float16 and bfloat16 are computed in float32. It is what
    ``qkv.scaled_dot_product_attention(..., backend="reference")`` runs.

    Args:
        query: (..., H, Lq, D), or (Lq, D) for a single head.
        key: (..., Hkv, Lk, D).
        value: (..., Hkv, Lk, Dv).
        mask: boolean, **True = may attend**, broadcastable to (..., H, Lq, Lk); or a
            :class:`qkv.masks.Mask`. A query with no allowed key gets zero weights and a zero
            context vector.
        bias: added to the scaled scores, broadcastable to (..., H, Lq, Lk) (e.g. ALiBi).
        score_mod: a :class:`qkv.masks.ScoreMod` applied to the scaled scores after the
            bias and before the mask, e.g. ``qkv.masks.softcap(30.0)``.
        is_causal: query i attends only keys j ≤ i (combined with ``mask`` if both are given).
        causal_alignment: ``"top-left"`` or ``"bottom-right"`` (for Lq < Lk, as in decoding
            with a KV cache; the last query sees every key).
        scale: multiplies the scores; default 1/√D. ``scale=1.0`` means no scaling.
        enable_gqa: allow H > Hkv (grouped-query attention): query head h uses key/value
            head h // (H / Hkv).
        dropout_p: probability of dropping an attention weight (training only).
        generator: random source for dropout: a ``numpy.random.Generator``, a
            ``torch.Generator`` or an int seed. One seed is drawn from it and the dropped
            weights follow :func:`qkv.masks.dropout_keep` (the same on every backend).
        sinks: per-head attention-sink logits, shape (H,): one more key per head whose score
            is sink_h and whose value is 0, so each row's weights sum to less than 1.
        return_weights: also return the attention weights (before dropout).
        trace: record every step into this :class:`qkv.Trace` (default: the enclosing
            :func:`qkv.tracing` block, if any).

    Returns:
        context (..., H, Lq, Dv); with ``return_weights``, ``(context, weights)`` with
        weights (..., H, Lq, Lk).

    Raises:
        ValueError, TypeError: on shapes, dtypes or options that do not fit, naming the
            argument, what was expected and what came.

    Example:
        >>> import numpy as np
        >>> q = np.array([[0.0, 2 ** 0.5]])              # one query, d_k = 2
        >>> k = np.array([[0.0, 0.0], [0.0, 1.0]])       # two keys: q·k = 0 and √2
        >>> v = np.array([[1.0, 0.0], [0.0, 1.0]])
        >>> context, weights = reference_attention(q, k, v, return_weights=True)
        >>> weights                                       # [1, e] / (1 + e)
        array([[0.26894142, 0.73105858]])
        >>> context
        array([[0.26894142, 0.73105858]])

    The same computation, written out (the docstring doubles as a spec)::

        S = query @ key.mT * scale + bias
        S = score_mod(S, b, h, i, j)
        S = where(mask, S, -inf)
        A = softmax(S, axis=-1)          # rows with no allowed key -> 0
        return A @ value
    """
    call = make_call(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        score_mod=score_mod,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=scale,
        enable_gqa=enable_gqa,
        dropout_p=dropout_p,
        generator=generator,
        sinks=sinks,
        trace=trace,
    )
    context, weights = attend_call(call)
    return (context, weights) if return_weights else context


def attend_call(call: Call) -> tuple[Array, Array | None]:
    """:func:`attend` on a checked call: the reference backend's run."""
    return attend(
        call.xp,
        call.query,
        call.key,
        call.value,
        call.options,
        lead=call.lead,
        recorder=call.recorder,
    )


def attend(
    xp: Any,
    query: Array,
    key: Array,
    value: Array,
    options: Options,
    *,
    lead: tuple[str, ...],
    recorder: Recorder = _NO_RECORD,
) -> tuple[Array, Array]:
    """The reference algorithm on checked inputs: (context, weights before dropout).

    Args:
        xp: the array namespace.
        query: (…lead, Lq, D). key: (…lead, Lk, D), Hkv heads. value: (…lead, Lk, Dv).
        options: the call's checked :class:`~qkv.attention._options.Options`.
        lead: the names of the axes before (L, D) ("batch", "head", ...).
        recorder: where each step goes (nowhere by default); its ``positions`` place
            these rows in a larger call (a partial trace).

    Returns:
        context (…lead, Lq, Dv) and weights (…lead, Lq, Lk), in the dtype of query.
    """
    lq, lk, d_k = query.shape[-2], key.shape[-2], query.shape[-1]
    scores_shape = (*query.shape[:-2], lq, lk)
    where = _Where(xp, lead, scores_shape, device(query), recorder.positions)
    out_dtype = query.dtype
    dtype = compute_dtype(xp, query)
    q, k, v = (xp.astype(a, dtype, copy=False) for a in (query, key, value))
    scale = options.scale_for(d_k)

    def record(name: str, x: Array, axes: tuple[str, ...], **kw: Any) -> None:
        recorder.step(name, x, lead, axes, **kw)

    recorder.begin(query, key, value)
    record("Q", q, ("query", "dim"))
    record("K", k, ("key", "dim"), kv=True)
    record("V", v, ("key", "dim"), kv=True)

    # Grouped-query attention: query head h uses key/value head h // group.
    group = query.shape[-3] // key.shape[-3] if query.ndim >= 3 and key.shape[-3] else 1
    if group > 1:
        k = xp.repeat(k, group, axis=-3)  # (..., H, Lk, D)
        v = xp.repeat(v, group, axis=-3)  # (..., H, Lk, Dv)

    allowed = _allowed(where, options)  # (..., H, Lq, Lk) booleans, or None
    scores = clean_scores(xp, q, k, masked=allowed is not None)  # (..., H, Lq, Lk)
    record("scores", scores, ("query", "key"))
    with quiet(xp):
        scaled = scores * scale
    operands = (("query", q), ("key", k))
    check_overflow(xp, scaled, allowed, "the scaled scores Q·Kᵀ × scale", operands, scale)
    record("scaled", scaled, ("query", "key"), formula=scale_formula(options.scale, d_k))
    if options.bias is not None:
        before = scaled
        with quiet(xp):
            scaled = scaled + xp.astype(options.bias, dtype)
        if not bool(xp.all(xp.isfinite(scaled))):
            named = (("scaled score", before), ("bias", options.bias))
            check_overflow(xp, scaled, allowed, "the scaled scores plus the bias", named)
        record("bias", scaled, ("query", "key"))
    if options.score_mod is not None:
        scaled = where.evaluate(options.score_mod, scaled)
        record("bias", scaled, ("query", "key"), formula=f"S' = {options.score_mod!r}(S')")

    if allowed is not None:
        scaled = xp.where(allowed, scaled, xp.asarray(-xp.inf, dtype=dtype, device=device(q)))
        record("masked", scaled, ("query", "key"))

    if options.sinks is None:
        weights = _softmax(xp, scaled)  # (..., H, Lq, Lk)
    else:
        # The sink: one more key, with score sink_h and value 0, in every row of head h.
        sink = where.sink_column(options.sinks, dtype)  # (..., H, Lq, 1)
        with_sink = _softmax(xp, xp.concat([scaled, sink], axis=-1))
        weights = with_sink[..., :-1]  # rows sum to 1 − the sink's share
        if recorder.trace is not None:
            recorder.sink(with_sink[..., -1], lead, options.sinks)
    record("weights", weights, ("query", "key"))
    used = weights
    if options.dropout_p > 0 and options.seed is not None:
        keep = where.evaluate(dropout_keep(options.dropout_p, options.seed))
        used = xp.where(keep, weights / (1.0 - options.dropout_p), xp.zeros_like(weights))
        record("dropout", used, ("query", "key"))

    context = weighted_sum(xp, used, v)  # (..., H, Lq, Dv)
    record("context", context, ("query", "dim"))
    recorder.facts(query, key, value, lead, options)
    return xp.astype(context, out_dtype), xp.astype(weights, out_dtype)


def scale_formula(scale: float | None, d_k: int) -> str:
    """The formula of the scaling step, with the numbers of this run."""
    if scale is None:
        return f"S' = S / √d_k = S / √{d_k} = S × {1 / math.sqrt(d_k):.4g}"
    if scale == 1.0:
        return "S' = S (no scaling)"
    return f"S' = S × {scale:.4g}"


def _allowed(where: _Where, options: Options) -> Array | None:
    """The boolean mask of allowed (query, key) pairs, or None when every pair is allowed."""
    allowed = options.dense_mask
    rule = options.rule
    if rule is not None:
        dense = where.evaluate(rule)
        allowed = dense if allowed is None else allowed & dense
    return allowed


class _Where:
    """Index arrays laid out like the scores (..., H, Lq, Lk), to evaluate rules on; with
    ``positions``, the heads and queries are those rows of a larger call."""

    def __init__(
        self,
        xp: Any,
        lead: tuple[str, ...],
        scores_shape: tuple[int, ...],
        dev: Any,
        positions: Positions | None,
    ) -> None:
        self.xp, self.lead, self.shape, self.dev = xp, lead, scores_shape, dev
        self.positions = positions

    def _index(self, axis: int, values: list[int] | None = None) -> Array:
        xp = self.xp
        shape = [1] * len(self.shape)
        shape[axis] = self.shape[axis]
        found = (
            xp.arange(self.shape[axis], device=self.dev)
            if values is None
            else xp.asarray(values, device=self.dev)
        )
        return xp.reshape(found, tuple(shape))

    def sink_column(self, sinks: Array, dtype: Any) -> Array:
        """The sink logits (H,) as a column laid out like the scores, (..., H, Lq, 1): the
        rows of head h get sink_h (the selected heads' sinks for a partial trace)."""
        xp = self.xp
        sinks = xp.astype(sinks, dtype)
        heads = None if self.positions is None else self.positions.heads
        if heads is not None:
            sinks = xp.take(sinks, xp.asarray(heads, device=self.dev), axis=0)
        shape = [1] * len(self.shape)
        if "head" in self.lead:
            shape[self.lead.index("head")] = int(sinks.shape[0])
        column = xp.reshape(sinks, tuple(shape))
        return xp.broadcast_to(column, (*self.shape[:-1], 1))

    def evaluate(self, rule: Mask | ScoreMod, scores: Array | None = None) -> Array:
        """A Mask rule's booleans, or a ScoreMod applied to ``scores``."""
        xp, lead, positions = self.xp, self.lead, self.positions
        ndim = len(self.shape)
        zero = xp.asarray(0, device=self.dev)
        heads = None if positions is None else positions.heads
        b = self._index(lead.index("batch")) if "batch" in lead else zero
        h = self._index(lead.index("head"), heads) if "head" in lead else zero
        q = self._index(ndim - 2, None if positions is None else positions.queries)
        kv = self._index(ndim - 1)
        lq = self.shape[-2] if positions is None else positions.q_len
        lk = self.shape[-1]
        if isinstance(rule, ScoreMod):
            return rule(scores, b, h, q, kv, lq, lk, xp)
        return rule(b, h, q, kv, lq, lk, xp)
