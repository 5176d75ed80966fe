"""Input checks for the attention functions: fail early, name the argument, give a hint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qkv._array import (
    FLOAT_DTYPES,
    Array,
    DtypeMismatchError,
    Inputs,
    as_array,
    check_scale,
    dtype_name,
    is_bool,
    is_floating,
    library,
    same_place,
    shape_str,
)
from qkv.masks import Mask, check_alignment


def check_floating(x: Array, name: str) -> None:
    _floating(dtype_name(x), name)


def _floating(dtype: str, name: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating-point dtype, got {dtype}. "
            f"Hint: convert it, e.g. {name}.astype(float) or {name}.float()."
        )


def check_ndim(x: Array, name: str, *, at_least: int, layout: str) -> None:
    _ndim(tuple(x.shape), name, at_least=at_least, layout=layout)


def _ndim(shape: Sequence[int], name: str, *, at_least: int, layout: str) -> None:
    if len(shape) < at_least:
        raise ValueError(
            f"{name} must have at least {at_least} dimensions {layout}; got shape "
            f"{shape_str(shape)}. Hint: a single vector v is v[None, :] (one row)."
        )


def check_same_dtype(arrays: Sequence[tuple[str, Array]]) -> None:
    _same_dtype([(name, dtype_name(a)) for name, a in arrays])


def _same_dtype(dtypes: Sequence[tuple[str, str]]) -> None:
    first_name, first = dtypes[0]
    for name, dtype in dtypes[1:]:
        if dtype != first:
            raise DtypeMismatchError(
                f"{first_name} is {first} but {name} is {dtype}: query, key and value must "
                "share one dtype. Hint: cast them to one dtype first."
            )


def check_qkv(found: Inputs, *, enable_gqa: bool) -> None:
    """Shapes and dtypes of query (..., Hq, Lq, D), key (..., Hkv, Lk, D), value
    (..., Hkv, Lk, Dv), from the one look at them (:func:`qkv._array.inputs`)."""
    named = (("query", found.query), ("key", found.key), ("value", found.value))
    shapes = [tuple(x.shape) for _, x in named]
    for (name, _), shape, dtype in zip(named, shapes, found.dtypes, strict=True):
        _floating(dtype, name)
        _ndim(shape, name, at_least=2, layout="(..., L, D)")
    _same_dtype([(name, dtype) for (name, _), dtype in zip(named, found.dtypes, strict=True)])
    check_shapes(*shapes, enable_gqa=enable_gqa)


def check_shapes(
    query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...], *, enable_gqa: bool
) -> None:
    """The shapes of query, key and value fit one another."""
    for name, shape in (("key", key), ("value", value)):
        if len(shape) != len(query):
            raise ValueError(
                f"{name} must have as many dimensions as query ({len(query)}); got {name} "
                f"{shape_str(shape)} and query {shape_str(query)}. "
                "Hint: the layout is (B, H, L, D) for all three, or (L, D) for one head."
            )
    if query[-1] != key[-1]:
        raise ValueError(
            f"query and key must have the same last dimension d_k: query "
            f"{shape_str(query)} has d_k = {query[-1]}, key {shape_str(key)} "
            f"has {key[-1]}. Hint: each score is a dot product q·k of equal-length vectors."
        )
    if query[-1] == 0:
        raise ValueError(
            f"d_k = 0: query {shape_str(query)} has no features, so there is nothing to "
            "compare. Hint: the last dimension of query and key is d_k and must be ≥ 1."
        )
    if key[-2] != value[-2]:
        raise ValueError(
            f"key and value must have the same length Lk (one value per key): key "
            f"{shape_str(key)} has Lk = {key[-2]}, value {shape_str(value)} "
            f"has {value[-2]}."
        )
    for name, shape, what in (("query", query, "Lq"), ("key", key, "Lk")):
        if shape[-2] == 0:
            raise ValueError(
                f"{name} is an empty sequence ({what} = 0, shape {shape_str(shape)}). "
                "Hint: attention needs at least one query and one key (torch returns an "
                "empty or zero result here; qkv takes an empty sequence for a mistake upstream, "
                "such as an empty tokenization)."
            )
    if key[:-2] != value[:-2]:
        raise ValueError(
            f"key and value must share their batch and head dimensions: key "
            f"{shape_str(key)}, value {shape_str(value)}."
        )
    if len(query) >= 4 or (len(query) == 3 and enable_gqa):
        check_heads(query, key, enable_gqa=enable_gqa)
    elif query[:-2] != key[:-2]:
        raise ValueError(
            f"query and key must have the same batch dimensions: query "
            f"{shape_str(query)}, key {shape_str(key)}. Hint: for 3-D inputs the "
            "first axis is the batch; for heads use (B, H, L, D), or enable_gqa=True."
        )


def check_heads(q_shape: Sequence[int], k_shape: Sequence[int], *, enable_gqa: bool) -> None:
    hq, hkv = q_shape[-3], k_shape[-3]
    if q_shape[:-3] != k_shape[:-3]:
        raise ValueError(
            f"query and key must have the same batch dimensions: query {shape_str(q_shape)}, "
            f"key {shape_str(k_shape)}. Hint: the layout is (B, H, L, D)."
        )
    if hq == hkv:
        return
    if not enable_gqa:
        raise ValueError(
            f"query has {hq} heads but key and value have {hkv} (shapes {shape_str(q_shape)} "
            f"and {shape_str(k_shape)}). Hint: for grouped-query attention (GQA/MQA) try "
            "setting enable_gqa=True."
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"grouped-query attention needs Hq divisible by Hkv: query has Hq = {hq} heads, "
            f"key and value Hkv = {hkv}. Hint: each key/value head serves Hq / Hkv query heads, "
            "so Hkv must divide Hq."
        )


def check_broadcast(x: Array, name: str, target: Sequence[int], legend: str, hint: str) -> None:
    """x must broadcast to ``target`` (the scores' shape)."""
    shape = tuple(x.shape)
    fits = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if not fits:
        raise ValueError(
            f"{name} must broadcast to the scores' shape {legend} = {shape_str(target)}; got "
            f"{shape_str(shape)}. Hint: {hint}"
        )


def check_mask(
    mask: Array | Mask | None, kind: str, device: Any, scores_shape: Sequence[int]
) -> None:
    """``mask``: None, a Mask rule, or booleans of the query's library ``kind`` and
    ``device`` that broadcast to ``scores_shape``."""
    if mask is None or isinstance(mask, Mask):
        return
    if library(mask) == "other":
        raise TypeError(
            f"mask must be a boolean array or a qkv.masks.Mask, got {type(mask).__name__}. "
            "Hint: build one with qkv.masks.causal(), key_padding(lengths), ..."
        )
    same_place("query", kind, device, "mask", mask)
    if not is_bool(mask):
        raise TypeError(
            f"mask must be boolean (True = may attend), got {dtype_name(mask)}. Hint: an "
            "additive 0/−inf mask goes in bias=..., or convert it with "
            "qkv.masks.from_additive(m); a 0/1 mask converts with m.astype(bool)."
        )
    check_broadcast(
        mask,
        "mask",
        scores_shape,
        _legend(len(scores_shape)),
        "True = may attend; one mask for all heads has shape (B, 1, Lq, Lk) or (Lq, Lk).",
    )


def check_bias(bias: Array | None, kind: str, device: Any, scores_shape: Sequence[int]) -> None:
    """``bias``: None, or floats of the query's library ``kind`` and ``device`` that
    broadcast to ``scores_shape``."""
    if bias is None:
        return
    same_place("query", kind, device, "bias", bias)
    check_floating(bias, "bias")
    check_broadcast(
        bias,
        "bias",
        scores_shape,
        _legend(len(scores_shape)),
        "bias is added to the scaled scores, e.g. an ALiBi bias of shape (H, Lq, Lk).",
    )


def check_sinks(sinks: Any, kind: str, device: Any, heads: int) -> Array:
    """``sinks``: per-head sink logits of shape (H,), floating, of the query's library
    ``kind`` and ``device``; returned as an array. Their values are checked by
    :func:`check_sink_values`."""
    sinks = as_array(sinks, "sinks")
    same_place("query", kind, device, "sinks", sinks)
    if not is_floating(sinks):
        raise TypeError(
            f"sinks must have a floating-point dtype, got {dtype_name(sinks)}. Hint: one "
            "logit per head, e.g. torch.zeros(H) or an nn.Parameter of shape (H,)."
        )
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape ({heads},), one logit per query head; got "
            f"{shape_str(sinks.shape)}. Hint: under grouped-query attention each query head "
            "has its own sink; a layout without a head axis has one."
        )
    return sinks


def check_sink_values(xp: Any, sinks: Array) -> None:
    """The sink logits are finite or −inf. Reads the values (a host synchronisation on a
    GPU); under ``torch.compile`` the tiled kernel's operator checks them when it runs."""
    values = sinks.detach() if hasattr(sinks, "detach") else sinks
    if bool(xp.any(xp.isnan(values) | (xp.isinf(values) & (values > 0)))):
        raise ValueError(
            "sinks must be finite or −inf (no sink), got NaN or +inf in "
            f"{shape_str(sinks.shape)} sinks. Hint: a sink of +inf would take every row's "
            "whole attention; check the parameter for a diverged update."
        )


def _legend(ndim: int) -> str:
    letters = ("B", "H", "Lq", "Lk")
    if ndim <= 4:
        return "(" + ", ".join(letters[4 - ndim :]) + ")"
    return "(..., B, H, Lq, Lk)"


def check_options(scale: Any, dropout_p: Any, causal_alignment: Any) -> None:
    check_scale(scale)
    if (
        isinstance(dropout_p, bool)
        or not isinstance(dropout_p, (int, float))
        or not 0.0 <= dropout_p < 1.0
    ):
        raise ValueError(
            f"dropout_p must be a probability in [0, 1), got {dropout_p!r}. "
            "Hint: dropout_p=0.1 drops one weight in ten while training."
        )
    check_alignment(causal_alignment)


def check_positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}. Hint: {hint}")
    return value
