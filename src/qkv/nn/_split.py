"""``split_sequence``: make every attention layer of a model sequence-parallel."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from qkv.distributed import Layout
from qkv.nn._mha import MultiHeadAttention
from qkv.nn._sequence import SequenceSplit

__all__ = ["split_sequence"]

M = TypeVar("M", bound=nn.Module)


def split_sequence(
    model: M,
    group: Any = None,
    *,
    layout: Layout = "zigzag",
    strategy: str = "ring",
) -> M:
    """Make every :class:`qkv.nn.MultiHeadAttention` in ``model`` sequence-parallel.

    Args:
        model: any module (a block, a stack of blocks, one attention layer).
        group: the process group the sequence is split across (default: the world);
            ``torch.distributed`` must be initialized.
        layout: ``"zigzag"``, ``"contiguous"`` or ``"striped"``, as in
            :func:`qkv.distributed.shard`.
        strategy: ``"ring"``, ``"allgather"`` or ``"ulysses"``, as in
            :func:`qkv.distributed.ring_attention`.

    Returns:
        ``model`` itself, changed in place. Feed it ``shard(x, layout=layout, dim=1)``.

    Example:
        >>> import torch, qkv
        >>> block = qkv.nn.split_sequence(qkv.nn.TransformerBlock(16, num_heads=2))
        >>> block(torch.randn(1, 6, 16), is_causal=True).shape   # one process: P = 1
        torch.Size([1, 6, 16])
    """
    settings = SequenceSplit(group, layout, strategy)
    if group is None and dist.is_available() and dist.is_initialized():
        settings = SequenceSplit(dist.group.WORLD, layout, strategy)
    found = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(
            f"model has no qkv.nn.MultiHeadAttention to split, got {type(model).__name__}. "
            "Hint: build the model from qkv.nn.TransformerBlock or qkv.nn.MultiHeadAttention."
        )
    for module in found:
        module.sequence_split = settings
    return model
