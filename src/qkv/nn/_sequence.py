"""Sequence parallelism for ``qkv.nn``: one sequence split across the ranks of a group.

With ``MultiHeadAttention(..., sequence_group=group)`` (or :func:`split_sequence` on a whole
model), each rank passes its own N/P positions, ``(B, N/P, E)``, as laid out by
:func:`qkv.distributed.shard` along the length axis (``dim=1``). The projections, LayerNorm
and MLP act token by token; the attention runs :func:`qkv.distributed.ring_attention` on the
rank's heads, and RoPE turns each token by its *global* position,
:func:`qkv.distributed.positions`, so the rotary encodings follow the layout's permutation.

Gradients: each rank's parameter gradients cover the loss terms of its own tokens (the
ring's backward already brings home the key/value gradients from the other ranks' queries).
Their sum over the ranks is the gradient of the whole sequence's loss, as DDP's all-reduce
computes it (DDP averages: with a per-rank mean loss on equal shards, the average of the
ranks' gradients is that of the whole sequence's mean loss).

Shape legend: B batch, N the global length, P ranks, E embed_dim, H heads, D head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed import LAYOUTS, STRATEGIES, Layout, positions, ring_attention
from qkv.masks import Mask, key_padding
from qkv.positional import ALiBi, RoPE, apply_rope

__all__ = ["SequenceSplit", "check_split", "split_attention"]


@dataclass(frozen=True)
class SequenceSplit:
    """How a module's sequence is split: the process group, the layout and the strategy.

    ``group=None`` is the default group (the world).

    Example:
        >>> SequenceSplit(layout="contiguous")
        SequenceSplit(group=None, layout='contiguous', strategy='ring')
    """

    group: Any = None
    layout: Layout = "zigzag"
    strategy: str = "ring"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"sequence_layout must be one of {', '.join(map(repr, LAYOUTS))}, got "
                f"{self.layout!r}. Hint: 'zigzag' balances causal work across ranks."
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"sequence_strategy must be one of {', '.join(map(repr, STRATEGIES))}, got "
                f"{self.strategy!r}. Hint: 'ring' keeps O(N/P) memory per rank."
            )


def check_split(group: Any, layout: str, strategy: str) -> SequenceSplit | None:
    """The settings of ``MultiHeadAttention(sequence_group=...)``, or None without a group."""
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"sequence_group must be a torch.distributed ProcessGroup, got "
            f"{type(group).__name__}. Hint: after init_process_group, pass "
            "torch.distributed.group.WORLD or a group from torch.distributed.new_group."
        )
    return SequenceSplit(group, layout, strategy)  # type: ignore[arg-type]


def _refuse(what: str, hint: str) -> None:
    raise ValueError(f"sequence-parallel attention does not support {what}. Hint: {hint}")


def split_attention(
    module: Any,
    query: torch.Tensor,
    split: SequenceSplit,
    *,
    self_attention: bool,
    mask: Any,
    lengths: torch.Tensor | Sequence[int] | None,
    is_causal: bool,
    cache: Any,
    need_weights: bool,
) -> torch.Tensor:
    """The forward pass of a sequence-parallel :class:`MultiHeadAttention` on this rank's
    shard ``query`` (B, N/P, E); returns (B, N/P, E)."""
    if not self_attention:
        _refuse("cross-attention (key is not query)", "split the sequence of self-attention.")
    if cache is not None:
        _refuse("a KV cache", "decode with the module outside split_sequence.")
    if need_weights:
        _refuse("need_weights=True", "the weights of a split sequence are never gathered.")
    if isinstance(module.positional, ALiBi):
        _refuse("ALiBi", "use positional='rope' (global positions follow the layout).")
    if module.bias_k is not None or module.add_zero_attn:
        _refuse("add_bias_kv / add_zero_attn", "build the module without them.")
    if module.training and module.dropout:
        _refuse("attention dropout", "set dropout=0.0 (or call .eval()).")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a qkv.masks.Mask rule in global positions when the sequence is "
            f"split, got {type(mask).__name__}. Hint: a dense array cannot be split by rule; "
            "use qkv.masks.document, sliding_window, ... or from_function."
        )
    batch, local = query.shape[0], query.shape[1]
    H, Hkv, D = module.num_heads, module.num_kv_heads, module.head_dim
    q = module.q_proj(query).view(batch, local, H, D).transpose(1, 2)  # (B, H, N/P, D)
    k = module.k_proj(query).view(batch, local, Hkv, D).transpose(1, 2)
    v = module.v_proj(query).view(batch, local, Hkv, D).transpose(1, 2)
    size = dist.get_world_size(split.group) if dist.is_initialized() else 1
    n = local * size
    if isinstance(module.positional, RoPE):
        where = positions(n, layout=split.layout, group=split.group).numpy()
        settings = module.positional
        q = apply_rope(q, where, base=settings.base, layout=settings.layout)
        k = apply_rope(k, where, base=settings.base, layout=settings.layout)
    rule = mask
    if lengths is not None:
        padding = key_padding(lengths)
        rule = padding if rule is None else rule & padding
    context = ring_attention(
        q,
        k,
        v,
        mask=rule,
        is_causal=is_causal,
        sinks=module.sinks,
        layout=split.layout,
        strategy=split.strategy,
        group=split.group,
    )
    out: torch.Tensor = module.out_proj(context.transpose(1, 2).reshape(batch, local, H * D))
    return out
