"""``flex_attention``: torch's FlexAttention signature on qkv's tiled kernel.

``torch.nn.attention.flex_attention`` runs its backward only on CUDA (on CPU: "FlexAttention
does not support backward on CPU"), and its eager forward holds the whole (Lq, Lk) matrix.
This entry takes the same arguments (a torch ``BlockMask`` from ``create_block_mask``, a
``score_mod(score, b, h, q_idx, kv_idx)``) and, on CPU, runs the tiled kernel, forward and
backward, in O(Lq + Lk) memory; on CUDA it calls torch's own compiled ``flex_attention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qkv._array import DtypeMismatchError, check_scale
from qkv.kernels._api import run_tiled
from qkv.kernels._flex_masks import BLOCK_MASKS, run_flex
from qkv.kernels._flex_mods import check_mods
from qkv.masks import EMPTY, FULL, PARTIAL, Mask, ScoreMod
from qkv.masks._scores import as_score_mod

__all__ = ["block_mask_rule", "flex_attention"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Any:
    """FlexAttention with a CPU backward: ``torch.nn.attention.flex_attention``'s signature
    and semantics, computed by qkv's tiled kernel on CPU.

    The scores ``scale · q·kᵀ`` go through ``score_mod``, the keys the mask forbids get
    weight 0, and each row's softmax weights the values. Gradients flow to query, key, value
    and (through the kernel's backward) to the tensors ``score_mod`` captures. Memory grows
    with Lq + Lk: the (Lq, Lk) matrix is never held, and blocks the mask leaves empty are
    skipped. On a CUDA device the call goes to torch's own ``flex_attention`` under
    ``torch.compile``.

    Args:
        query: (B, H, Lq, D). key: (B, Hkv, Lk, D). value: (B, Hkv, Lk, Dv); key and
            value of batch 1 serve every query batch element (as torch broadcasts them).
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score``, torch's signature (the
            arguments are broadcasting tensors), or a :class:`qkv.masks.ScoreMod`.
        block_mask: a torch ``BlockMask`` (from ``create_block_mask``; its ``mask_mod`` and
            its full / partial / empty blocks are used as torch uses them) or a
            :class:`qkv.masks.Mask`; None attends every key.
        scale: the factor of the scores; default 1/√D.
        enable_gqa: allow Hkv < H (grouped-query attention), as torch requires.
        return_lse: also return the natural log-sum-exp of each row's modified scores,
            (B, H, Lq), float32 for half-precision inputs as torch gives it (−inf for a row
            with no allowed key, whose output is 0).

    Returns:
        The output (B, H, Lq, Dv) in the dtype and the memory layout of query (as torch's:
        a query ``x.view(B, L, H, D).transpose(1, 2)`` gives an output that
        ``.transpose(1, 2).view(B, L, H * Dv)`` takes); with ``return_lse``,
        ``(output, lse)``.

    Raises:
        ValueError: shapes that do not fit, a ``block_mask`` made for other lengths or
            batch, inputs on several devices; on CPU, a ``score_mod`` or ``mask_mod`` that
            does not act on each score alone (a result of another shape than one per score,
            say a ``sum`` over the scores: qkv calls it on broadcasting blocks, torch one
            score at a time).
        TypeError: not tensors, a ``scale`` that is not a finite number; on CPU, a
            ``score_mod`` returning integers or booleans, a ``mask_mod`` returning anything
            but booleans.
        qkv.DtypeMismatchError: query, key and value of different dtypes (both a
            TypeError and a ValueError).

    Example:
        >>> import torch, qkv
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> block_mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
        >>> q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
        >>> out = qkv.flex_attention(q, k, v, block_mask=block_mask)
        >>> out.sum().backward()          # torch's flex_attention refuses this on CPU
        >>> tuple(q.grad.shape)
        (1, 2, 256, 16)
    """
    _check(query, key, value, enable_gqa)
    check_scale(scale)
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if key.shape[0] != batch:  # one key/value batch element for every query's: a view
        key, value = (x.expand(batch, *x.shape[1:]) for x in (key, value))
    if query.device.type == "cuda":
        return _on_cuda(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse)
    rule = _as_rule(block_mask, batch, query.shape[1], q_len, kv_len)
    check_mods(score_mod, block_mask, query, key)
    out, lse = run_tiled(
        query,
        key,
        value,
        rule=rule,
        dense_mask=None,
        bias=None,
        score_mod=as_score_mod(score_mod),
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
        dropout_p=0.0,
        seed=None,
        return_lse=True,
    )
    return (out, lse) if return_lse else out


def block_mask_rule(block_mask: Any) -> Mask:
    """A torch ``BlockMask`` as a :class:`qkv.masks.Mask` with the same allowed pairs.

    As torch does, a pair is allowed when its block is full, or when its block is partial and
    ``mask_mod`` allows it; empty blocks allow nothing. The mask knows its block structure,
    so the tiled kernel skips the empty blocks whatever its own block size.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 4, 4, device="cpu")
        >>> rule = block_mask_rule(bm)
        >>> import array_api_compat.torch as xp
        >>> rule.dense(4, 4, xp=xp)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [1, 1, 1, 0],
                [1, 1, 1, 1]], dtype=torch.int32)
    """
    kinds = _block_kinds(block_mask)  # (B', H', NQ, NK) int8 numpy
    block_q, block_kv = (int(n) for n in block_mask.BLOCK_SIZE)
    mask_mod = block_mask.mask_mod
    table = torch.from_numpy(kinds.astype(np.int8))
    many_b, many_h = kinds.shape[0] > 1, kinds.shape[1] > 1
    # Prefix sums over the blocks of each (b, h): how many are non-empty, how many full.
    counts = [_prefix(kinds != EMPTY), _prefix(kinds == FULL)]

    def rule(b: Any, h: Any, q: Any, kv: Any, lq: int, lk: int, xp: Any) -> Any:
        kind = table.to(q.device)[
            b if many_b else 0, h if many_h else 0, q // block_q, kv // block_kv
        ]
        inside = mask_mod(b, h, q, kv)
        return (kind == FULL) | ((kind == PARTIAL) & torch.as_tensor(inside, device=q.device))

    def blocks(
        b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int
    ) -> tuple[Any, Any]:
        bi, hi = (b if many_b else 0), (h if many_h else 0)
        rows = (q0 // block_q, (q1 - 1) // block_q + 1)
        cols = (k0 // block_kv, (k1 - 1) // block_kv + 1)
        area = (rows[1] - rows[0]) * (cols[1] - cols[0])
        some = _rectangle(counts[0], bi, hi, rows, cols) > 0
        every = _rectangle(counts[1], bi, hi, rows, cols) == area
        return some, every

    name = getattr(mask_mod, "__name__", "mask_mod")
    return Mask(rule, f"block_mask({name}, BLOCK_SIZE={block_q, block_kv})", blocks=blocks)


def _block_kinds(block_mask: Any) -> np.ndarray:
    """The kind of every block of a BlockMask, (B', H', NQ, NK) of EMPTY, PARTIAL, FULL."""
    num, indices = block_mask.kv_num_blocks, block_mask.kv_indices
    kinds = _ordered_to_kinds(num, indices, PARTIAL)
    if block_mask.full_kv_num_blocks is not None:
        full = _ordered_to_kinds(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)
        kinds = np.maximum(kinds, full)
    return kinds


def _ordered_to_kinds(num: torch.Tensor, indices: torch.Tensor, kind: int) -> np.ndarray:
    """The first ``num`` entries of each row of ``indices``, as a dense (…, NQ, NK) array."""
    num_np = num.detach().cpu().numpy().astype(np.int64)
    idx = indices.detach().cpu().numpy().astype(np.int64)
    columns = idx.shape[-1]
    valid = np.arange(columns) < num_np[..., None]
    dense = np.zeros((*idx.shape[:-1], columns + 1), dtype=np.int8)
    np.put_along_axis(dense, np.where(valid, idx, columns), kind, axis=-1)
    return dense[..., :columns]


def _prefix(flags: np.ndarray) -> np.ndarray:
    """2-D prefix sums over the last two axes, with a leading row and column of zeros."""
    out = np.zeros((*flags.shape[:-2], flags.shape[-2] + 1, flags.shape[-1] + 1), np.int64)
    out[..., 1:, 1:] = flags.astype(np.int64).cumsum(-2).cumsum(-1)
    return out


def _rectangle(
    sums: np.ndarray, b: Any, h: Any, rows: tuple[Any, Any], cols: tuple[Any, Any]
) -> np.ndarray:
    """How many flagged blocks lie in rows[0]:rows[1] × cols[0]:cols[1] (clipped)."""
    r0, r1 = (np.clip(r, 0, sums.shape[-2] - 1) for r in rows)
    c0, c1 = (np.clip(c, 0, sums.shape[-1] - 1) for c in cols)
    total: np.ndarray = sums[b, h, r1, c1] - sums[b, h, r0, c1] - sums[b, h, r1, c0]
    total += sums[b, h, r0, c0]
    return total


def _as_rule(block_mask: Any, batch: int, heads: int, q_len: int, kv_len: int) -> Mask | None:
    """The qkv mask rule of ``block_mask`` (None: every key)."""
    if isinstance(block_mask, Mask):
        block_mask.check_batch(batch)
    if block_mask is None or isinstance(block_mask, Mask):
        return block_mask
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a torch BlockMask or a qkv.masks.Mask, got "
            f"{type(block_mask).__name__}. Hint: create_block_mask(mask_mod, B, H, Lq, Lk), "
            "or qkv.masks.causal()."
        )
    seq = tuple(int(n) for n in block_mask.seq_lengths)
    if seq != (q_len, kv_len):
        raise ValueError(
            f"block_mask was made for (Lq, Lk) = {seq}, but query and key have {(q_len, kv_len)}. "
            f"Hint: create_block_mask(mask_mod, B, H, {q_len}, {kv_len})."
        )
    mask_b, mask_h = block_mask.kv_num_blocks.shape[:2]
    if mask_b not in (1, batch) or mask_h not in (1, heads):
        raise ValueError(
            f"block_mask has batch {mask_b} and heads {mask_h}, the query batch {batch} and "
            f"heads {heads}. Hint: give B and H of the query to create_block_mask, or None."
        )
    return block_mask_rule(block_mask)


def _on_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
) -> Any:
    """torch's compiled flex_attention; a qkv Mask or ScoreMod becomes torch's form first
    (:mod:`qkv.kernels._flex_masks`: the BlockMask from the rule's block structure, cached)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if isinstance(block_mask, Mask):
        block_mask = BLOCK_MASKS.block_mask(
            block_mask,
            batch=query.shape[0],
            heads=query.shape[1],
            q_len=q_len,
            kv_len=kv_len,
            device=query.device,
        )
    torch_mod = score_mod  # torch's own signature: given as it is
    if isinstance(score_mod, ScoreMod):
        torch_mod = BLOCK_MASKS.score_mod(
            score_mod, q_len, kv_len, device=query.device, dtype=query.dtype
        )
    return run_flex(
        query,
        key,
        value,
        score_mod=torch_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
    )


def _check(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    """Types, dimensions and shapes as torch's flex_attention wants them (one-line errors)."""
    named = (("query", query), ("key", key), ("value", value))
    for name, x in named:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.dtype not in _FLOATS:
            got = (
                f"{x.dtype} of shape {tuple(x.shape)}"
                if isinstance(x, torch.Tensor)
                else type(x).__name__
            )
            raise ValueError(
                f"flex_attention: {name} must be a floating-point torch.Tensor of shape "
                f"(B, H, L, D), got {got}. Hint: split heads first, e.g. qkv.split_heads."
            )
    if len({x.dtype for _, x in named}) > 1:
        raise DtypeMismatchError(
            "flex_attention: query, key and value must share one dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}. Hint: convert them with "
            ".to(query.dtype)."
        )
    if len({x.device for _, x in named}) > 1:
        raise ValueError(
            "flex_attention: query, key and value must be on one device, got "
            f"{query.device}, {key.device} and {value.device}. Hint: move them with "
            ".to(query.device)."
        )
    (b, h, _, d), (bk, hkv, lk, dk), (bv, hv, lv, _) = query.shape, key.shape, value.shape
    if d != dk or (bk, hkv, lk) != (bv, hv, lv) or bk not in (b, 1):
        raise ValueError(
            f"flex_attention: shapes do not fit: query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}. Hint: (B, H, Lq, D), "
            "(B, Hkv, Lk, D), (B, Hkv, Lk, Dv); key and value may have batch 1 for all B."
        )
    if h != hkv and (not enable_gqa or hkv == 0 or h % hkv):
        raise ValueError(
            f"flex_attention: query has {h} heads and key {hkv}; "
            + (
                "pass enable_gqa=True for grouped-query attention."
                if hkv and h % hkv == 0
                else "Hkv must divide H."
            )
            + " Hint: as torch's flex_attention, different head counts need enable_gqa=True."
        )
