"""The mask a module hands to the core: the caller's mask, key padding, the cache's window.

Shape legend: B batch, H heads, Lq query length, Lk key length (cached keys included).
Every mask here is boolean, True = may attend.
"""

from __future__ import annotations

from collections.abc import Sequence

import array_api_compat.torch as xp_torch
import torch

from qkv.masks import Mask

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
) -> tuple[MaskLike | None, bool]:
    """One mask for the core (True = attend), and whether the core applies causality.

    Args:
        mask: the caller's mask: (Lq, Lk) or (B, H or 1, Lq, Lk) booleans, or a Mask rule.
        lengths: (B,) key padding lengths.
        is_causal: causal attention (left to the core, unless ``extra`` needs a dense mask).
        window: a KV cache's max_length W: query i sees only the last W keys up to it.
        batch, heads, lq, lk: B, H, Lq, Lk (Lk counts the cached keys, not ``extra``).
        extra: key rows appended after the Lk keys (torch's add_bias_kv / add_zero_attn),
            which every query attends.
        device: where to build the masks.
    """
    if mask is not None and not isinstance(mask, Mask | torch.Tensor):
        raise TypeError(
            f"mask must be a boolean tensor (True = may attend) or a qkv.masks.Mask, got "
            f"{type(mask).__name__}. Hint: convert torch.nn.MultiheadAttention masks "
            "with qkv.nn.masks_from_torch."
        )
    if isinstance(mask, torch.Tensor) and mask.ndim not in (2, 4):
        raise ValueError(
            f"mask must have shape (Lq, Lk) or (B, H, Lq, Lk) (H may be 1); got "
            f"{tuple(mask.shape)}. Hint: a (B, Lq, Lk) mask becomes mask[:, None]."
        )
    parts: list[torch.Tensor] = []
    if lengths is not None:
        parts.append(_padding(lengths, batch, lk, device))  # (B, 1, 1, Lk)
    if window is not None and lk > window:  # some key is too old for some query
        parts.append(_window(lq, lk, window, device))  # (Lq, Lk)
    causal_flag = bool(is_causal)
    if isinstance(mask, Mask) and (parts or extra):
        mask = mask.dense(lq, lk, batch=batch, heads=heads, xp=xp_torch, device=device)
    if extra and causal_flag:  # causal over the real keys only: a dense mask
        parts.append(_causal(lq, lk, device))
        causal_flag = False
    if isinstance(mask, torch.Tensor):
        parts.insert(0, mask)
    allowed: MaskLike | None = mask if isinstance(mask, Mask) else None
    for part in parts:
        allowed = part if allowed is None else allowed & part  # type: ignore[operator]
    if extra and allowed is not None:  # the extra rows from torch are always attended
        assert isinstance(allowed, torch.Tensor)
        allowed = allowed.expand(*allowed.shape[:-2], lq, lk)
        pad = allowed.new_ones((*allowed.shape[:-1], extra))
        allowed = torch.cat((allowed, pad), dim=-1)
    return allowed, causal_flag


def _padding(
    lengths: torch.Tensor | Sequence[int], batch: int, lk: int, device: torch.device
) -> torch.Tensor:
    """(B, 1, 1, Lk): True for the first lengths[b] keys of batch element b."""
    given = torch.as_tensor(lengths, device=device)
    if given.shape != (batch,) or given.dtype.is_floating_point or given.dtype == torch.bool:
        raise ValueError(
            f"key_padding_lengths must be {batch} integers (one per batch element), got "
            f"{given.dtype} of shape {tuple(given.shape)}. Hint: "
            "key_padding_lengths=[5, 3] for two sequences of 5 and 3 tokens."
        )
    if batch and not bool(((given >= 0) & (given <= lk)).all()):
        raise ValueError(
            f"key_padding_lengths must be between 0 and the key length Lk = {lk}, got "
            f"{given.tolist()}. Hint: each length counts the real (not padding) keys of its "
            "sequence, cached keys included; a longer one points past the end."
        )
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
