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
    weights A  = softmax(S') row by row (a row with no allowed key: all zeros)
    dropout A  = A · keep / (1 − p)   when dropout_p > 0 (keep: qkv.masks.dropout_keep)
    context C  = A·V

The public :func:`qkv.scaled_dot_product_attention` (in ``_dispatch.py``) checks the inputs
and runs this reference, or a fast backend proven equal to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qkv._array import Array, as_array, compute_dtype, device, is_torch_namespace
from qkv.attention import _checks
from qkv.attention._softmax import _softmax
from qkv.masks import Alignment, Mask, ScoreMod, causal, draw_seed, dropout_keep
from qkv.trace import Trace, resolve

STEP_TEXT: Mapping[str, tuple[str, str]] = {
    # name: (formula, what it means in the seeds' words)
    "Q": ("Q", "query vectors: what each word is looking for"),
    "K": ("K", "key vectors: what each word offers to be matched against a query"),
    "V": ("V", "value vectors: the information each word passes on"),
    "scores": (
        "S = Q·Kᵀ",
        "attention scores: the dot product of each query vector with every key vector",
    ),
    "scaled": ("S' = S × scale", "scaled scores: divided by √d_k so softmax is not too sharp"),
    "bias": ("S' = S' + bias", "scaled scores plus the additive bias"),
    "masked": (
        "S' = S' where allowed, −∞ elsewhere",
        "masked scores: keys a query may not attend get −∞, so weight 0",
    ),
    "weights": (
        "A = softmax(S') row by row",
        "attention weights: each row is a probability distribution over the keys (sums to 1)",
    ),
    "dropout": (
        "A = A · keep / (1 − p)",
        "attention weights after dropout: dropped weights are 0, the others divided by 1 − p",
    ),
    "context": ("C = A·V", "context vectors: for each query, the weighted sum of value vectors"),
}


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
    xp, query, key, value = _checks.qkv_arrays(query, key, value, enable_gqa=enable_gqa)
    context, weights = attend(
        xp,
        query,
        key,
        value,
        lead=default_lead_axes(query.ndim, enable_gqa=enable_gqa),
        mask=mask,
        bias=bias,
        score_mod=score_mod,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=scale,
        dropout_p=dropout_p,
        generator=generator,
        trace=resolve(trace),
    )
    return (context, weights) if return_weights else context


def default_lead_axes(ndim: int, *, enable_gqa: bool) -> tuple[str, ...]:
    """Names of the axes before (L, D): (B, H, ...) as in PyTorch; 3-D is (B, ...) or (H, ...)."""
    n = ndim - 2
    if n == 0:
        return ()
    if n == 1:
        return ("head",) if enable_gqa else ("batch",)
    return (*(f"extra{i}" for i in range(n - 2)), "batch", "head")


def attend(
    xp: Any,
    query: Array,
    key: Array,
    value: Array,
    *,
    lead: tuple[str, ...],
    mask: Array | Mask | None,
    bias: Array | None,
    is_causal: bool,
    causal_alignment: str,
    scale: float | None,
    dropout_p: float,
    generator: Any,
    trace: Trace | None,
    score_mod: ScoreMod | None = None,
    qkv_formulas: Mapping[str, str] | None = None,
    squeeze_heads: bool = False,
    positions: Positions | None = None,
) -> tuple[Array, Array]:
    """The reference algorithm on checked inputs. Returns (context, weights before dropout).

    ``lead`` names the axes before (L, D) ("batch", "head", ...); ``squeeze_heads`` drops a
    single head axis from what the trace records; ``qkv_formulas`` overrides the formulas of
    the Q, K, V steps (e.g. "Q = X·W_q" when the caller projected them).
    """
    _checks.check_options(scale, dropout_p, causal_alignment)
    lq, lk, d_k = query.shape[-2], key.shape[-2], query.shape[-1]
    scores_shape = (*query.shape[:-2], lq, lk)
    _checks.check_mask(mask, query, scores_shape)
    bias = None if bias is None else as_array(bias, "bias")
    _checks.check_bias(bias, query, scores_shape)
    out_dtype = query.dtype
    dtype = compute_dtype(xp, query)
    q, k, v = (xp.astype(a, dtype) for a in (query, key, value))
    scale_value = 1.0 / math.sqrt(d_k) if scale is None else float(scale)

    record = _Recorder(trace, lead, squeeze_heads)
    formulas = qkv_formulas or {}
    for name, x, axes in (
        ("Q", q, ("query", "dim")),
        ("K", k, ("key", "dim")),
        ("V", v, ("key", "dim")),
    ):
        record(name, x, axes, formula=formulas.get(name), kv=name != "Q")

    # Grouped-query attention: query head h uses key/value head h // group.
    group = query.shape[-3] // key.shape[-3] if query.ndim >= 3 and key.shape[-3] else 1
    if group > 1:
        k = xp.repeat(k, group, axis=-3)  # (..., H, Lk, D)
        v = xp.repeat(v, group, axis=-3)  # (..., H, Lk, Dv)

    allowed = _allowed(
        xp, mask, is_causal, causal_alignment, lead, scores_shape, device(query), positions
    )
    scores = _scores(xp, q, k, masked=allowed is not None)  # (..., H, Lq, Lk)
    record("scores", scores, ("query", "key"))
    with _quiet(xp):
        scaled = scores * scale_value
    operands = (("query", q), ("key", k))
    _check_overflow(xp, scaled, allowed, "the scaled scores Q·Kᵀ × scale", operands, scale_value)
    record("scaled", scaled, ("query", "key"), formula=scale_formula(scale, d_k))
    if bias is not None:
        before = scaled
        with _quiet(xp):
            scaled = scaled + xp.astype(bias, dtype)
        if not bool(xp.all(xp.isfinite(scaled))):
            named = (("scaled score", before), ("bias", bias))
            _check_overflow(xp, scaled, allowed, "the scaled scores plus the bias", named)
        record("bias", scaled, ("query", "key"))
    if score_mod is not None:
        scaled = _evaluate(xp, score_mod, lead, scores_shape, device(query), positions, scaled)
        record("bias", scaled, ("query", "key"), formula=f"S' = {score_mod!r}(S')")

    if allowed is not None:
        scaled = xp.where(allowed, scaled, xp.asarray(-xp.inf, dtype=dtype, device=device(q)))
        record("masked", scaled, ("query", "key"))

    weights = _softmax(xp, scaled)  # (..., H, Lq, Lk)
    record("weights", weights, ("query", "key"))
    used = weights
    if dropout_p > 0:
        seed = draw_seed(generator, torch_inputs=is_torch_namespace(xp))
        rule = dropout_keep(dropout_p, seed)
        keep = _evaluate(xp, rule, lead, scores_shape, device(query), positions)
        used = xp.where(keep, weights / (1.0 - dropout_p), xp.zeros_like(weights))
        record("dropout", used, ("query", "key"))

    context = weighted_sum(xp, used, v)  # (..., H, Lq, Dv)
    record("context", context, ("query", "dim"))

    if trace is not None:
        trace.meta.update(
            num_heads=int(query.shape[-3]) if "head" in lead else 1,
            num_kv_heads=int(key.shape[-3]) if "head" in lead else 1,
            d_k=int(d_k),
            d_v=int(value.shape[-1]),
            scale=scale_value,
            scale_mode="sqrt_dk" if scale is None else ("none" if scale == 1.0 else "custom"),
            causal=bool(is_causal),
            causal_alignment=causal_alignment,
            mask=None if mask is None else _describe_mask(mask),
        )
        if score_mod is not None:
            trace.meta["score_mod"] = repr(score_mod)
    return xp.astype(context, out_dtype), xp.astype(weights, out_dtype)


def _scores(xp: Any, q: Array, k: Array, *, masked: bool) -> Array:
    """S = Q·Kᵀ, (..., H, Lq, Lk).

    With a mask, a NaN or ±inf entry of a query or key must not reach the gradient through a
    masked-out pair: dQ = dS·K has dS = 0 there, but 0 · NaN is NaN. The scores are then
    computed with those entries replaced by 0, and the pairs that involve them take their
    true score with no gradient (as in the tiled kernel): a live NaN still gives NaN.
    """
    with _quiet(xp):
        scores = xp.matmul(q, xp.matrix_transpose(k))
    if not masked:
        return scores
    q_ok = xp.all(xp.isfinite(q), axis=-1, keepdims=True)  # (..., Lq, 1)
    k_ok = xp.all(xp.isfinite(k), axis=-1, keepdims=True)  # (..., Lk, 1)
    if bool(xp.all(q_ok)) and bool(xp.all(k_ok)):
        return scores
    zero = xp.zeros_like(q[..., :1, :1])
    clean_q = xp.where(xp.isfinite(q), q, zero)
    clean_k = xp.where(xp.isfinite(k), k, zero)
    clean = xp.matmul(clean_q, xp.matrix_transpose(clean_k))
    both = q_ok & xp.matrix_transpose(k_ok)  # (..., Lq, Lk)
    true = scores.detach() if hasattr(scores, "detach") else scores
    return xp.where(both, clean, true)


def _quiet(xp: Any) -> Any:
    """NumPy's overflow warnings off: :func:`_check_overflow` says it in one line instead."""
    import contextlib

    if is_torch_namespace(xp):
        return contextlib.nullcontext()
    import numpy as np

    return np.errstate(over="ignore", invalid="ignore")


def _check_overflow(
    xp: Any,
    scores: Array,
    allowed: Array | None,
    what: str,
    operands: tuple[tuple[str, Array], ...],
    scale: float | None = None,
) -> None:
    """ValueError when finite operands gave a score of ±inf or NaN (on an allowed pair)."""
    bad = ~xp.isfinite(scores)
    if allowed is not None:
        bad = bad & allowed
    if not bool(xp.any(bad)) or not all(bool(xp.all(xp.isfinite(x))) for _, x in operands):
        return
    largest = ", ".join(f"|{name}| ≤ {float(xp.max(xp.abs(x))):.3g}" for name, x in operands)
    scaled = "" if scale is None else f", scale = {scale:.3g}"
    raise ValueError(
        f"{what} overflowed {_dtype_word(scores)}: finite inputs ({largest}{scaled}) give "
        "±inf or NaN scores, so the weights would be NaN. Hint: "
        "rescale query and key (or the scale) so that q·k × scale stays well below the "
        "dtype's maximum; qkv refuses rather than return NaN."
    )


def _dtype_word(x: Array) -> str:
    return str(x.dtype).removeprefix("torch.")


def scale_formula(scale: float | None, d_k: int) -> str:
    """The formula of the scaling step, with the numbers of this run."""
    if scale is None:
        return f"S' = S / √d_k = S / √{d_k} = S × {1 / math.sqrt(d_k):.4g}"
    if scale == 1.0:
        return "S' = S (no scaling)"
    return f"S' = S × {scale:.4g}"


def _describe_mask(mask: Array | Mask) -> str:
    return repr(mask) if isinstance(mask, Mask) else f"boolean array {tuple(mask.shape)}"


def _allowed(
    xp: Any,
    mask: Array | Mask | None,
    is_causal: bool,
    alignment: str,
    lead: tuple[str, ...],
    scores_shape: tuple[int, ...],
    dev: Any,
    positions: Positions | None = None,
) -> Array | None:
    """The boolean mask of allowed (query, key) pairs, or None when every pair is allowed."""
    rule = mask if isinstance(mask, Mask) else None
    if is_causal:
        rule = causal(alignment) if rule is None else rule & causal(alignment)  # type: ignore[arg-type]
    allowed = None if mask is None or isinstance(mask, Mask) else mask
    if rule is not None:
        dense = _evaluate(xp, rule, lead, scores_shape, dev, positions)
        allowed = dense if allowed is None else allowed & dense
    return allowed


def _evaluate(
    xp: Any,
    rule: Mask | ScoreMod,
    lead: tuple[str, ...],
    scores_shape: tuple[int, ...],
    dev: Any,
    positions: Positions | None = None,
    scores: Array | None = None,
) -> Array:
    """Evaluate a Mask rule (or a ScoreMod on ``scores``) on index arrays laid out like the
    scores (..., H, Lq, Lk); with ``positions``, the heads and queries are those rows of a
    larger call."""
    ndim = len(scores_shape)

    def index(axis: int, values: list[int] | None = None) -> Array:
        shape = [1] * ndim
        shape[axis] = scores_shape[axis]
        found = (
            xp.arange(scores_shape[axis], device=dev)
            if values is None
            else xp.asarray(values, device=dev)
        )
        return xp.reshape(found, tuple(shape))

    zero = xp.asarray(0, device=dev)
    heads = None if positions is None else positions.heads
    b = index(lead.index("batch")) if "batch" in lead else zero
    h = index(lead.index("head"), heads) if "head" in lead else zero
    q = index(ndim - 2, None if positions is None else positions.queries)
    kv = index(ndim - 1)
    lq = scores_shape[-2] if positions is None else positions.q_len
    lk = scores_shape[-1]
    if isinstance(rule, ScoreMod):
        return rule(scores, b, h, q, kv, lq, lk, xp)
    return rule(b, h, q, kv, lq, lk, xp)


@dataclass(frozen=True)
class Positions:
    """Where the rows of a call sit in a larger one (a trace of selected rows).

    Attributes:
        heads: the original index of each query head (None: no head axis).
        queries: the original index of each query row.
        q_len: the original Lq (the causal alignment depends on it).
    """

    heads: list[int] | None
    queries: list[int]
    q_len: int


def weighted_sum(xp: Any, weights: Array, value: Array) -> Array:
    """C = A·V, where a value row with weight 0 contributes nothing, even if it is NaN or ±inf.

    Plain matrix multiplication would turn 0 · NaN into NaN: a NaN in a padded or masked-out
    value would reach every output. When ``value`` holds non-finite entries, they are added
    back only for the queries that give them a positive weight.
    """
    finite = xp.isfinite(value)
    if bool(xp.all(finite)):
        return xp.matmul(weights, value)
    zero = xp.zeros_like(value)
    context = xp.matmul(weights, xp.where(finite, value, zero))
    attended = xp.astype(weights > 0, value.dtype)  # (..., Lq, Lk): 1 where the weight is > 0

    def reaches(hit: Array) -> Array:  # does some attended key have this kind of value?
        return xp.matmul(attended, xp.astype(hit, value.dtype)) > 0

    pos = reaches(xp.isinf(value) & (value > 0))
    neg = reaches(xp.isinf(value) & (value < 0))
    nan = reaches(xp.isnan(value)) | (pos & neg)
    inf = xp.asarray(xp.inf, dtype=value.dtype, device=device(value))
    context = xp.where(pos, inf, xp.where(neg, -inf, context))
    return xp.where(nan, xp.asarray(xp.nan, dtype=value.dtype, device=device(value)), context)


class _Recorder:
    """Records steps into a trace with the axis names of this call; does nothing when off."""

    def __init__(self, trace: Trace | None, lead: tuple[str, ...], squeeze_heads: bool) -> None:
        self.trace = trace
        self.lead = lead
        self.squeeze = squeeze_heads

    def __call__(
        self,
        name: str,
        value: Array,
        axes: tuple[str, ...],
        *,
        formula: str | None = None,
        kv: bool = False,
    ) -> None:
        if self.trace is None:
            return
        lead = tuple("kv_head" if kv and a == "head" else a for a in self.lead)
        if self.squeeze and lead and lead[-1] in ("head", "kv_head"):
            value = value[..., 0, :, :]
            lead = lead[:-1]
        default_formula, description = STEP_TEXT[name]
        self.trace.record(
            name,
            value,
            formula=formula or default_formula,
            description=description,
            axes=(*lead, *axes),
        )
