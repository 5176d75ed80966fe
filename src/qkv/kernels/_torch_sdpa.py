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

import functools
import math
from typing import Any

import array_api_compat.torch as torch_xp
import numpy as np
import torch

from qkv.masks import Mask, with_causal

__all__ = [
    "BOTTOM_RIGHT",
    "TORCH_SDPA",
    "as_causal_flag",
    "causal_kind",
    "cpu_forward_only",
    "dense_mask_elements",
    "evaluate_rule",
    "flash_applies",
    "flash_causal_flag",
    "flash_forward",
    "rows_alive",
    "sdpa_attention",
    "sdpa_forward",
    "sdpa_trusted",
]

TORCH_SDPA: Any = getattr(
    torch._C._nn, "scaled_dot_product_attention", torch.nn.functional.scaled_dot_product_attention
)
"""torch's own fused function, bound once at import: code that replaces
``torch.nn.functional.scaled_dot_product_attention`` with a function calling qkv (as
libraries and exporters do) must not send qkv's sdpa backend back into itself."""


def causal_kind(is_causal: bool, alignment: str, q_len: int, kv_len: int) -> str:
    """How torch can express the causal rule: "none" (not needed), "top-left" (its
    ``is_causal``) or "rule" (only as part of a dense mask)."""
    if not is_causal:
        return "none"
    if alignment == "top-left" or q_len == kv_len:
        return "top-left"
    return "none" if q_len == 1 else "rule"  # bottom-right: one query sees every key


def as_causal_flag(
    mask: Mask | torch.Tensor | None, is_causal: bool, alignment: str
) -> tuple[Mask | torch.Tensor | None, bool, str]:
    """(mask, is_causal, alignment) with a mask that is exactly ``causal(a)`` given as
    ``is_causal=True`` with alignment ``a`` (torch then runs its own causal kernel, with no
    mask array); the same rule twice is one. Other masks come back as they are.

    Example:
        >>> from qkv import masks
        >>> as_causal_flag(masks.causal("bottom-right"), False, "top-left")
        (None, True, 'bottom-right')
    """
    alignment_of = getattr(mask, "causal_alignment", None)
    if alignment_of is None or (is_causal and alignment != alignment_of):
        return mask, is_causal, alignment
    return None, True, alignment_of


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
    mask, is_causal, causal_alignment = as_causal_flag(mask, is_causal, causal_alignment)
    kind = causal_kind(is_causal, causal_alignment, q_len, kv_len)
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
    nan_rows: bool = True,
) -> torch.Tensor:
    """softmax(Q·Kᵀ·scale + bias, masked)·V by ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        query: (B, H, Lq, D). key: (B, Hkv, Lk, D). value: (B, Hkv, Lk, Dv); Hkv divides H.
        mask: a :class:`qkv.masks.Mask`, or booleans (True = may attend) of 4 dimensions
            broadcastable to (B, H, Lq, Lk).
        bias: 4 dimensions, broadcastable to (B, H, Lq, Lk).
        is_causal, causal_alignment, scale: as in :func:`qkv.scaled_dot_product_attention`.
        nan_rows: set the rows whose query (or every key) holds a NaN to NaN when no mask
            array goes to torch (torch gives them zeros). False for a caller that checks
            the output with :func:`sdpa_trusted`, which redoes any call with such a NaN.

    Returns:
        The context, (B, H, Lq, Dv).

    Example:
        >>> import torch
        >>> q = k = v = torch.eye(2).reshape(1, 1, 2, 2)
        >>> sdpa_attention(q, k, v, is_causal=True)[0, 0]
        tensor([[1.0000, 0.0000],
                [0.3302, 0.6698]])
    """
    out, _ = sdpa_forward(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=scale,
        nan_rows=nan_rows,
    )
    return out


def sdpa_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top-left",
    scale: float | None = None,
    nan_rows: bool = True,
) -> tuple[torch.Tensor, bool]:
    """:func:`sdpa_attention` (same arguments), and whether its output is known to be qkv's
    result already: then the caller's look for a NaN or ±inf (:func:`sdpa_trusted`) has
    nothing to find. That is so where torch's CPU flash kernel ran and its log-sum-exp
    vouches for the inputs (:func:`flash_forward`), and where ``nan_rows`` fixed the output.

    Example:
        >>> q = k = v = torch.ones(1, 1, 16, 4)
        >>> out, clean = sdpa_forward(q, k, v, is_causal=True)
        >>> clean, out[0, 0, 0].tolist()
        (True, [1.0, 1.0, 1.0, 1.0])
    """
    attn_mask, use_is_causal = _torch_mask(
        query, key, mask=mask, bias=bias, is_causal=is_causal, alignment=causal_alignment
    )
    enable_gqa = query.shape[1] != key.shape[1]
    found = None
    if attn_mask is None and flash_applies(query, key, value, is_causal=use_is_causal):
        found = flash_forward(query, key, value, is_causal=use_is_causal, scale=scale)
        if found is not None and found[1]:
            return found
    if found is not None:
        out = found[0]  # torch's very output: a NaN or ±inf reached it, the checks decide
    else:
        out = TORCH_SDPA(
            query,
            key,
            value,
            attn_mask=attn_mask,
            is_causal=use_is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if nan_rows and attn_mask is None:
        return _nan_rows(out, query, key), True
    return out, False


FLASH_LSE_KEYS = 16
"""From this many keys on, torch's CPU flash kernel gives a row whose scores are all NaN a
NaN log-sum-exp. With fewer (under one vector of float32), it gives such a row zeros and a
log-sum-exp of 0 (measured on torch 2.13, float32, float64 and bfloat16; a test checks it)."""

_FLASH = 1
"""``torch._fused_sdp_choice``'s number for the flash kernel (``SDPBackend.FLASH_ATTENTION``)."""


def flash_applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool
) -> bool:
    """Whether :func:`flash_forward` may vouch for a call with no mask array (torch's
    ``is_causal`` flag given): CPU, (B, H, L, D) with as many key as query heads, at least
    :data:`FLASH_LSE_KEYS` keys, a last query row that sees every key (no causal rule, or
    Lq ≥ Lk), and no gradient to record. It depends on shapes, devices and flags alone."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    wants_grad = query.requires_grad or key.requires_grad or value.requires_grad
    return (
        query.device.type == "cpu"
        and query.ndim == 4
        and query.shape[1] == key.shape[1]
        and kv_len >= FLASH_LSE_KEYS
        and not (is_causal and q_len < kv_len)
        and not (wants_grad and torch.is_grad_enabled())
        and _has_flash_lse()
    )


BOTTOM_RIGHT = "bottom-right"
""":func:`flash_causal_flag`'s answer for a causal call whose Lq < Lk queries are the last
of the keys: torch's flash kernel runs it in two parts (:func:`flash_forward`)."""


def flash_causal_flag(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool, alignment: str
) -> bool | str | None:
    """For a call with no mask and no bias: the ``is_causal`` torch's CPU flash kernel runs
    it with, where :func:`flash_applies` (and so for every call of its shapes, dtypes and
    flags); :data:`BOTTOM_RIGHT` for bottom-right causal queries after keys that all of
    them see, both parts of float32 or float64 and of at least :data:`FLASH_LSE_KEYS` keys;
    else None."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    kind = causal_kind(is_causal, alignment, q_len, kv_len)
    if kind == "rule":
        exact = query.dtype in (torch.float32, torch.float64) and q_len < kv_len
        seen = min(q_len, kv_len - q_len) >= FLASH_LSE_KEYS
        both = exact and seen and flash_applies(query, key[..., :q_len, :], value, is_causal=True)
        return BOTTOM_RIGHT if both else None
    flag = kind == "top-left"
    return flag if flash_applies(query, key, value, is_causal=flag) else None


def flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool | str,
    scale: float | None,
) -> tuple[torch.Tensor, bool] | None:
    """torch's CPU flash kernel with its log-sum-exp on a call where :func:`flash_applies`
    (``is_causal`` :data:`BOTTOM_RIGHT`: where :func:`flash_causal_flag` said so),
    when ``scaled_dot_product_attention`` would run that very kernel (outside
    torch.compile, its backend choice): (its output, bit for bit SDPA's, and whether it is
    clean); else None.

    Clean means no NaN or ±inf of the inputs reached the output, proven by one look at
    (B, H, Lq + Dv) numbers instead of the (B, H, Lq, Dv) output:

    - every row's log-sum-exp is finite, so no NaN or ±inf entered any row's scores (with
      at least :data:`FLASH_LSE_KEYS` keys, a row of NaN scores has a NaN log-sum-exp);
    - the last row of the output is finite. That row weighs every key, and the kernel
      multiplies each weight, 0 included, by its value: a NaN or ±inf in any value would
      make it NaN or ±inf. Its log-sum-exp, finite, also vouches for every key.

    So the inputs are finite where torch reads them, and torch's kernel computes qkv's
    function. A finite input whose scores overflow fails the look and goes to the full
    check, as does anything else this cannot vouch for.
    """
    if is_causal == BOTTOM_RIGHT:
        return _flash_bottom_right(query, key, value, scale)
    found = _flash_with_lse(query, key, value, bool(is_causal), scale)
    if found is None:
        return None
    out, lse = found
    return out, math.isfinite(float(lse.sum() + out[..., -1, :].sum()))


def _flash_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch's CPU flash kernel's (output, log-sum-exp), when SDPA would run that kernel."""
    if (
        torch.compiler.is_compiling()
        or torch._fused_sdp_choice(query, key, value, None, 0.0, is_causal, scale=scale) != _FLASH
    ):
        return None
    out, lse = torch._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )
    return out, lse


def _flash_bottom_right(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, bool] | None:
    """Bottom-right causal attention of Lq queries over Lk > Lq keys on torch's CPU flash
    kernel, in two parts merged by their log-sum-exps: the first Lk − Lq keys, which every
    query sees (no rule), and the last Lq (causal, top-left). Each part vouches for its keys
    as :func:`flash_forward` does (its last row sees all of them). Where torch would not run
    its flash kernel on a part, None."""
    split = int(key.shape[-2]) - int(query.shape[-2])
    seen = _flash_with_lse(query, key[..., :split, :], value[..., :split, :], False, scale)
    own = _flash_with_lse(query, key[..., split:, :], value[..., split:, :], True, scale)
    if seen is None or own is None:
        return None
    (first, lse_first), (last, lse_last) = seen, own
    top = torch.maximum(lse_first, lse_last)  # (B, H, Lq)
    w_first, w_last = (lse_first - top).exp(), (lse_last - top).exp()
    total = (w_first + w_last).unsqueeze(-1)
    out = (first * w_first.unsqueeze(-1) + last * w_last.unsqueeze(-1)) / total
    look = lse_first.sum() + lse_last.sum() + first[..., -1, :].sum() + last[..., -1, :].sum()
    return out.to(query.dtype), math.isfinite(float(look))


@functools.cache
def _has_flash_lse() -> bool:
    """Whether this torch has the CPU flash kernel's own entry and its backend choice."""
    return hasattr(torch, "_fused_sdp_choice") and hasattr(
        torch, "_scaled_dot_product_flash_attention_for_cpu"
    )


def sdpa_trusted(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    grad: bool,
    value: torch.Tensor | None = None,
) -> bool:
    """Whether torch's output ``out`` of a call with a mask or a bias is qkv's result. It is
    not when a NaN or ±inf of a masked-out key may have reached it (torch lets it through to
    every output, and gives zeros to a row whose scores are all NaN), nor when a bias beyond
    ±65536 comes with a gradient (``grad``: torch's backward is wrong on rows whose keys are
    all blocked). Then the tiled kernel redoes the call. A ``value`` is checked too (for an
    output computed from inputs whose NaN and ±inf were replaced by 0).

    On CPU, when no gradient follows (``grad`` False, ``out`` not recorded by autograd, no
    ``value``), one look at ``out`` settles the usual call (:func:`rows_alive`). Else, and
    when that look fails, one reduction per tensor and one host synchronisation: a sum is
    finite only when every entry is (a finite sum that overflows errs on the safe side).
    """
    from qkv.kernels._api import huge_bias

    if not grad and value is None and cpu_forward_only(out) and rows_alive(out):
        return True
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32  # no overflow
    with torch.no_grad():  # a look at the values, no part of any gradient
        total = out.sum(dtype=wide) + query.sum(dtype=wide) + key.sum(dtype=wide)
        if value is not None:
            total = total + value.sum(dtype=wide)
    if not math.isfinite(float(total)):  # NaN, ±inf or +inf − inf somewhere: not finite
        return False
    return not (grad and bias is not None and huge_bias(bias))


def cpu_forward_only(out: torch.Tensor) -> bool:
    """Whether ``out`` is a CPU tensor that no gradient follows, outside torch.compile."""
    return out.device.type == "cpu" and not out.requires_grad and not torch.compiler.is_compiling()


def rows_alive(out: torch.Tensor) -> bool:
    """Whether the sum of every row of torch's output is finite and not zero: then no NaN
    or ±inf of the inputs reached it and torch zeroed no row. One read of ``out``, just
    written, where checking the inputs reads query, key and value again.

    Why that suffices for a forward on CPU: torch's fused kernels (SDPA's, and compiled
    FlexAttention's) err on such inputs in two ways. A NaN or ±inf that enters a row's sum,
    from a live key or a masked-out one, makes the row NaN or ±inf. A row whose scores are
    all NaN (a NaN in its query, or in every key it sees) they take for a row with no
    allowed key, and give it zeros. A row whose sum is zero or overflows for a lawful reason
    (a fully masked row, zero values) fails the look too, and the caller's full check
    decides.
    """
    if out.numel() == 0:
        return True
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    low, high = out.sum(dim=-1, dtype=wide).abs().aminmax()
    return float(low) > 0.0 and float(high) < math.inf


def _nan_rows(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NaN where a query row, or every key of its head, holds a NaN (no mask array given).

    Such a row's scores are all NaN; torch's fused kernels treat it as a row with no allowed
    key and return zeros, where the reference (and qkv's policy: NaN in a live input comes
    out NaN) gives NaN. Elementwise, with no host synchronisation on CUDA. With a mask array the
    caller checks instead (:func:`qkv.scaled_dot_product_attention` redoes such a call with
    the tiled kernel), as a fully masked row must stay zero. On CPU (not under torch.compile)
    one look at the two sums first spares the usual call the rest.
    """
    # A row's sum is NaN when the row holds a NaN (or both +inf and −inf, whose scores are NaN
    # as well): one read of query and key, and small (B, H, Lq) results.
    # On CPU a look costs no waiting: two sums, and the usual call (no NaN) returns torch's
    # output as it is, without the copy masked_fill makes of it.
    cpu = query.device.type == "cpu" and not torch.compiler.is_compiling()
    if cpu and cpu_forward_only(out) and rows_alive(out):
        return out
    if cpu and not bool(torch.isnan(query.sum() + key.sum())):
        return out
    batch, heads, q_len = query.shape[:3]
    kv_heads = max(key.shape[1], 1)
    bad = torch.isnan(query.sum(dim=-1))  # (B, H, Lq)
    dead = torch.isnan(key.sum(dim=-1)).all(dim=-1)  # (B, Hkv): every key has a NaN
    # Query head h uses key/value head h // (H / Hkv): a view, no copy.
    grouped = bad.view(batch, kv_heads, heads // kv_heads, q_len) | dead[:, :, None, None]
    return out.masked_fill(grouped.view(batch, heads, q_len, 1), math.nan)


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
    mask, is_causal, alignment = as_causal_flag(mask, is_causal, alignment)
    rule = mask if isinstance(mask, Mask) else None
    dense = None if isinstance(mask, Mask) else mask
    kind = causal_kind(is_causal, alignment, q_len, kv_len)
    use_is_causal = kind == "top-left" and rule is None and dense is None and bias is None
    rule = with_causal(
        rule, kind == "rule" or (kind == "top-left" and not use_is_causal), alignment
    )
    allowed = None
    if rule is not None:
        allowed = evaluate_rule(rule, query, key)
    if dense is not None:
        allowed = dense if allowed is None else allowed & dense
    if bias is None:
        return allowed, use_is_causal
    additive = bias.to(query.dtype)
    if allowed is not None:
        additive = additive.masked_fill(allowed.logical_not(), float("-inf"))
    return additive, False


def evaluate_rule(rule: Mask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The rule on (B, H, Lq, Lk) index arrays, as booleans of 4 dimensions that keep the
    rule's own broadcast (key padding gives (B, 1, 1, Lk), a causal rule (1, 1, Lq, Lk)).

    Example:
        >>> from qkv import masks
        >>> q = torch.zeros(2, 4, 3, 8)
        >>> evaluate_rule(masks.causal(), q, q).shape
        torch.Size([1, 1, 3, 3])
    """
    device = query.device
    batch, heads, q_len, kv_len = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    allowed = torch.as_tensor(rule(b, h, q, kv, q_len, kv_len, torch_xp), device=device)
    allowed = allowed.to(torch.bool)
    return allowed.reshape((1,) * (4 - allowed.ndim) + tuple(allowed.shape))
