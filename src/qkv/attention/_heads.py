"""Projections and heads: Q = X·W_q, split into heads, attend, concat, ·W_o.

Row-vector convention (seed 000): each token is a row of X, and ``Q = X @ W_q`` with W_q of
shape (d_model, d_k). Seed 001 writes ``Q = W_Q·X`` with tokens as columns: the same thing
transposed (its W_Q is our W_qᵀ).

Shape legend: B batch, L / Lq query length, Lk key length, E model dim (d_model),
Ekv the model dim of the keys' sequence (cross-attention), H query heads, Hkv key/value
heads, D head dim (d_k), Dv value head dim, Eo output dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qkv._array import Array, as_array, is_torch_namespace, namespace, shape_str
from qkv.attention import _checks
from qkv.attention._backend import BackendName
from qkv.attention._options import make_call
from qkv.attention._plans import run_call
from qkv.masks import Alignment, Mask, ScoreMod
from qkv.steps import WORDS
from qkv.trace import Trace, resolve


def split_heads(xp: Any, x: Array, heads: int) -> Array:
    """(..., L, H·D) → (..., H, L, D)."""
    *lead, length, width = x.shape
    x = xp.reshape(x, (*lead, length, heads, width // heads))  # (..., L, H, D)
    n = x.ndim
    return xp.permute_dims(x, (*range(n - 3), n - 2, n - 3, n - 1))  # (..., H, L, D)


def merge_heads(xp: Any, x: Array) -> Array:
    """(..., H, L, D) → (..., L, H·D): the heads' columns side by side."""
    n = x.ndim
    x = xp.permute_dims(x, (*range(n - 3), n - 2, n - 3, n - 1))  # (..., L, H, D)
    *lead, length, heads, dim = x.shape
    return xp.reshape(x, (*lead, length, heads * dim))  # (..., L, H·D)


def multi_head_attention(
    x: Array,
    W_q: Array,
    W_k: Array,
    W_v: Array,
    W_o: Array | None = None,
    num_heads: int = 1,
    num_kv_heads: int | None = None,
    *,
    context: Array | None = None,
    b_q: Array | None = None,
    b_k: Array | None = None,
    b_v: Array | None = None,
    b_o: Array | None = None,
    mask: Array | Mask | None = None,
    bias: Array | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    is_causal: bool = False,
    causal_alignment: Alignment = "top-left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: Any = None,
    sinks: Array | None = None,
    return_weights: bool = False,
    trace: Trace | None = None,
    backend: BackendName = "auto",
) -> Any:
    """Multi-head attention: project, split into heads, attend in each head, concat, ·W_o.

    Q = X·W_q, K = X·W_k, V = X·W_v (row vectors). The columns of W_q and W_k split evenly
    into ``num_heads`` heads of d_k = D columns; W_k and W_v into ``num_kv_heads`` heads
    (grouped-query attention when fewer; 1 is multi-query attention). Each head computes
    softmax(Q_h·K_hᵀ·scale)·V_h; the heads' context vectors are concatenated and multiplied
    by W_o.

    Args:
        x: the token embeddings, (..., Lq, E); the queries come from here.
        W_q: (E, H·D). W_k: (Ekv, Hkv·D). W_v: (Ekv, Hkv·Dv).
        W_o: (H·Dv, Eo), or None to return the concatenated context vectors.
        num_heads: H. num_kv_heads: Hkv (default H); must divide H.
        context: for cross-attention, the sequence the keys and values come from,
            (..., Lk, Ekv); default ``x`` (self-attention).
        b_q, b_k, b_v, b_o: optional projection biases, of the projections' output widths.
        mask, bias, score_mod, is_causal, causal_alignment, scale, dropout_p, generator,
            sinks, backend: as in :func:`qkv.scaled_dot_product_attention`, with scores of shape
            (..., H, Lq, Lk).
        return_weights: also return the attention weights (..., H, Lq, Lk).
        trace: record every step (embeddings, W_q, …, per-head steps, concat, output).

    Returns:
        (..., Lq, Eo), or (..., Lq, H·Dv) without W_o; with ``return_weights``,
        ``(output, weights)``.

    Example:
        >>> import numpy as np
        >>> x = np.eye(4)                          # 4 tokens, d_model = 4
        >>> W = np.eye(4)                          # 2 heads of d_k = 2
        >>> out, weights = multi_head_attention(x, W, W, W, W, num_heads=2,
        ...                                     return_weights=True)
        >>> out.shape, weights.shape               # (Lq, Eo) and (H, Lq, Lk)
        ((4, 4), (2, 4, 4))
        >>> weights.sum(axis=-1)                   # each head's rows sum to 1
        array([[1., 1., 1., 1.],
               [1., 1., 1., 1.]])
    """
    x = as_array(x, "x")
    source = x if context is None else as_array(context, "context")
    W_q, W_k, W_v = (as_array(w, n) for w, n in ((W_q, "W_q"), (W_k, "W_k"), (W_v, "W_v")))
    W_o = None if W_o is None else as_array(W_o, "W_o")
    named = [("x", x), ("context", context), ("W_q", W_q), ("W_k", W_k), ("W_v", W_v)]
    named += [("W_o", W_o), ("b_q", b_q), ("b_k", b_k), ("b_v", b_v), ("b_o", b_o)]
    xp = namespace(named)
    heads = _checks.check_positive_int(num_heads, "num_heads", "num_heads=2 splits d_k in two.")
    kv_heads = (
        heads
        if num_kv_heads is None
        else _checks.check_positive_int(
            num_kv_heads, "num_kv_heads", "1 is multi-query attention; default: num_heads."
        )
    )
    _check_projections(x, source, W_q, W_k, W_v, W_o, heads, kv_heads, context is not None)
    for name, b, width in (
        ("b_q", b_q, W_q.shape[1]),
        ("b_k", b_k, W_k.shape[1]),
        ("b_v", b_v, W_v.shape[1]),
    ):
        _check_bias_vector(b, name, width)
    if W_o is not None:
        _check_bias_vector(b_o, "b_o", W_o.shape[1])

    trace = resolve(trace)
    record = _projection_recorder(trace, x.ndim - 2)
    record("embeddings", x, ("token", "model"))
    for name, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v)):
        record(name, w, ("model", "feature"), batched=False)

    q = _project(xp, x, W_q, b_q, "Q = x·W_q")  # (..., Lq, H·D)
    k = _project(xp, source, W_k, b_k, "K = x·W_k")  # (..., Lk, Hkv·D)
    v = _project(xp, source, W_v, b_v, "V = x·W_v")  # (..., Lk, Hkv·Dv)
    q = split_heads(xp, q, heads)  # (..., H, Lq, D)
    k = split_heads(xp, k, kv_heads)  # (..., Hkv, Lk, D)
    v = split_heads(xp, v, kv_heads)  # (..., Hkv, Lk, Dv)
    _checks.check_same_dtype([("Q = x·W_q", q), ("K = context·W_k", k), ("V = context·W_v", v)])

    lead = (*_batch_axes(x.ndim - 2), "head")
    split = f", split into {heads} heads" if heads > 1 else ""
    src = "X" if context is None else "Y"
    kv_split = f", split into {kv_heads} heads" if kv_heads > 1 else ""
    formulas = {
        "Q": f"Q = X·W_q{split}",
        "K": f"K = {src}·W_k{kv_split}",
        "V": f"V = {src}·W_v{kv_split}",
    }
    call = make_call(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        score_mod=score_mod,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=scale,
        enable_gqa=kv_heads != heads,
        dropout_p=dropout_p,
        generator=generator,
        sinks=sinks,
        return_weights=return_weights,
        trace=trace,
        lead=lead,
        formulas=formulas,
        squeeze_heads=heads == 1 and kv_heads == 1,
    )
    context_vectors, weights = run_call(call, backend)
    out = merge_heads(xp, context_vectors)  # (..., Lq, H·Dv)
    if heads > 1 or W_o is not None:
        record("concat", out, ("query", "feature"))
    if W_o is not None:
        record("W_o", W_o, ("feature", "model"), batched=False)
        out = _project(xp, out, W_o, b_o, "output = concat·W_o")  # (..., Lq, Eo)
        record("output", out, ("query", "model"))
    if trace is not None:
        trace.meta["d_model"] = int(x.shape[-1])
    return (out, weights) if return_weights else out


def self_attention(
    x: Array,
    W_q: Array,
    W_k: Array,
    W_v: Array,
    *,
    mask: Array | Mask | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
    trace: Trace | None = None,
    backend: BackendName = "auto",
) -> Any:
    """Single-head self-attention: softmax(X·W_q·(X·W_k)ᵀ · scale)·X·W_v.

    Args:
        x: the token embeddings, (..., L, E).
        W_q, W_k: (E, D). W_v: (E, Dv).
        mask, bias, is_causal, scale, backend: as in
            :func:`qkv.scaled_dot_product_attention`, with scores of shape (..., L, L).
        return_weights: also return the attention weights (..., L, L).
        trace: record every step.

    Returns:
        The context vectors (..., L, Dv); with ``return_weights``, ``(context, weights)``.

    Example (seed 000, "I love statistics"):
        >>> import numpy as np
        >>> X = np.array([[0.2, 0.5, 0.7], [0.4, 0.8, 0.6], [0.1, 0.6, 0.9]])
        >>> W_q = np.array([[0.1, 0.3], [0.2, 0.4], [0.5, 0.6]])
        >>> W_k = np.array([[0.6, 0.2], [0.3, 0.5], [0.7, 0.9]])
        >>> W_v = np.array([[0.5, 0.8], [0.2, 0.3], [0.4, 0.6]])
        >>> context = self_attention(X, W_q, W_k, W_v)
        >>> context[1].round(4)                   # the context vector of "love"
        array([0.5385, 0.8193])
    """
    result = multi_head_attention(
        x,
        W_q,
        W_k,
        W_v,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        scale=scale,
        return_weights=return_weights,
        trace=trace,
        backend=backend,
    )
    if not return_weights:
        return result
    out, weights = result
    if weights.ndim >= 3:
        weights = weights[..., 0, :, :]  # one head: (..., L, L)
    return out, weights


def _project(xp: Any, x: Array, w: Array, b: Array | None, what: str) -> Array:
    """x·W (+ b). With NumPy, a product that overflows from finite inputs is a ValueError
    naming the step (PyTorch inputs are not checked: that would read every output twice)."""
    if is_torch_namespace(xp):
        out = xp.matmul(x, w)
        return out if b is None else out + b
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):
        out = xp.matmul(x, w)
        out = out if b is None else out + b
    if not bool(xp.all(xp.isfinite(out))):
        inputs = (x, w) if b is None else (x, w, b)
        if all(bool(xp.all(xp.isfinite(a))) for a in inputs):
            raise ValueError(
                f"{what} overflowed {out.dtype}: finite inputs (largest |entries| "
                f"{float(xp.max(xp.abs(x))):.3g} and {float(xp.max(xp.abs(w))):.3g}) give ±inf "
                "or NaN. Hint: rescale the embeddings or the weights so that the products stay "
                "well below the dtype's maximum; qkv refuses rather than return NaN."
            )
    return out


def _check_projections(
    x: Array,
    source: Array,
    W_q: Array,
    W_k: Array,
    W_v: Array,
    W_o: Array | None,
    heads: int,
    kv_heads: int,
    cross: bool,
) -> None:
    src = "context" if cross else "x"
    for name, a in (("x", x), (src, source)):
        _checks.check_floating(a, name)
        _checks.check_ndim(a, name, at_least=2, layout="(..., L, E): one row per token")
        if a.shape[-2] == 0:
            raise ValueError(
                f"{name} is an empty sequence (shape {shape_str(a.shape)}). "
                "Hint: attention needs at least one token."
            )
    if cross and source.shape[:-2] != x.shape[:-2]:
        raise ValueError(
            f"context must have the batch dimensions of x: x {shape_str(x.shape)}, context "
            f"{shape_str(source.shape)}."
        )
    for name, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o)):
        if w is None:
            continue
        _checks.check_floating(w, name)
        if w.ndim != 2:
            raise ValueError(
                f"{name} must be a matrix (2 dimensions), got shape {shape_str(w.shape)}."
            )
    for name, w, rows, of in (
        ("W_q", W_q, x.shape[-1], "x"),
        ("W_k", W_k, source.shape[-1], src),
        ("W_v", W_v, source.shape[-1], src),
    ):
        if w.shape[0] != rows:
            raise ValueError(
                f"{name} must have d_model = {rows} rows (one per column of {of}, shape "
                f"{shape_str((x if of == 'x' else source).shape)}); got {shape_str(w.shape)}. "
                "Hint: row-vector convention Q = X·W_q, so W_q is d_model × d_k; if your W is "
                "d_k × d_model (the column-vector form Q = W·x), pass its transpose."
            )
    if W_q.shape[1] % heads:
        raise ValueError(
            f"num_heads = {heads} must divide the columns of W_q ({W_q.shape[1]}): each head "
            f"takes d_k = columns / heads. Hint: valid head counts: "
            f"{_divisors(W_q.shape[1])}."
        )
    for name, w in (("W_k", W_k), ("W_v", W_v)):
        if w.shape[1] % kv_heads:
            raise ValueError(
                f"num_kv_heads = {kv_heads} must divide the columns of {name} ({w.shape[1]}). "
                f"Hint: valid counts: {_divisors(w.shape[1])}."
            )
    if heads % kv_heads:
        raise ValueError(
            f"grouped-query attention needs Hq divisible by Hkv: num_heads = {heads}, "
            f"num_kv_heads = {kv_heads}. Hint: each key/value head serves num_heads / "
            "num_kv_heads query heads."
        )
    d_q, d_k = W_q.shape[1] // heads, W_k.shape[1] // kv_heads
    if d_q != d_k:
        raise ValueError(
            f"the heads of W_q and W_k must have the same d_k: W_q {shape_str(W_q.shape)} in "
            f"{heads} heads gives d_k = {d_q}, W_k {shape_str(W_k.shape)} in {kv_heads} heads "
            f"gives {d_k}. Hint: W_k has num_kv_heads · d_k columns."
        )
    if d_q == 0:
        raise ValueError("d_k = 0: W_q has no columns. Hint: W_q is d_model × d_k with d_k ≥ 1.")
    if W_o is not None and W_o.shape[0] != heads * (W_v.shape[1] // kv_heads):
        d_v = W_v.shape[1] // kv_heads
        raise ValueError(
            f"W_o must have num_heads · d_v = {heads} · {d_v} = {heads * d_v} rows (one per "
            f"column of the concatenated heads); got {shape_str(W_o.shape)}."
        )


def _check_bias_vector(b: Array | None, name: str, width: int) -> None:
    if b is not None and tuple(b.shape) != (width,):
        raise ValueError(
            f"{name} must be a vector of {width} numbers (the projection's output width); got "
            f"shape {shape_str(b.shape)}."
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_axes(n: int) -> tuple[str, ...]:
    """Names of n leading batch axes: ("batch",), or ("extra0", ..., "batch")."""
    return (*(f"extra{i}" for i in range(n - 1)), "batch") if n else ()


def _projection_recorder(trace: Trace | None, batch_dims: int) -> Callable[..., None]:
    """Records the projection steps; batched values get the leading batch axes' names."""
    batch_axes = _batch_axes(batch_dims)

    def record(name: str, value: Array, axes: tuple[str, ...], *, batched: bool = True) -> None:
        if trace is None:
            return
        words = WORDS[name]
        names = (*(batch_axes if batched else ()), *axes)
        trace.record(name, value, formula=words.formula, description=words.description, axes=names)

    return record
