"""Ring attention: K/V blocks travel around the ranks; each rank keeps its queries.

Forward: at step s, rank r holds the K/V block of rank (r − s) mod P. It sends that block to
rank r + 1 and receives the next one from rank r − 1 into a private buffer (two buffers
rotate), while it runs the tiled kernel on its queries and the block it holds, with the mask
rule evaluated on global positions. A (query piece, key piece) pair that the rule's block
structure proves empty is not computed. The partial outputs merge through their
log-sum-exp in float32 (float64 for float64 inputs).

Backward (an autograd Function, so autograd never sees a collective): the K/V blocks travel
the same way, and with each block a dK/dV accumulator; after P steps every accumulator is
back on the rank that owns the block. Each step recomputes its partial attention and takes
its gradients from the merged output and log-sum-exp.

The ``"allgather"`` strategy runs the same steps on K/V gathered once; ``"ulysses"`` trades
sequence shards for head shards with all-to-all and runs the kernel on the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed._checks import STRATEGIES, agree, check_call, encode_options
from qkv.distributed._layout import Layout, Piece, pieces, rank_and_size
from qkv.distributed._profile import current
from qkv.distributed._steps import (
    Ring,
    attend_step,
    backward_inputs,
    empty_merge,
    exchange,
    grad_step,
    move,
    wait,
)
from qkv.distributed._ulysses import ulysses
from qkv.kernels._api import with_sinks
from qkv.masks import Mask, with_causal

__all__ = ["STRATEGIES", "ring_attention"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | None = None,
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    layout: Layout = "zigzag",
    strategy: str = "ring",
    group: Any = None,
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``, on this rank's shards.

    Every rank calls it with its own shards (from :func:`qkv.distributed.shard`) and gets its
    own part of the output, equal to the same rows of single-process attention on the whole
    sequence, forward and backward.

    Args:
        q: (B, H, N/P, D), this rank's queries. k: (B, Hkv, N/P, D). v: (B, Hkv, N/P, Dv).
            Hkv divides H (grouped-query attention when smaller).
        mask: a :class:`qkv.masks.Mask` in *global* positions (causal, sliding window,
            documents, prefix-LM, key padding, your own rule); its block structure lets
            empty blocks be skipped.
        is_causal: add the causal rule (``mask & causal()``).
        sinks: per-head sink logits, shape (H,), the same on every rank. Each rank's
            gradient of ``sinks`` covers its own rows: sum them over the ranks (DDP does).
        scale: the factor on Q·Kᵀ (default 1/√D).
        layout: how the sequence was split: ``"zigzag"``, ``"contiguous"`` or ``"striped"``.
        strategy: ``"ring"`` (O(N/P) memory per rank: K/V blocks pass around the ring) or
            ``"allgather"`` (every rank gathers all of K/V once: O(N) K/V memory, one
            collective; the gradients of K/V are summed with one all-reduce) or
            ``"ulysses"`` (all-to-all from sequence shards to head shards and back: each
            rank attends H/P heads over the whole sequence; needs H and Hkv divisible by P).
            All three give the same numbers.
        group: the process group (default: the world). Without ``torch.distributed``
            initialized, one process holds the whole sequence.

    Returns:
        This rank's output, (B, H, N/P, Dv), in the dtype of ``q``.
    """
    rank, size = rank_and_size(group)
    # every rank checks its own arguments and plans its steps, then all ranks agree (one
    # all-gather): a bad argument on one rank raises on every rank instead of hanging
    error: Exception | None = None
    busy = [False] * size
    ring: Ring | None = None
    checked_sinks = None
    options = None
    try:
        checked_sinks = check_call(q, k, v, mask, sinks, layout, strategy)
        options = encode_options(is_causal, layout, strategy, scale, checked_sinks, mask)
        local = q.shape[2]
        n = local * size
        plan = pieces(n, layout, rank, size)  # checks that N splits as the layout needs
        rule = with_causal(mask, is_causal)
        factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        ring = Ring(rule=rule, scale=factor, layout=layout, rank=rank, size=size, group=group, n=n)
        if strategy != "ulysses":
            if rule is None:  # positions do not matter: one piece covers the shard
                ring.whole = (Piece(0, local, 0, 1),)
            busy = ring.plan_steps(plan, q.shape[0], q.shape[1])
    except (TypeError, ValueError) as caught:
        error = caught
    steps = agree(q, k, v, busy, error, size, group, options)
    assert ring is not None
    if strategy == "ulysses":
        return ulysses(q, k, v, ring.rule, ring.scale, checked_sinks, layout, rank, size, group)
    ring.busy = steps
    function = _RingFunction if strategy == "ring" else _GatherFunction
    result: tuple[torch.Tensor, torch.Tensor] = function.apply(  # type: ignore[no-untyped-call]
        q, k, v, ring
    )
    out, lse = result
    if checked_sinks is not None:
        out, _ = with_sinks(out, lse, checked_sinks.to(lse.dtype))
    return out.to(q.dtype)


def _first_block(k: torch.Tensor, v: torch.Tensor, ring: Ring) -> tuple[torch.Tensor, ...]:
    """The key/value block of the first step with work: this rank's own (step 0), or, when
    every rank's first steps are empty, the block that many hops behind."""
    held = (k.contiguous(), v.contiguous())
    if ring.busy and ring.busy[0] != 0:
        held = move(list(held), ring, ring.busy[0])
    return held


def _next(ring: Ring, i: int) -> int | None:
    return ring.busy[i + 1] if i + 1 < len(ring.busy) else None


class _RingFunction(torch.autograd.Function):
    """The ring forward and its ring backward (dK/dV travel home)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: Ring,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = empty_merge(q, v)
        held = _first_block(k, v, ring)
        mine = ring.busy[:1] == [0]  # held is the caller's k, v: never a receive buffer
        spare: list[torch.Tensor] = []
        profile = current()
        for i, step in enumerate(ring.busy):
            nxt = _next(ring, i)
            work: list[dist.Work] = []
            if nxt is not None:
                # a step that is empty on every rank is skipped: the next block comes
                # straight from the rank (nxt − step) hops behind
                incoming = spare or [torch.empty_like(held[0]), torch.empty_like(held[1])]
                if profile is not None:
                    profile.note_bytes(out, lse, *held, *incoming)
                work = exchange(list(held), ring, incoming, hops=nxt - step)
            attend_step(ring, step, q, (held[0], held[1]), out, lse)
            wait(work, q.device)
            if work:
                sent = list(held)
                held = (incoming[0], incoming[1])
                spare = [] if mine else sent
                mine = False
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        compute = out.dtype
        saved, grads = backward_inputs(out, lse, grad_out, grad_lse)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        held = _first_block(k, v, ring)
        acc = [torch.zeros(x.shape, dtype=compute, device=x.device) for x in (k, v)]
        profile = current()
        for i, step in enumerate(ring.busy):
            nxt = _next(ring, i)
            incoming = [torch.empty_like(held[0]), torch.empty_like(held[1])]
            if profile is not None:
                profile.note_bytes(dq, *saved, *grads, *held, *incoming, *acc)
            work = exchange(list(held), ring, incoming, hops=nxt - step) if nxt is not None else []
            grad_step(ring, step, q, (held[0], held[1]), saved, grads, dq, (acc[0], acc[1]))
            wait(work, q.device)
            # the accumulators follow their block; after the last step with work, they go
            # straight home: the block held at step s belongs to the rank s hops behind
            hops = nxt - step if nxt is not None else -step
            if hops % ring.size:
                acc = list(move(acc, ring, hops))
            if work:
                held = (incoming[0], incoming[1])
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None


class _GatherFunction(torch.autograd.Function):
    """The ``"allgather"`` strategy: K/V gathered once; dK/dV summed with one all-reduce."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: Ring,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = empty_merge(q, v)
        keys, values = _gather(k, ring), _gather(v, ring)
        profile = current()
        if profile is not None:
            profile.note_bytes(out, lse, *keys, *values)
        for step in ring.busy:
            src = (ring.rank - step) % ring.size
            attend_step(ring, step, q, (keys[src], values[src]), out, lse)
        ctx.ring = ring
        ctx.save_for_backward(q, out, lse, torch.stack(keys), torch.stack(values))
        return out.to(q.dtype), lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, keys, values = ctx.saved_tensors
        ring: Ring = ctx.ring
        compute = out.dtype
        saved, grads = backward_inputs(out, lse, grad_out, grad_lse)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        # every rank's contribution to every block; the all-reduce sums them
        acc = [torch.zeros(x.shape, dtype=compute, device=x.device) for x in (keys, values)]
        profile = current()
        if profile is not None:
            profile.note_bytes(dq, *saved, *grads, keys, values, *acc)
        for step in ring.busy:
            src = (ring.rank - step) % ring.size
            kv = (keys[src], values[src])
            grad_step(ring, step, q, kv, saved, grads, dq, (acc[0][src], acc[1][src]))
        if ring.size > 1:
            for a in acc:
                dist.all_reduce(a, group=ring.group)
        dk, dv = acc[0][ring.rank], acc[1][ring.rank]
        return dq.to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), None


def _gather(x: torch.Tensor, ring: Ring) -> list[torch.Tensor]:
    """Every rank's block of ``x``, indexed by rank in the group (a new tensor each)."""
    part = x.detach().contiguous()
    if ring.size == 1:
        return [part.clone()]
    blocks = [torch.empty_like(part) for _ in range(ring.size)]
    dist.all_gather(blocks, part, group=ring.group)
    return blocks
