"""PyTorch's fused ``scaled_dot_product_attention`` with qkv's semantics.

The translation, case by case:

- no mask: nothing to pass;
- causal, top-left (or Lq = Lk): ``is_causal=True``, no mask array;
- causal, bottom-right with one query: every key is visible, no mask at all;
- any other mask: a dense boolean (B or 1, H or 1, Lq, Lk) array built from the qkv mask;
- a bias: folded into a float mask, −inf where the boolean mask forbids;
- GQA: ``enable_gqa=True``.

Dropout is not translated: torch draws its own random numbers, which would not follow qkv's
``generator`` (see :func:`qkv.masks.dropout_keep`); the dispatcher refuses it. A query with
no allowed key gets zeros from torch ≥ 2.5, as qkv's policy says; a NaN or ±inf in a
masked-out key or value, however, reaches every output of torch's kernels, so the caller
checks the output (see :func:`qkv.scaled_dot_product_attention`). A row whose scores are all
NaN (a NaN in its query) gets zeros from torch's fused kernels; qkv gives it NaN, as the
reference does.

torch's function is bound once, at import (:data:`TORCH_SDPA`), so that replacing
``torch.nn.functional.scaled_dot_product_attention`` by a function that calls qkv works.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.torch as torch_xp
import numpy as np
import torch

from qkv.masks import Mask, with_causal

__all__ = ["TORCH_SDPA", "dense_mask_elements", "sdpa_attention"]

TORCH_SDPA: Any = getattr(
    torch._C._nn, "scaled_dot_product_attention", torch.nn.functional.scaled_dot_product_attention
)
"""torch's own fused function, bound once at import: code that replaces
``torch.nn.functional.scaled_dot_product_attention`` with a function calling qkv (as
libraries and exporters do) must not send qkv's sdpa backend back into itself."""


def _causal_kind(is_causal: bool, alignment: str, q_len: int, kv_len: int) -> str:
    """How torch can express the causal rule: "none" (not needed), "top-left" (its
    ``is_causal``) or "rule" (only as part of a dense mask)."""
    if not is_causal:
        return "none"
    if alignment == "top-left" or q_len == kv_len:
        return "top-left"
    return "none" if q_len == 1 else "rule"  # bottom-right: one query sees every key


def dense_mask_elements(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    *,
    mask: Mask | torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
) -> int:
    """How many elements the mask array given to torch would hold (0: none needed).

    A Mask rule is counted as one (Lq, Lk) matrix (rules that depend on the batch element
    or head make it larger); an array the caller gave is already in memory and counts 0,
    unless a bias must be folded in.
    """
    q_len, kv_len = q_shape[-2], k_shape[-2]
    kind = _causal_kind(is_causal, causal_alignment, q_len, kv_len)
    dense = None if isinstance(mask, Mask) else mask
    needs_rule = (
        isinstance(mask, Mask)
        or kind == "rule"
        or (kind == "top-left" and (dense is not None or bias is not None))
    )
    shapes = [tuple(dense.shape)] if dense is not None else []
    if bias is not None:
        shapes.append(tuple(bias.shape))
    elif not needs_rule:
        return 0  # nothing, or the caller's own array as it is
    if needs_rule:
        shapes.append((q_len, kv_len))
    return math.prod(np.broadcast_shapes(*shapes))


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top-left",
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(Q·Kᵀ·scale + bias, masked)·V by ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        query: (B, H, Lq, D). key: (B, Hkv, Lk, D). value: (B, Hkv, Lk, Dv); Hkv divides H.
        mask: a :class:`qkv.masks.Mask`, or booleans (True = may attend) of 4 dimensions
            broadcastable to (B, H, Lq, Lk).
        bias: 4 dimensions, broadcastable to (B, H, Lq, Lk).
        is_causal, causal_alignment, scale: as in :func:`qkv.scaled_dot_product_attention`.

    Returns:
        The context, (B, H, Lq, Dv).

    Example:
        >>> import torch
        >>> q = k = v = torch.eye(2).reshape(1, 1, 2, 2)
        >>> sdpa_attention(q, k, v, is_causal=True)[0, 0]
        tensor([[1.0000, 0.0000],
                [0.3302, 0.6698]])
    """
    attn_mask, use_is_causal = _torch_mask(
        query, key, mask=mask, bias=bias, is_causal=is_causal, alignment=causal_alignment
    )
    enable_gqa = query.shape[1] != key.shape[1]
    out: torch.Tensor = TORCH_SDPA(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=use_is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out if attn_mask is not None else _nan_rows(out, query, key)


def _nan_rows(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NaN where a query row, or every key of its head, holds a NaN (no mask array given).

    Such a row's scores are all NaN; torch's fused kernels treat it as a row with no allowed
    key and return zeros, where the reference (and qkv's policy: NaN in a live input comes
    out NaN) gives NaN. Elementwise, with no host synchronisation. With a mask array the
    caller checks instead (:func:`qkv.scaled_dot_product_attention` redoes such a call with
    the tiled kernel), as a fully masked row must stay zero.
    """
    # A row's sum is NaN when the row holds a NaN (or both +inf and −inf, whose scores are NaN
    # as well): one read of query and key, and small (B, H, Lq) results.
    bad = torch.isnan(query.sum(dim=-1, keepdim=True))  # (B, H, Lq, 1)
    dead = torch.isnan(key.sum(dim=-1)).all(dim=-1)  # (B, Hkv): every key has a NaN
    dead = dead.repeat_interleave(query.shape[1] // max(key.shape[1], 1), dim=1)
    bad = bad | dead[:, :, None, None]
    return out.masked_fill(bad, math.nan)


def _torch_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    alignment: str,
) -> tuple[torch.Tensor | None, bool]:
    """The ``attn_mask`` and ``is_causal`` that give torch's SDPA qkv's meaning."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    rule = mask if isinstance(mask, Mask) else None
    dense = None if isinstance(mask, Mask) else mask
    kind = _causal_kind(is_causal, alignment, q_len, kv_len)
    use_is_causal = kind == "top-left" and rule is None and dense is None and bias is None
    rule = with_causal(
        rule, kind == "rule" or (kind == "top-left" and not use_is_causal), alignment
    )
    allowed = None
    if rule is not None:
        allowed = _evaluate(rule, query, key)
    if dense is not None:
        allowed = dense if allowed is None else allowed & dense
    if bias is None:
        return allowed, use_is_causal
    additive = bias.to(query.dtype)
    if allowed is not None:
        additive = additive.masked_fill(allowed.logical_not(), float("-inf"))
    return additive, False


def _evaluate(rule: Mask, query: torch.Tensor, key: torch.Tensor) -> Any:
    """The rule on (B, H, Lq, Lk) index arrays; the result keeps the rule's own broadcast."""
    device = query.device
    batch, heads, q_len, kv_len = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return rule(b, h, q, kv, q_len, kv_len, torch_xp)
