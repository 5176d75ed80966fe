"""One step of ring attention: which pairs to compute, the exchange, the merge, the gradients.

A rank's shard is a list of pieces (runs of global positions, :mod:`._layout`). At ring step
s, rank r holds the key/value block of rank (r − s) mod P; a step computes each (query
piece, key piece) pair that the mask rule's block structure does not prove empty, with the
rule seen from the pieces' global positions, and merges the partial outputs through their
log-sum-exp in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed._layout import Piece, pieces
from qkv.distributed._profile import Clock, current
from qkv.kernels._api import run_tiled
from qkv.masks import EMPTY, Mask

__all__ = [
    "Ring",
    "attend_step",
    "backward_inputs",
    "empty_merge",
    "exchange",
    "grad_step",
    "move",
]

Pair = tuple[Piece, Piece, Mask | None]


class Ring:
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
        self.steps: list[list[Pair]] = []
        self.busy: list[int] = []  # the steps with work on some rank (agreed by all ranks)

    def plan_steps(self, plan: tuple[Piece, ...], batch: int, heads: int) -> list[bool]:
        """Find the pairs each step computes on this rank; returns which steps have any."""
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
        return [bool(work) for work in self.steps]

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
        return base.block_bounds(
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


def exchange(
    tensors: list[torch.Tensor], ring: Ring, into: list[torch.Tensor], hops: int = 1
) -> list[dist.Work]:
    """Start sending ``tensors`` to the rank ``hops`` ahead on the ring and receiving those of
    the rank ``hops`` behind into ``into``; returns the requests to wait on."""
    profile = current()
    if profile is not None:
        profile.exchanges += 1
    nxt, prev = ring.peer(hops), ring.peer(-hops)
    ops = [dist.P2POp(dist.isend, t, nxt, ring.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prev, ring.group) for t in into]
    return list(dist.batch_isend_irecv(ops))


def wait(work: list[dist.Work], device: torch.device) -> None:
    """Wait for the requests; the time counts as exposed communication when profiling."""
    with Clock(current(), "wait", device):
        for w in work:
            w.wait()


def move(tensors: list[torch.Tensor], ring: Ring, hops: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensors`` of the rank ``hops`` behind, in new buffers (a blocking exchange)."""
    arrived = [torch.empty_like(t) for t in tensors]
    wait(exchange(tensors, ring, arrived, hops=hops), tensors[0].device)
    return arrived[0], arrived[1]


def _merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys, merged through their log-sum-exp."""
    new = torch.logaddexp(lse, part_lse)
    ref = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    kept = out * torch.exp(lse - ref).unsqueeze(-1)
    return kept + part * torch.exp(part_lse - ref).unsqueeze(-1), new


def _pair(
    ring: Ring, rule: Mask | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
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


def empty_merge(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output (B, H, N/P, Dv) and lse (B, H, N/P) before any step: zeros and −inf,
    in float32, or float64 for float64 inputs."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, heads, local, _ = q.shape
    out = q.new_zeros((batch, heads, local, v.shape[-1]), dtype=compute)
    return out, q.new_full((batch, heads, local), -math.inf, dtype=compute)


def backward_inputs(
    out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse with −inf as 0) and (dOut, dLse) in the merge's dtype, for :func:`grad_step`."""
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return (out, safe_lse), (grad_out.to(out.dtype), grad_lse.to(out.dtype))


def attend_step(
    ring: Ring,
    step: int,
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge the pairs of ring step ``step`` (this rank's query rows against the key/value
    block ``kv``) into ``out`` and ``lse``, in place, in their dtype."""
    profile = current()
    with Clock(profile, "compute", q.device):
        for qp, kp, rule in ring.steps[step]:
            part, part_lse = _pair(ring, rule, _rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp))
            o, s = _merge(
                _rows(out, qp), _rows(lse, qp), part.to(out.dtype), part_lse.to(out.dtype)
            )
            out[:, :, qp.local : qp.local + qp.length] = o
            lse[:, :, qp.local : qp.local + qp.length] = s
    if profile is not None:
        profile.pairs += len(ring.steps[step])


def grad_step(
    ring: Ring,
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
    with Clock(current(), "compute", q.device):
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


def _pair_grads(
    ring: Ring,
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
