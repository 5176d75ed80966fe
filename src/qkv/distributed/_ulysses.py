"""The ``"ulysses"`` strategy: an all-to-all from sequence shards to head shards and back.

Each rank gives every other rank the heads it will own, for its own positions, and gets
all N positions of H/P heads; it runs the tiled kernel on the whole sequence (in global
order, so the mask rule and its block skipping apply as in one process) and sends the
output back the same way. The all-to-alls are autograd Functions whose backward is the
inverse all-to-all. Needs H and Hkv divisible by P.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed._layout import _positions as _layout_positions
from qkv.kernels._api import run_tiled
from qkv.masks import Mask

__all__ = ["ulysses"]


def ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rule: Mask | None,
    scale: float,
    sinks: torch.Tensor | None,
    layout: str,
    rank: int,
    size: int,
    group: Any,
) -> torch.Tensor:
    """The ``"ulysses"`` strategy: sequence shards to head shards (all-to-all), attention on
    H/P heads over the whole sequence in global order, and back."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % size or kv_heads % size:
        raise ValueError(
            f"strategy 'ulysses' needs the heads H = {heads} and Hkv = {kv_heads} to be "
            f"multiples of P = {size}. Hint: use strategy='ring', which works for any H."
        )
    n = q.shape[2] * size
    order = torch.cat([_layout_positions(n, layout, r, size, q.device) for r in range(size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=order.device)

    def to_heads(x: torch.Tensor) -> torch.Tensor:
        gathered: torch.Tensor = _SeqToHeads.apply(x, group, size)  # type: ignore[no-untyped-call]
        return gathered.index_select(2, inverse)  # global order

    own = slice(rank * heads // size, (rank + 1) * heads // size)
    out = run_tiled(
        to_heads(q),
        to_heads(k),
        to_heads(v),
        rule=rule,
        dense_mask=None,
        bias=None,
        score_mod=None,
        scale=scale,
        dropout_p=0.0,
        seed=None,
        sinks=None if sinks is None else sinks[own],
    )
    back: torch.Tensor = _HeadsToSeq.apply(  # type: ignore[no-untyped-call]
        out.index_select(2, order), group, size
    )
    return back.to(q.dtype)


def _seq_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(B, H, N/P, D) sequence shards to (B, H/P, N, D) head shards (ranks' shards in rank
    order along the sequence)."""
    b, h, n, d = x.shape
    send = x.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    if size == 1:
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _heads_to_seq(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, h, total, d = x.shape
    n = total // size
    send = x.reshape(b, h, size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    if size == 1:
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, size * h, n, d)


class _SeqToHeads(torch.autograd.Function):
    """All-to-all from sequence shards to head shards; its backward is the inverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    """All-to-all from head shards back to sequence shards; its backward is the inverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _heads_to_seq(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.size), None, None
