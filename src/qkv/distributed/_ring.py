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

from qkv.distributed._layout import Layout, Piece, check_layout, pieces, rank_and_size
from qkv.distributed._layout import _positions as _layout_positions
from qkv.kernels._api import check_sinks, run_tiled, with_sinks
from qkv.masks import EMPTY, Mask, with_causal

__all__ = ["STRATEGIES", "ring_attention"]

STRATEGIES: tuple[str, ...] = ("ring", "allgather", "ulysses")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    checked_sinks = None if sinks is None else check_sinks(sinks, q)
    rank, size = rank_and_size(group)
    _check_same_on_every_rank(q, k, v, size, group)
    local = q.shape[2]
    n = local * size
    plan = pieces(n, layout, rank, size)  # checks that N splits as the layout needs
    rule = with_causal(mask, is_causal)
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if strategy == "ulysses":
        return _ulysses(q, k, v, rule, factor, checked_sinks, layout, rank, size, group)
    ring = _Ring(rule=rule, scale=factor, layout=layout, rank=rank, size=size, group=group, n=n)
    if rule is None:  # positions do not matter: one piece covers the shard
        ring.whole = (Piece(0, local, 0, 1),)
    ring.plan_steps(plan, q.shape[0], q.shape[1])
    function = _RingFunction if strategy == "ring" else _GatherFunction
    result: tuple[torch.Tensor, torch.Tensor] = function.apply(  # type: ignore[no-untyped-call]
        q, k, v, ring
    )
    out, lse = result
    if checked_sinks is not None:
        out, _ = with_sinks(out, lse, checked_sinks.to(lse.dtype))
    return out.to(q.dtype)


class _Ring:
    """What one call needs on every step: the rule, the scale and the group's geometry."""

    def __init__(
        self,
        *,
        rule: Mask | None,
        scale: float,
        layout: str,
        rank: int,
        size: int,
        group: Any,
        n: int,
    ) -> None:
        self.rule = rule
        self.scale = scale
        self.layout = layout
        self.rank = rank
        self.size = size
        self.group = group
        self.n = n
        self.whole: tuple[Piece, ...] | None = None
        # per step, the (query piece, key piece, rule) triples not proven empty
        self.steps: list[list[tuple[Piece, Piece, Mask | None]]] = []
        self.last = -1  # the last step with work on any rank: no exchange after it

    def plan_steps(self, plan: tuple[Piece, ...], batch: int, heads: int) -> None:
        """Find the pairs each step computes, and (with every rank) the last useful step."""
        qps = self.whole if self.whole is not None else plan
        for step in range(self.size):
            src = (self.rank - step) % self.size
            kps = (
                self.whole
                if self.whole is not None
                else pieces(self.n, self.layout, src, self.size)
            )
            work = []
            for qp in qps:
                for kp in kps:
                    rule = None if self.rule is None else _shifted(self.rule, qp, kp, self.n)
                    if not self.empty(rule, qp, kp, batch, heads):
                        work.append((qp, kp, rule))
            self.steps.append(work)
        mine = max((s for s, work in enumerate(self.steps) if work), default=-1)
        self.last = mine if self.size == 1 else _max_over_ranks(mine, self.group)

    def peer(self, offset: int) -> int:
        """The global rank of the rank ``offset`` steps along the ring."""
        target = (self.rank + offset) % self.size
        return target if self.group is None else dist.get_global_rank(self.group, target)

    def empty(self, rule: Mask | None, qp: Piece, kp: Piece, batch: int, heads: int) -> bool:
        """Whether the rule's block structure proves the pair empty (no compute needed)."""
        if rule is None or qp.length == 0 or kp.length == 0:
            return qp.length == 0 or kp.length == 0
        kinds = rule.blocks(qp.length, kp.length, qp.length, kp.length, batch=batch, heads=heads)
        return bool((kinds == EMPTY).all())


def _shifted(base: Mask, qp: Piece, kp: Piece, n: int) -> Mask:
    """``base`` seen from local indices: local (i, j) is global (start + stride · i, ...).

    The block hint asks the base rule about the global range a block covers: exact for
    stride 1, a superset (still a valid promise) for the striped layout.
    """

    def rule(b: Any, h: Any, qi: Any, ki: Any, lq: int, lk: int, xp: Any) -> Any:
        return base(b, h, qp.start + qp.stride * qi, kp.start + kp.stride * ki, n, n, xp)

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any, lq: int, lk: int) -> Any:
        return base._block_pair(
            b,
            h,
            qp.start + qp.stride * q0,
            qp.start + qp.stride * (q1 - 1) + 1,
            kp.start + kp.stride * k0,
            kp.start + kp.stride * (k1 - 1) + 1,
            n,
            n,
        )

    return Mask(rule, f"{base!r} at global positions", blocks=blocks)


def _exchange(
    tensors: list[torch.Tensor], ring: _Ring, into: list[torch.Tensor], hops: int = 1
) -> list[dist.Work]:
    """Start sending ``tensors`` to the rank ``hops`` ahead on the ring and receiving those of
    the rank ``hops`` behind into ``into``; returns the requests to wait on."""
    nxt, prev = ring.peer(hops), ring.peer(-hops)
    ops = [dist.P2POp(dist.isend, t, nxt, ring.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prev, ring.group) for t in into]
    return list(dist.batch_isend_irecv(ops))


def _merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys, merged through their log-sum-exp."""
    new = torch.logaddexp(lse, part_lse)
    ref = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    merged = out * torch.exp(lse - ref).unsqueeze(-1) + part * torch.exp(part_lse - ref).unsqueeze(
        -1
    )
    return merged, new


def _pair(
    ring: _Ring, rule: Mask | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled kernel's context and log-sum-exp on one (query piece, key piece) pair."""
    out, lse = run_tiled(
        q,
        k,
        v,
        rule=rule,
        dense_mask=None,
        bias=None,
        score_mod=None,
        scale=ring.scale,
        dropout_p=0.0,
        seed=None,
        return_lse=True,
    )
    return out, lse


def _rows(x: torch.Tensor, p: Piece) -> torch.Tensor:
    return x[:, :, p.local : p.local + p.length]


def _empty_merge(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output (B, H, N/P, Dv) and lse (B, H, N/P) before any step: zeros and −inf,
    in float32, or float64 for float64 inputs."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, heads, local, _ = q.shape
    out = q.new_zeros((batch, heads, local, v.shape[-1]), dtype=compute)
    return out, q.new_full((batch, heads, local), -math.inf, dtype=compute)


def _backward_inputs(
    out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse with −inf as 0) and (dOut, dLse) in the merge's dtype, for :func:`_grad_step`."""
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return (out, safe_lse), (grad_out.to(out.dtype), grad_lse.to(out.dtype))


def _attend_step(
    ring: _Ring,
    step: int,
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge the pairs of ring step ``step`` (this rank's query rows against the key/value
    block ``kv``) into ``out`` and ``lse``, in place, in their dtype."""
    for qp, kp, rule in ring.steps[step]:
        part, part_lse = _pair(ring, rule, _rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp))
        o, s = _merge(_rows(out, qp), _rows(lse, qp), part.to(out.dtype), part_lse.to(out.dtype))
        out[:, :, qp.local : qp.local + qp.length] = o
        lse[:, :, qp.local : qp.local + qp.length] = s


def _grad_step(
    ring: _Ring,
    step: int,
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    saved: tuple[torch.Tensor, torch.Tensor],
    grads: tuple[torch.Tensor, torch.Tensor],
    dq: torch.Tensor,
    dkv: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Add the gradients of ring step ``step``'s pairs: to ``dq`` for this rank's rows and to
    ``dkv`` for the rows of the key/value block ``kv``. ``saved`` is (out, lse with −inf
    as 0), ``grads`` is (dOut, dLse)."""
    for qp, kp, rule in ring.steps[step]:
        dq_p, dk_p, dv_p = _pair_grads(
            ring,
            rule,
            (_rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp)),
            (_rows(saved[0], qp), _rows(saved[1], qp)),
            (_rows(grads[0], qp), _rows(grads[1], qp)),
        )
        dq[:, :, qp.local : qp.local + qp.length] += dq_p
        dkv[0][:, :, kp.local : kp.local + kp.length] += dk_p
        dkv[1][:, :, kp.local : kp.local + kp.length] += dv_p


class _RingFunction(torch.autograd.Function):
    """The ring forward and its ring backward (dK/dV travel home)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: _Ring,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _empty_merge(q, v)
        held = (k.contiguous(), v.contiguous())
        spare = [torch.empty_like(held[0]), torch.empty_like(held[1])]
        for step in range(ring.last + 1):
            work: list[dist.Work] = []
            incoming = spare
            if step < ring.last:
                work = _exchange(list(held), ring, incoming)
            _attend_step(ring, step, q, held, out, lse)
            for w in work:
                w.wait()
            if work:
                # the block just sent becomes the next receive buffer (never the caller's)
                sent = list(held)
                held = (incoming[0], incoming[1])
                spare = sent if step > 0 else [torch.empty_like(sent[0]), torch.empty_like(sent[1])]
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        compute = out.dtype
        saved, grads = _backward_inputs(out, lse, grad_out, grad_lse)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        held = (k.contiguous(), v.contiguous())
        acc = [torch.zeros(x.shape, dtype=compute, device=x.device) for x in (k, v)]
        for step in range(ring.last + 1):
            incoming = [torch.empty_like(held[0]), torch.empty_like(held[1])]
            work = _exchange(list(held), ring, incoming) if step < ring.last else []
            _grad_step(ring, step, q, held, saved, grads, dq, (acc[0], acc[1]))
            for w in work:
                w.wait()
            # the accumulators follow their block one hop; after the last step, they go
            # straight home: the block held at step s belongs to the rank s hops behind
            hops = 1 if step < ring.last else -step
            if hops % ring.size:
                arrived = [torch.empty_like(acc[0]), torch.empty_like(acc[1])]
                for w in _exchange(acc, ring, arrived, hops=hops):
                    w.wait()
                acc = arrived
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
        ring: _Ring,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _empty_merge(q, v)
        keys, values = _gather(k, ring), _gather(v, ring)
        for step in range(ring.last + 1):
            src = (ring.rank - step) % ring.size
            _attend_step(ring, step, q, (keys[src], values[src]), out, lse)
        ctx.ring = ring
        ctx.save_for_backward(q, out, lse, torch.stack(keys), torch.stack(values))
        return out.to(q.dtype), lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, out, lse, keys, values = ctx.saved_tensors
        ring: _Ring = ctx.ring
        compute = out.dtype
        saved, grads = _backward_inputs(out, lse, grad_out, grad_lse)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        # every rank's contribution to every block; the all-reduce sums them
        acc = [torch.zeros(x.shape, dtype=compute, device=x.device) for x in (keys, values)]
        for step in range(ring.last + 1):
            src = (ring.rank - step) % ring.size
            kv = (keys[src], values[src])
            _grad_step(ring, step, q, kv, saved, grads, dq, (acc[0][src], acc[1][src]))
        if ring.size > 1:
            for a in acc:
                dist.all_reduce(a, group=ring.group)
        dk, dv = acc[0][ring.rank], acc[1][ring.rank]
        return dq.to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), None


def _ulysses(
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


def _gather(x: torch.Tensor, ring: _Ring) -> list[torch.Tensor]:
    """Every rank's block of ``x``, indexed by rank in the group (a new tensor each)."""
    part = x.detach().contiguous()
    if ring.size == 1:
        return [part.clone()]
    blocks = [torch.empty_like(part) for _ in range(ring.size)]
    dist.all_gather(blocks, part, group=ring.group)
    return blocks


def _pair_grads(
    ring: _Ring,
    rule: Mask | None,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    merged: tuple[torch.Tensor, torch.Tensor],
    grads: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV of one pair, from the gradients of the merged output and log-sum-exp.

    With out = Σ_j w_j · o_j and lse = log Σ_j exp(lse_j), w_j = exp(lse_j − lse): the
    gradient of o_j is w_j · dOut, that of lse_j is w_j · (dLse + Σ_d dOut · (o_j − out)).
    """
    out, lse = merged
    grad_out, grad_lse = grads
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        part, part_lse = _pair(ring, rule, leaves[0], leaves[1], leaves[2])
        weight = torch.exp(part_lse.to(lse.dtype) - lse)
        g_part = grad_out * weight.unsqueeze(-1)
        g_lse = weight * (grad_lse + (grad_out * (part.to(out.dtype) - out)).sum(-1))
        found = torch.autograd.grad(
            (part, part_lse), leaves, (g_part.to(part.dtype), g_lse.to(part_lse.dtype))
        )
    return tuple(g.to(lse.dtype) for g in found)


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    named = (("q", q), ("k", k), ("v", v))
    for name, x in named:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.dtype not in _FLOATS:
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


def _max_over_ranks(value: int, group: Any) -> int:
    """The largest ``value`` over the ranks of ``group``."""
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _check_same_on_every_rank(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: int, group: Any
) -> None:
    """Raise the same one-line error on every rank when the shards' shapes or dtypes differ
    between ranks (a ring with mismatched blocks would hang or read garbage)."""
    if size == 1:
        return
    mine = torch.tensor([*q.shape, *k.shape, v.shape[-1], _FLOATS.index(q.dtype)], dtype=torch.long)
    every = [torch.empty_like(mine) for _ in range(size)]
    backend = dist.get_backend(group)
    device = q.device if backend == "nccl" else torch.device("cpu")
    gathered = [t.to(device) for t in every]
    dist.all_gather(gathered, mine.to(device), group=group)
    rows = [tuple(int(x) for x in t.cpu()) for t in gathered]
    if len(set(rows)) > 1:
        shapes = "; ".join(f"rank {r}: q {row[:4]}, k {row[4:8]}" for r, row in enumerate(rows))
        raise ValueError(
            f"the shards differ between ranks ({shapes}). Hint: every rank must pass shards "
            "of one shape and dtype, from qkv.distributed.shard on the same full tensors."
        )
