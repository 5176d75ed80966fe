"""Checks of a ring-attention call, and how the ranks agree on them.

A check that fails on one rank only must not leave the others waiting in a collective until
its timeout. So every rank runs its own checks (and plans its steps) inside a ``try``, and
then all ranks exchange one small row (an error flag, the shapes and dtype, and which ring
steps have work) in one all-gather. A rank whose own check failed raises its error; the
others raise an error naming it; shards whose shapes differ raise the same error on every
rank. The union of the ranks' busy steps says which steps anyone computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed._layout import check_layout
from qkv.kernels._api import check_sinks
from qkv.masks import Mask

__all__ = ["FLOATS", "STRATEGIES", "agree", "check_call"]

STRATEGIES: tuple[str, ...] = ("ring", "allgather", "ulysses")

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_SHAPE = 10  # q's and k's shapes, v's last dim, the dtype's index


def check_call(
    q: Any, k: Any, v: Any, mask: Any, sinks: Any, layout: str, strategy: str
) -> torch.Tensor | None:
    """Raise a one-line error for bad arguments of this rank; returns the checked sinks."""
    check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}. "
            "Hint: 'ring' keeps O(N/P) memory per rank; 'allgather' gathers K/V once; "
            "'ulysses' exchanges heads."
        )
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a qkv.masks.Mask rule in global positions, got "
            f"{type(mask).__name__}. Hint: a dense boolean array cannot be split across "
            "ranks; use qkv.masks.from_function for a rule of your own."
        )
    _check_tensors(q, k, v)
    if mask is not None:
        mask.check_batch(q.shape[0])  # one length per batch element
    return None if sinks is None else check_sinks(sinks, q)


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    named = (("q", q), ("k", k), ("v", v))
    for name, x in named:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.dtype not in FLOATS:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else ""
            raise ValueError(
                f"{name} must be a floating-point torch.Tensor (B, H, N/P, D), got "
                f"{got or type(x).__name__}. Hint: shard each of q, k, v with "
                "qkv.distributed.shard(x, layout=...)."
            )
    if len({x.dtype for _, x in named}) > 1 or len({x.device for _, x in named}) > 1:
        raise TypeError(
            f"q, k and v must share one dtype and one device, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Hint: convert them with .to(q)."
        )
    (b, h, n, d), (bk, hk, nk, dk), (bv, hv, nv, _) = q.shape, k.shape, v.shape
    if d != dk or (bk, hk, nk) != (bv, hv, nv) or (b, n) != (bk, nk) or hk == 0 or h % hk:
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. "
            "Hint: (B, H, N/P, D), (B, Hkv, N/P, D), (B, Hkv, N/P, Dv) with Hkv dividing H."
        )


def _device(q: Any, group: Any) -> torch.device:
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if isinstance(q, torch.Tensor) and q.is_cuda:
        return q.device
    return torch.device("cuda", torch.cuda.current_device())


def agree(
    q: Any,
    k: Any,
    v: Any,
    busy: list[bool],
    error: Exception | None,
    size: int,
    group: Any,
) -> list[int]:
    """Exchange every rank's check result and busy steps (one all-gather); raise the same
    way on every rank when any rank failed or the shards differ. Returns the ring steps
    that some rank computes, in order."""
    if size == 1:
        if error is not None:
            raise error
        return [s for s, b in enumerate(busy) if b]
    row = [0] * (1 + _SHAPE + size)
    if error is None:
        row[0] = 1
        row[1 : 1 + _SHAPE] = [*q.shape, *k.shape, v.shape[-1], FLOATS.index(q.dtype)]
        row[1 + _SHAPE :] = [int(b) for b in busy]
    device = _device(q, group)
    mine = torch.tensor(row, dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rows = [[int(x) for x in t.cpu()] for t in every]
    if error is not None:
        raise error
    refused = [r for r, got in enumerate(rows) if got[0] == 0]
    if refused:
        raise ValueError(
            f"rank {refused[0]} refused its input (its own error says why), so every rank "
            "stops here. Hint: read the error printed by that rank."
        )
    shapes = {tuple(got[1 : 1 + _SHAPE]) for got in rows}
    if len(shapes) > 1:
        listed = "; ".join(f"rank {r}: q {got[1:5]}, k {got[5:9]}" for r, got in enumerate(rows))
        raise ValueError(
            f"the shards differ between ranks ({listed}). Hint: every rank must pass shards "
            "of one shape and dtype, from qkv.distributed.shard on the same full tensors."
        )
    return [s for s in range(size) if any(got[1 + _SHAPE + s] for got in rows)]
