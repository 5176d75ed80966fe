"""The readable reference of flash-attn's semantics, for the tests of ``qkv.flash_attn``.

Written after Dao-AILab/flash-attention ``tests/test_flash_attn.py`` (``attention_ref``,
``construct_local_mask``, ``attn_bias_from_alibi_slopes``, ``generate_random_padding_mask``;
read, not copied): dense scores, padding masks, a window aligned to each sequence's end,
softcap, then ALiBi, softmax, dropout. Run it in float64 for the truth, and in the dtype
under test (``upcast=False``, the scale moved onto k as flash-attn's ``reorder_ops``) for
the rounding error that sets the tolerance.
"""

from __future__ import annotations

import math

import torch


def padding_mask(lengths: list[int], longest: int) -> torch.Tensor:
    """(B, longest) booleans, True for the first lengths[b] positions."""
    return torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]


def random_lengths(gen: torch.Generator, longest: int, batch: int) -> list[int]:
    """flash-attn's ``generate_random_padding_mask(mode="random")``: lengths between
    max(1, longest − 20) and longest."""
    return torch.randint(max(1, longest - 20), longest + 1, (batch,), generator=gen).tolist()


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, …] as int32."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def local_mask(
    lq: int,
    lk: int,
    window: tuple[int, int],
    q_len: torch.Tensor,
    k_len: torch.Tensor,
    key_leftpad: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, 1, Lq, Lk) True where the window hides key j from query i; ``q_len``, ``k_len``
    (B,) are the real lengths (the alignment is to their end)."""
    row = torch.arange(lq)[None, None, :, None]
    col = torch.arange(lk)[None, None, None, :].expand(len(k_len), 1, 1, lk)
    if key_leftpad is not None:
        pad = key_leftpad.long()[:, None, None, None]
        col = torch.where(col >= pad, col - pad, 2**32)
    sk = k_len[:, None, None, None]
    sq = q_len[:, None, None, None]
    if window[0] < 0:
        return col > row + sk - sq + window[1]
    far = torch.minimum(row + sk - sq + window[1], sk) if window[1] >= 0 else sk
    return (col > far) | (col < row + sk - sq - window[0])


def alibi_bias(
    slopes: torch.Tensor,
    lq: int,
    lk: int,
    q_len: torch.Tensor,
    k_len: torch.Tensor,
    key_leftpad: torch.Tensor | None = None,
) -> torch.Tensor:
    """−slope · |i + Lk − Lq − j| of each sequence's real lengths, (B, H, Lq, Lk), float64."""
    slopes = slopes.double()
    slopes = slopes.expand(len(q_len), -1) if slopes.ndim == 1 else slopes
    row = torch.arange(lq)[None, None, :, None]
    col = torch.arange(lk)[None, None, None, :]
    if key_leftpad is not None:
        col = col - key_leftpad.long()[:, None, None, None]
    distance = (row + k_len[:, None, None, None] - q_len[:, None, None, None] - col).abs()
    return -slopes[:, :, None, None] * distance.double()


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_mask: torch.Tensor | None = None,
    k_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    keep: torch.Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
    key_leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output (B, Lq, H, D), weights (B, H, Lq, Lk) before dropout, and the log-sum-exp
    (B, H, Lq) of q (B, Lq, H, D), k and v (B, Lk, Hkv, D); float64 when ``upcast``."""
    if causal:
        window = (window[0], 0)
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    batch, lq, heads, dim = q.shape
    lk = k.shape[1]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    if upcast:
        scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(dim), k)
    else:  # flash-attn's reorder_ops: the same math, another rounding
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(dim))
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_len = torch.full((batch,), lq) if q_mask is None else q_mask.sum(-1)
    k_len = torch.full((batch,), lk) if k_mask is None else k_mask.sum(-1)
    hidden = torch.zeros(batch, 1, lq, lk, dtype=torch.bool)
    if k_mask is not None:
        hidden |= ~k_mask[:, None, None, :]
    if window[0] >= 0 or window[1] >= 0:
        hidden |= local_mask(lq, lk, window, q_len, k_len, key_leftpad)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if q_mask is not None:
        weights = weights.masked_fill(~q_mask[:, None, :, None], 0.0)
    dropped = weights if keep is None else weights.masked_fill(~keep, 0.0)
    out = torch.einsum("bhts,bshd->bthd", dropped, v / (1 - dropout_p))
    if q_mask is not None:
        out = out.masked_fill(~q_mask[:, :, None, None], 0.0)
    return out.to(dtype), weights.to(dtype), lse
