"""One sequence across processes: ring attention on ``torch.distributed`` that keeps the mask.

Split a long sequence across the P ranks of a process group with :func:`shard` (layouts
``"zigzag"``, ``"contiguous"``, ``"striped"``), run :func:`ring_attention` on each rank's
shards, and get each rank's part of the output: the same numbers, forward and backward, as
single-process attention on the whole sequence, with any :class:`qkv.masks.Mask` rule in
global positions (causal, sliding window, documents, prefix-LM, padding) and sinks, by the
``"ring"`` strategy (K/V blocks pass around the ranks) or ``"allgather"`` (K/V gathered once).
:func:`positions` gives the global positions a rank holds (for RoPE, labels, padding);
:func:`unshard` gathers the full tensor back; :func:`profiling` records where the calls
spend time and memory (``qkv bench ring``). Needs PyTorch (the torch extra); works with
gloo on CPU and NCCL on GPUs. See ``docs/distributed.md``.
"""

from qkv.distributed._layout import LAYOUTS, Layout, positions, shard, unshard
from qkv.distributed._profile import Profile, profiling
from qkv.distributed._ring import STRATEGIES, ring_attention

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "Layout",
    "Profile",
    "positions",
    "profiling",
    "ring_attention",
    "shard",
    "unshard",
]
