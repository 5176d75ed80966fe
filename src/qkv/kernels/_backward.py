"""The backward pass of the tiled kernel: each block's weights recomputed as exp(S' − m) / l.

With P = softmax(S'), O = P·V and the output's gradient dO:

    dV = Pᵀ·dO      dP = dO·Vᵀ      dS = P ∘ (dP − Δ),  Δ_i = Σ_j P_ij dP_ij = dO_i · O_i
    dQ = dS·K · scale               dK = dSᵀ·Q · scale

(with dropout, P is the kept-and-rescaled matrix in dV and dP is masked the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qkv.kernels._block_scores import block_scores, dropout_block
from qkv.kernels._blockwise import (
    LN2,
    Buffers,
    Group,
    Indices,
    Problem,
    columns_of,
    finite_or_zero,
    kv_block,
    nonfinite,
    row_block,
    split_groups,
)
from qkv.kernels._threads import run_tasks

__all__ = ["attention_backward"]


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    normaliser: tuple[torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    problem: Problem,
    need_bias_grad: bool,
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """dQ, dK, dV (and dBias), and the gradients of the tensors the score modifier captures
    (``captured``), by recomputing each block's weights as exp(S' − m) · (1/l), from
    ``normaliser`` = (m, 1/l) of each row, (B, H, Lq) each, as the forward pass made them
    (:func:`qkv.kernels._forward.attention_forward`).

    Each key block is one task: it owns its rows of dK and dV, and adds its share of dQ to
    a dQ of its thread's own, summed at the end. A captured tensor θ gets, block by block,
    Σ dS · ∂score_mod/∂θ (autograd on the block's modified scores, which exist only for
    that block): no (Lq, Lk) matrix is ever formed.
    """
    heads, q_len = q.shape[1], q.shape[2]
    kv_len = k.shape[2]
    grad_out = grad_out.contiguous()
    # Δ_i = Σ_j P_ij dP_ij = dO_i · O_i (minus dlse_i when the lse itself has a gradient).
    delta = (grad_out * out).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    shift, inverse = normaliser  # a fully masked row has 1/l = 0: weights 0
    # Most rows have m = 0 (the forward held the shift there): a query block subtracts its
    # rows' shifts only when one of them is not 0, a pass fewer over each block.
    shifted = torch.cumsum((shift != 0).any(dim=1).any(dim=0), dim=0).tolist()  # (Lq,)
    dk = torch.empty_like(k)  # every key block's task writes its rows (zeros if none)
    dv = torch.empty_like(v)
    shared_bias_grad = None
    if need_bias_grad and bias is not None:
        shared_bias_grad = torch.zeros(bias.shape, dtype=q.dtype, device=q.device)
    # A bias broadcast along the keys gets contributions from every key block: one each.
    private_bias = shared_bias_grad is not None and shared_bias_grad.shape[3] == 1
    special = nonfinite(v) if problem.masks_keys else None
    if problem.exact_masking:
        # A NaN query or key at a masked position has dS = 0 there, but 0 · NaN is NaN in
        # dQ = dS·K and dK = dSᵀ·Q: compute with the non-finite entries replaced by 0.
        q, k = (finite_or_zero(x) for x in (q, k))

    def new_state() -> _Scratch:
        return _Scratch(
            torch.zeros_like(q),
            torch.zeros_like(shared_bias_grad)
            if private_bias and shared_bias_grad is not None
            else shared_bias_grad,
            captured=captured,
            d_captured=[torch.zeros_like(t) for t in captured],
        )

    tasks: list[Callable[[_Scratch], None]] = []
    for group in split_groups(q, k, v, bias, problem):
        index = Indices(group, heads, q_len, kv_len)
        g = slice(group.start, group.start + group.q.shape[0])
        values = v[g] if special is None else special.clean[g]
        # The queries scaled once (each query block meets every key block).
        scaled = torch.mul(group.q, problem.scale * problem.units)
        rows = _RowData(grad_out[g], shift[g], inverse[g], delta[g], scaled, shifted)
        for k0, k1, queries in columns_of(group.kinds, problem.plan, q_len, kv_len, group):

            def task(
                scratch: _Scratch,
                group: Group = group,
                index: Indices = index,
                values: torch.Tensor = values,
                rows: _RowData = rows,
                g: slice = g,
                k0: int = k0,
                k1: int = k1,
                queries: list[tuple[int, int, int]] = queries,
            ) -> None:
                d_key, d_value = _backward_column(
                    problem, group, index, values, rows, k0, k1, queries, scratch
                )
                dk[g, :, k0:k1] = d_key.view(dk[g, :, k0:k1].shape)
                dv[g, :, k0:k1] = d_value.view(dv[g, :, k0:k1].shape)

            tasks.append(task)
    # In order, and thread t takes columns t, t + T, ...: each thread's dQ is summed in a
    # fixed order, so the gradients are the same to the bit from one call to the next (and
    # with or without block skipping, which only leaves out exact zeros). Alternate columns
    # also share the work of a causal mask evenly.
    states = run_tasks(tasks, new_state, on_cpu=q.device.type == "cpu", in_order=True)
    dq = states[0].dq
    for state in states[1:]:
        dq.add_(state.dq)
    dbias = shared_bias_grad
    if private_bias and dbias is not None:
        for state in states:
            if state.dbias is not None:
                dbias.add_(state.dbias)
    if problem.base2:
        dk.mul_(LN2)  # the query blocks carried a factor log2 e
    d_captured = [torch.zeros_like(t) for t in captured]
    for state in states:
        for total, part in zip(d_captured, state.d_captured, strict=True):
            total.add_(part)
    return dq, dk, dv, dbias, tuple(d_captured)


@dataclass
class _Scratch:
    """What one thread of the backward pass accumulates."""

    dq: torch.Tensor  # (B, H, Lq, D): this thread's share of dQ
    dbias: torch.Tensor | None  # the bias gradient (shared unless the bias spans the keys)
    buffers: Buffers = field(default_factory=Buffers)
    captured: tuple[torch.Tensor, ...] = ()  # tensors the score modifier captures
    d_captured: list[torch.Tensor] = field(default_factory=list)  # this thread's share


@dataclass
class _RowData:
    """Per-row tensors of one group: dO (Bg, H, Lq, Dv), the shift m, 1/l and Δ (Bg, H, Lq),
    and the queries times the scale (and log2 e), (Bg, H, Lq, D); ``shifted`` counts the
    query positions up to each one (inclusive) where some row of the call has m ≠ 0."""

    grad_out: torch.Tensor
    shift: torch.Tensor
    inverse: torch.Tensor
    delta: torch.Tensor
    scaled_q: torch.Tensor
    shifted: list[int]

    def shift_of(self, kv_heads: int, q0: int, q1: int) -> torch.Tensor | None:
        """The shifts of the rows q0:q1, (Bg·Hkv, G·bq, 1), or None when all are 0."""
        if self.shifted[q1 - 1] == (self.shifted[q0 - 1] if q0 > 0 else 0):
            return None
        return row_block(self.shift, kv_heads, q0, q1).unsqueeze(-1)


def _backward_column(
    problem: Problem,
    group: Group,
    index: Indices,
    values: torch.Tensor,
    rows: _RowData,
    k0: int,
    k1: int,
    queries: list[tuple[int, int, int]],
    scratch: _Scratch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One key block against its query blocks: its dK and dV, (Bg·Hkv, bk, ·); dQ and dBias
    are added to the thread's scratch."""
    batch, heads = group.q.shape[0], group.q.shape[1]
    kv_heads = group.k.shape[1]
    k_block, v_block = kv_block(group.k, k0, k1), kv_block(values, k0, k1)
    d_key = torch.zeros_like(k_block)
    d_value = torch.zeros_like(v_block)
    drop_scale = 1.0 / (1.0 - problem.dropout_p)
    grouped_dq = scratch.dq[group.start : group.start + batch].view(
        batch, kv_heads, heads // kv_heads, -1, group.q.shape[3]
    )
    for q0, q1, kind in queries:
        block = (q0, q1, k0, k1)
        q_block = row_block(rows.scaled_q, kv_heads, q0, q1)  # a view unless GQA
        d_out = row_block(rows.grad_out, kv_heads, q0, q1)  # (Bg·Hkv, G·bq, Dv)
        row_shift = rows.shift_of(kv_heads, q0, q1)
        row_inverse = row_block(rows.inverse, kv_heads, q0, q1).unsqueeze(-1)
        row_delta = row_block(rows.delta, kv_heads, q0, q1).unsqueeze(-1)
        out_buffer = scratch.buffers.get((group.rows, q_block.shape[1], k1 - k0), q_block)
        found = block_scores(
            problem,
            group,
            index,
            q_block,
            block,
            kind,
            out_buffer,
            keep_raw=problem.score_mod is not None,
        )
        if found is None:
            continue
        scores, raw = found.values, found.raw
        weights = found.exp_(row_shift, None if raw is None else scores.detach().clone())
        weights.mul_(row_inverse)  # P = exp(S' − m) / l
        d_weights = torch.bmm(d_out, v_block.transpose(1, 2))  # dP, (·, G·bq, bk)
        if problem.keep is not None:
            keep = dropout_block(problem, index, block)
            kept = weights.view(keep.shape[0], -1, q1 - q0, k1 - k0) * keep
            d_value.baddbmm_(kept.view(weights.shape).transpose(1, 2), d_out, alpha=drop_scale)
            d_weights.view(keep.shape[0], -1, q1 - q0, k1 - k0).mul_(keep)
            d_weights.mul_(drop_scale)
        else:
            d_value.baddbmm_(weights.transpose(1, 2), d_out)
        # dS = P ∘ (dP − Δ): 0 where masked (P = 0; V's NaN were replaced by 0).
        d_scores = d_weights.sub_(row_delta).mul_(weights)
        if raw is not None:
            wanted = (raw, *scratch.captured)
            grads = torch.autograd.grad(
                scores,
                wanted,
                d_scores.view(scores.shape),
                allow_unused=True,
                # a captured tensor computed from a leaf (slopes = log_slopes.exp()) shares
                # that computation with every block: keep its graph for the next one
                retain_graph=bool(scratch.captured),
            )
            d_raw = grads[0]
            assert d_raw is not None
            for total, part in zip(scratch.d_captured, grads[1:], strict=True):
                if part is not None:
                    total.add_(part)
            d_scores = d_raw.reshape(d_scores.shape)
        if scratch.dbias is not None:
            _add_bias_grad(scratch.dbias, d_scores, group, block, heads)
        target = grouped_dq[:, :, :, q0:q1]  # dQ += dS·K · scale, (Bg·Hkv, G·bq, D)
        if target.shape[2] == 1:  # one query head per key head: a view, added in place
            target.view(d_scores.shape[0], -1, target.shape[4]).baddbmm_(
                d_scores, k_block, alpha=problem.scale
            )
        else:
            target.add_(torch.bmm(d_scores, k_block).mul_(problem.scale).view(target.shape))
        d_key.baddbmm_(d_scores.transpose(1, 2), q_block)
    return d_key, d_value


def _add_bias_grad(
    dbias: torch.Tensor,
    d_scores: torch.Tensor,
    group: Group,
    block: tuple[int, int, int, int],
    heads: int,
) -> None:
    """Add one block of dS to the bias gradient, summed over the axes the bias broadcasts."""
    q0, q1, k0, k1 = block
    d = d_scores.view(group.q.shape[0], heads, q1 - q0, k1 - k0)
    if dbias.shape[1] == 1:
        d = d.sum(dim=1, keepdim=True)
    rows = slice(q0, q1) if dbias.shape[2] > 1 else slice(0, 1)
    cols = slice(k0, k1) if dbias.shape[3] > 1 else slice(0, 1)
    if dbias.shape[2] == 1:
        d = d.sum(dim=2, keepdim=True)
    if dbias.shape[3] == 1:
        d = d.sum(dim=3, keepdim=True)
    if dbias.shape[0] == 1:
        dbias[:, :, rows, cols] += d.sum(dim=0, keepdim=True)
    else:
        dbias[group.start : group.start + group.q.shape[0], :, rows, cols] += d
