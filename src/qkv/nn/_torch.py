"""The drop-in path from ``torch.nn.MultiheadAttention``: weights and masks.

torch packs W_q, W_k, W_v as the rows of one ``in_proj_weight`` (3E, E) when the key and
value widths equal E, and keeps them apart otherwise; its masks are True = *ignore* (bool)
or additive (0 / −inf float). qkv's masks are True = *may attend*: they convert here with
:func:`qkv.masks.from_ignore` and :func:`qkv.masks.from_additive`.

Shape legend: B batch, H heads, Lq query length, Lk key length, E embed_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qkv.masks import from_additive, from_ignore

__all__ = ["TorchAttention", "masks_from_torch", "read_torch"]


@dataclass(frozen=True)
class TorchAttention:
    """What a ``torch.nn.MultiheadAttention`` holds, for ``MultiHeadAttention.from_torch``.

    Attributes:
        embed_dim, num_heads, kdim, vdim, dropout: its settings (E, H, Ek, Ev, p).
        weights: W_q, W_k, W_v, W_o as torch stores them, (out, in): (E, E), (E, Ek),
            (E, Ev), (E, E).
        biases: b_q, b_k, b_v, b_o, each (E,), or None without biases.
        bias_k, bias_v: the learned extra key/value rows (1, 1, E) of ``add_bias_kv``.
        add_zero_attn, training: as in torch.
        device, dtype: those of its weights.
    """

    embed_dim: int
    num_heads: int
    kdim: int
    vdim: int
    dropout: float
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    bias_k: torch.Tensor | None
    bias_v: torch.Tensor | None
    add_zero_attn: bool
    training: bool
    device: torch.device
    dtype: torch.dtype


def read_torch(module: nn.MultiheadAttention) -> TorchAttention:
    """The settings and weights of a ``torch.nn.MultiheadAttention`` (views, not copies)."""
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(
            f"from_torch expects a torch.nn.MultiheadAttention, got {type(module).__name__}. "
            "Hint: for a qkv module, copy it with copy.deepcopy instead."
        )
    if module._qkv_same_embed_dim:
        assert module.in_proj_weight is not None
        w_q, w_k, w_v = module.in_proj_weight.chunk(3, dim=0)  # (E, E) each, (out, in)
    else:
        assert module.q_proj_weight is not None
        assert module.k_proj_weight is not None and module.v_proj_weight is not None
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    biases = None
    if module.in_proj_bias is not None:
        b_q, b_k, b_v = module.in_proj_bias.chunk(3)
        assert module.out_proj.bias is not None
        biases = (b_q, b_k, b_v, module.out_proj.bias)
    reference = module.out_proj.weight
    return TorchAttention(
        embed_dim=module.embed_dim,
        num_heads=module.num_heads,
        kdim=module.kdim,
        vdim=module.vdim,
        dropout=float(module.dropout),
        weights=(w_q, w_k, w_v, module.out_proj.weight),
        biases=biases,
        bias_k=module.bias_k,
        bias_v=module.bias_v,
        add_zero_attn=bool(module.add_zero_attn),
        training=module.training,
        device=reference.device,
        dtype=reference.dtype,
    )


def masks_from_torch(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> torch.Tensor | None:
    """torch.nn.MultiheadAttention's masks as one qkv mask (True = may attend).

    Args:
        attn_mask: (Lq, Lk) or (B·H, Lq, Lk); boolean True = ignore, or additive float
            (0 = attend, −inf = ignore).
        key_padding_mask: (B, Lk); boolean True = ignore (padding), or additive float.
        num_heads: H, needed to unfold a 3-D ``attn_mask`` into (B, H, Lq, Lk).

    Returns:
        A boolean mask for ``qkv.nn.MultiHeadAttention(mask=...)``: (Lq, Lk),
        (B, 1, 1, Lk) or (B, H, Lq, Lk); None when neither mask is given.

    Raises:
        ValueError: a float mask with values other than 0 and −inf (an additive bias, which
            a boolean mask cannot hold), or shapes that do not fit.

    Example:
        >>> import torch
        >>> ignore = torch.tensor([[False, True], [False, False]])   # torch: True = ignore
        >>> masks_from_torch(ignore)
        tensor([[ True, False],
                [ True,  True]])
    """
    parts: list[torch.Tensor] = []
    if attn_mask is not None:
        allowed = _allowed(attn_mask, "attn_mask")
        if allowed.ndim == 3:
            if num_heads is None or allowed.shape[0] % num_heads:
                raise ValueError(
                    f"a 3-D attn_mask {tuple(allowed.shape)} is (B·H, Lq, Lk); give "
                    f"num_heads (H) that divides {allowed.shape[0]}, got {num_heads!r}. "
                    "Hint: masks_from_torch(attn_mask, num_heads=module.num_heads)."
                )
            allowed = allowed.view(-1, num_heads, *allowed.shape[1:])  # (B, H, Lq, Lk)
        elif allowed.ndim != 2:
            raise ValueError(
                f"attn_mask must be (Lq, Lk) or (B·H, Lq, Lk), got {tuple(allowed.shape)}."
            )
        parts.append(allowed)
    if key_padding_mask is not None:
        allowed = _allowed(key_padding_mask, "key_padding_mask")
        if allowed.ndim != 2:
            raise ValueError(
                f"key_padding_mask must be (B, Lk), got {tuple(allowed.shape)}. "
                "Hint: one row per batch element, True where a key is padding."
            )
        parts.append(allowed[:, None, None, :])  # (B, 1, 1, Lk)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] & parts[1]


def _allowed(mask: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}.")
    if mask.dtype == torch.bool:
        return from_ignore(mask)  # type: ignore[no-any-return]
    if not mask.is_floating_point():
        raise TypeError(
            f"{name} must be boolean (True = ignore) or float (0 / −inf), got {mask.dtype}. "
            f"Hint: {name}.bool()."
        )
    blocked = torch.isinf(mask) & (mask < 0)
    if bool(((mask != 0) & ~blocked).any()):
        raise ValueError(
            f"{name} holds values other than 0 and −inf: an additive bias, which a boolean "
            "mask cannot express. Hint: keep only the −inf entries as a mask "
            f"(qkv.masks.from_additive({name})) and use positional='alibi' or the core's "
            "bias= argument for the bias."
        )
    return from_additive(mask)  # type: ignore[no-any-return]
