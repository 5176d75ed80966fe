"""How one sequence of N positions is split across the P ranks of a process group.

A layout says which global positions rank r holds, in which order:

- ``"contiguous"``: positions r·N/P … (r+1)·N/P − 1;
- ``"zigzag"``: chunks r and 2P−1−r of 2P equal chunks, so that under a causal mask every
  rank has the same work (one early chunk and one late chunk);
- ``"striped"``: positions r, r+P, r+2P, … (one token in P).

Each layout is a list of :class:`Piece`: runs of local indices that map to global positions
by ``start + stride · i``. The ring kernel evaluates the mask rule on global positions through
these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

Layout = Literal["contiguous", "zigzag", "striped"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "striped")

__all__ = [
    "LAYOUTS",
    "Layout",
    "Piece",
    "check_layout",
    "local_length",
    "pieces",
    "positions",
    "rank_and_size",
    "shard",
    "unshard",
]


@dataclass(frozen=True)
class Piece:
    """A run of ``length`` local indices starting at ``local``: local index ``local + i``
    holds global position ``start + stride · i``."""

    local: int
    length: int
    start: int
    stride: int

    @property
    def stop(self) -> int:
        """One past the last global position of the piece (exclusive end of its range)."""
        return self.start + self.stride * (self.length - 1) + 1 if self.length else self.start


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) when
    ``torch.distributed`` is not initialized (one process holds the whole sequence)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "group was given but torch.distributed is not initialized. Hint: call "
                "torch.distributed.init_process_group first (torchrun sets the environment)."
            )
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_layout(layout: str) -> None:
    """Raise a one-line error unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}. Hint: "
            "'zigzag' balances causal work across ranks; 'contiguous' is the plain split."
        )


def _check_length(n: int, layout: str, size: int) -> None:
    """Raise a one-line error unless ``n`` positions split evenly as ``layout`` needs."""
    parts = 2 * size if layout == "zigzag" else size
    if n < 0 or n % parts:
        what = f"2·P = {parts} chunks" if layout == "zigzag" else f"P = {parts} ranks"
        raise ValueError(
            f"sequence length {n} does not divide into {what} for layout {layout!r}. Hint: "
            f"pad the sequence to a multiple of {parts} and mask the padding with "
            "qkv.masks.key_padding."
        )


def pieces(n: int, layout: str, rank: int, size: int) -> tuple[Piece, ...]:
    """The pieces of rank ``rank`` of ``size`` for a sequence of ``n`` global positions."""
    check_layout(layout)
    _check_length(n, layout, size)
    local = n // size
    if layout == "contiguous":
        return (Piece(0, local, rank * local, 1),)
    if layout == "striped":
        return (Piece(0, local, rank, size),)
    chunk = local // 2
    return (Piece(0, chunk, rank * chunk, 1), Piece(chunk, chunk, (2 * size - 1 - rank) * chunk, 1))


def local_length(n: int, layout: str, size: int) -> int:
    """How many positions each rank holds (after checking that ``n`` splits evenly)."""
    check_layout(layout)
    _check_length(n, layout, size)
    return n // size


def _positions(n: int, layout: str, rank: int, size: int, device: Any = None) -> torch.Tensor:
    parts = [
        torch.arange(p.start, p.stop, p.stride, dtype=torch.long, device=device)
        for p in pieces(n, layout, rank, size)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def positions(n: int, *, layout: Layout = "zigzag", group: Any = None) -> torch.Tensor:
    """The global positions this rank holds, in the order of its shard.

    Use them for RoPE angles, labels and padding, so that they follow the same permutation
    as :func:`shard`.

    Args:
        n: the global sequence length N.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
        group: the process group (default: the world); without ``torch.distributed``
            initialized, one process holds everything.

    Returns:
        A long tensor of N/P positions.

    Example:
        >>> positions(8, layout="zigzag")  # one process: every position, in order
        tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    rank, size = rank_and_size(group)
    return _positions(n, layout, rank, size)


def _dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(
            f"dim {dim} is out of range for {name} of shape {tuple(x.shape)}. Hint: the "
            "sequence axis of (B, H, N, D) is dim=-2."
        )
    return dim % x.ndim


def shard(
    x: torch.Tensor, *, layout: Layout = "zigzag", dim: int = -2, group: Any = None
) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` (the same on every rank) along ``dim``.

    The result is a new tensor (gradients flow back to ``x``); its positions are
    :func:`positions` ``(x.shape[dim], layout=layout)``.

    Example:
        >>> import torch
        >>> shard(torch.arange(4.0).view(1, 1, 4, 1), layout="contiguous").flatten()
        tensor([0., 1., 2., 3.])
    """
    axis = _dim(x, dim, "x")
    rank, size = rank_and_size(group)
    index = _positions(x.shape[axis], layout, rank, size, device=x.device)
    return x.index_select(axis, index)


def unshard(
    x_local: torch.Tensor, *, layout: Layout = "zigzag", dim: int = -2, group: Any = None
) -> torch.Tensor:
    """The full tensor from every rank's shard (an all-gather), in global order.

    Every rank must call it with a shard of the same shape; every rank gets the whole
    tensor. The result carries no gradient history (gather the gradients yourself, or
    keep working on shards).

    Example:
        >>> import torch
        >>> unshard(torch.arange(4.0).view(1, 1, 4, 1), layout="zigzag").flatten()
        tensor([0., 1., 2., 3.])
    """
    axis = _dim(x_local, dim, "x_local")
    _, size = rank_and_size(group)
    local = x_local.shape[axis]
    n = local * size
    check_layout(layout)
    _check_length(n, layout, size)
    if size == 1:
        return x_local.detach().clone()
    part = x_local.detach().contiguous()
    gathered = [torch.empty_like(part) for _ in range(size)]
    dist.all_gather(gathered, part, group=group)
    order = torch.cat([_positions(n, layout, r, size, device=x_local.device) for r in range(size)])
    whole = torch.cat(gathered, dim=axis)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=order.device)
    return whole.index_select(axis, inverse)
