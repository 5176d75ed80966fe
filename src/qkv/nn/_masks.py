"""The mask a module hands to the core: the caller's mask, key padding, the cache's window.

Shape legend: B batch, H heads, Lq query length, Lk key length (cached keys included).
Every mask here is True = may attend; a float mask (torch's additive ``attn_mask``) is
a bias. Key padding and the cache's window are
:mod:`qkv.masks` rules, not arrays, so the tiled kernel still skips the blocks they leave
empty (and knows the full ones); causality stays a flag for the core. Only a caller's own
boolean tensor, and the extra key rows of ``torch.nn.MultiheadAttention``'s
``add_bias_kv``/``add_zero_attn`` (appended after the sequence, always attended), make the
mask a dense array.
"""

from __future__ import annotations

from collections.abc import Sequence

import array_api_compat.torch as xp_torch
import torch

from qkv.masks import Mask, key_padding, sliding_window

__all__ = ["MaskLike", "combine_masks"]

MaskLike = torch.Tensor | Mask


def combine_masks(
    mask: MaskLike | None,
    lengths: torch.Tensor | Sequence[int] | None,
    is_causal: bool,
    *,
    window: int | None,
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    extra: int,
    device: torch.device,
) -> tuple[MaskLike | None, torch.Tensor | None, bool]:
    """One mask for the core (True = attend), a bias, and whether the core applies causality.

    Args:
        mask: the caller's mask: (Lq, Lk) or (B, H or 1, Lq, Lk) booleans, or a Mask rule;
            or floats of those shapes, added to the scaled scores (torch's float
            ``attn_mask``), which become the bias.
        lengths: (B,) key padding lengths.
        is_causal: causal attention (left to the core, unless ``extra`` needs a dense mask).
        window: a KV cache's max_length W: query i sees only the last W keys up to it.
        batch, heads, lq, lk: B, H, Lq, Lk (Lk counts the cached keys, not ``extra``).
        extra: key rows appended after the Lk keys (torch's add_bias_kv / add_zero_attn),
            which every query attends (with a bias of 0).
        device: where to build the masks.

    Under ``torch.compile`` no value is read here: key padding becomes a boolean tensor
    (``qkv::key_padding_mask`` checks the lengths when the graph runs).
    """
    if mask is not None and not isinstance(mask, (Mask, torch.Tensor)):
        raise TypeError(
            f"mask must be a boolean tensor (True = may attend), a float tensor (added to "
            f"the scores) or a qkv.masks.Mask, got {type(mask).__name__}. Hint: convert "
            "torch.nn.MultiheadAttention masks with qkv.nn.masks_from_torch."
        )
    if isinstance(mask, torch.Tensor) and mask.ndim not in (2, 4):
        raise ValueError(
            f"mask must have shape (Lq, Lk) or (B, H, Lq, Lk) (H may be 1); got "
            f"{tuple(mask.shape)}. Hint: a (B, Lq, Lk) mask becomes mask[:, None]."
        )
    if isinstance(mask, torch.Tensor) and not (
        mask.dtype == torch.bool or mask.is_floating_point()
    ):
        raise TypeError(
            f"mask must be boolean (True = may attend) or floating point (added to the "
            f"scores), got {mask.dtype}. Hint: a 0/1 mask converts with mask.bool()."
        )
    bias = None
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        bias, mask = mask, None  # added to the scores: the core's bias
        if extra:  # the extra rows get a bias of 0
            bias = bias.expand(*bias.shape[:-2], lq, lk)
            bias = torch.cat((bias, bias.new_zeros((*bias.shape[:-1], extra))), dim=-1)
    compiled = torch.compiler.is_compiling()
    given = None if lengths is None else _lengths(lengths, batch, lk, device, values=not compiled)
    causal_flag = bool(is_causal)
    dense_needed = extra or (given is not None and (batch == 0 or compiled))
    if dense_needed or isinstance(mask, torch.Tensor):
        dense = _dense(mask, given, causal_flag, window, batch, heads, lq, lk, extra, device)
        return dense, bias, causal_flag and not extra  # with extra rows, causality is in the mask
    rules: list[Mask] = [] if mask is None else [mask]
    if given is not None:
        rules.append(key_padding(given.tolist()))
    if window is not None and lk > window:  # some key is too old for some query
        # query i (at key position i + Lk − Lq) sees keys from W − 1 before it on; the
        # window has no right edge of its own (causality, if asked, is the core's).
        rules.append(sliding_window(window - 1, lk, alignment="bottom-right"))
    allowed: Mask | None = None
    for rule in rules:
        allowed = rule if allowed is None else allowed & rule
    return allowed, bias, causal_flag


def _dense(
    mask: MaskLike | None,
    lengths: torch.Tensor | None,
    causal: bool,
    window: int | None,
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    extra: int,
    device: torch.device,
) -> MaskLike | None:
    """The mask as one boolean tensor: with the caller's own tensor, or extra key rows (then
    the causal rule over the real keys is part of it)."""
    parts: list[torch.Tensor] = []
    if lengths is not None and torch.compiler.is_compiling():
        parts.append(torch.ops.qkv.key_padding_mask(lengths, lk))  # (B, 1, 1, Lk)
    elif lengths is not None:
        parts.append(_padding(lengths, lk, device))  # (B, 1, 1, Lk)
    if window is not None and lk > window:
        parts.append(_window(lq, lk, window, device))  # (Lq, Lk)
    if isinstance(mask, Mask) and (parts or extra):
        mask = mask.dense(lq, lk, batch=batch, heads=heads, xp=xp_torch, device=device)
    if extra and causal:  # causal over the real keys only: a dense mask
        parts.append(_causal(lq, lk, device))
    rule = mask if isinstance(mask, Mask) else None
    if isinstance(mask, torch.Tensor):
        parts.insert(0, mask)
    allowed: torch.Tensor | None = None
    for part in parts:
        allowed = part if allowed is None else allowed & part
    if allowed is None:
        return rule
    if extra:  # the extra rows from torch are always attended
        allowed = allowed.expand(*allowed.shape[:-2], lq, lk)
        pad = allowed.new_ones((*allowed.shape[:-1], extra))
        allowed = torch.cat((allowed, pad), dim=-1)
    return allowed


def _lengths(
    lengths: torch.Tensor | Sequence[int],
    batch: int,
    lk: int,
    device: torch.device,
    *,
    values: bool = True,
) -> torch.Tensor:
    """The key padding lengths, checked: (B,) integers, and (``values``) between 0 and Lk."""
    given = torch.as_tensor(lengths, device=device)
    if given.shape != (batch,) or given.dtype.is_floating_point or given.dtype == torch.bool:
        raise ValueError(
            f"key_padding_lengths must be {batch} integers (one per batch element), got "
            f"{given.dtype} of shape {tuple(given.shape)}. Hint: "
            "key_padding_lengths=[5, 3] for two sequences of 5 and 3 tokens."
        )
    if values:
        _check_length_values(given, lk)
    return given


def _check_length_values(given: torch.Tensor, lk: int) -> None:
    if given.numel() and not bool(((given >= 0) & (given <= lk)).all()):
        raise ValueError(
            f"key_padding_lengths must be between 0 and the key length Lk = {lk}, got "
            f"{given.tolist()}. Hint: each length counts the real (not padding) keys of its "
            "sequence, cached keys included; a longer one points past the end."
        )


@torch.library.custom_op("qkv::key_padding_mask", mutates_args=())
def _key_padding_op(lengths: torch.Tensor, kv_len: int) -> torch.Tensor:
    """(B, 1, 1, Lk): True for the first lengths[b] keys of batch element b, the lengths
    checked first (what a compiled graph runs: the check reads their values)."""
    _check_length_values(lengths, kv_len)
    return _padding(lengths, kv_len, lengths.device)


@_key_padding_op.register_fake
def _key_padding_fake(lengths: torch.Tensor, kv_len: int) -> torch.Tensor:
    return lengths.new_empty((lengths.shape[0], 1, 1, kv_len), dtype=torch.bool)


def _padding(given: torch.Tensor, lk: int, device: torch.device) -> torch.Tensor:
    """(B, 1, 1, Lk): True for the first lengths[b] keys of batch element b."""
    keys = torch.arange(lk, device=device)
    return (keys < given[:, None])[:, None, None, :]


def _window(lq: int, lk: int, window: int, device: torch.device) -> torch.Tensor:
    """(Lq, Lk): query i (at key position i + Lk − Lq) sees keys within the last ``window``."""
    query_pos = torch.arange(lq, device=device)[:, None] + (lk - lq)
    return torch.arange(lk, device=device)[None, :] > query_pos - window


def _causal(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """(Lq, Lk), bottom-right: query i sees keys j ≤ i + Lk − Lq."""
    query_pos = torch.arange(lq, device=device)[:, None] + (lk - lq)
    return torch.arange(lk, device=device)[None, :] <= query_pos
