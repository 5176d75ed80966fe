"""The forward pass of the tiled kernel: each query block runs once over its key blocks.

For every row it keeps the running maximum m of its scores, the running sum l of
exp(score − m) and the running sum of exp(score − m)·v; a block that raises the maximum
from m to m' rescales the old sums by exp(m − m'). The result is exactly softmax(S')·V,
and the log-sum-exp ``lse = m + log l`` of each row is kept for the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qkv.kernels._blockwise import (
    LN2,
    NEG_INF,
    Buffers,
    Group,
    Indices,
    Problem,
    block_scores,
    blocks_of,
    dropout_block,
    kv_block,
    nonfinite,
    put_back_nonfinite,
    query_block,
    split_groups,
)
from qkv.kernels._threads import run_tasks

__all__ = ["attention_forward"]


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    problem: Problem,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context (B, H, Lq, Dv) and log-sum-exp (B, H, Lq) of checked, contiguous tensors.

    Each query block is one task (:func:`qkv.kernels._threads.run_tasks`); it writes only
    its own rows of the output.
    """
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len, dim_v = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((batch, heads, q_len, dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, q_len), dtype=q.dtype, device=q.device)
    grouped_out = out.view(batch, kv_heads, heads // kv_heads, q_len, dim_v)
    grouped_lse = lse.view(batch, kv_heads, heads // kv_heads, q_len)
    special = nonfinite(v) if problem.masked else None
    tasks: list[tuple[int, Callable[[Buffers], None]]] = []
    for group in split_groups(q, k, v, bias, problem):
        index = Indices(group, heads, q_len, kv_len)
        g = slice(group.start, group.start + group.q.shape[0])
        values = group.v if special is None else special.clean[g]
        hits = None if special is None else special.hits[g]
        for q0, q1, keys in blocks_of(group.kinds, problem.plan, q_len, kv_len):

            def task(
                buffers: Buffers,
                group: Group = group,
                index: Indices = index,
                values: torch.Tensor = values,
                hits: torch.Tensor | None = hits,
                g: slice = g,
                q0: int = q0,
                q1: int = q1,
                keys: list[tuple[int, int, int]] = keys,
            ) -> None:
                context, row_lse = _forward_rows(
                    problem, group, index, values, hits, q0, q1, keys, buffers
                )
                rows_out = grouped_out[g, :, :, q0:q1]
                rows_out.copy_(context.view(rows_out.shape))
                rows_lse = grouped_lse[g, :, :, q0:q1]
                rows_lse.copy_(row_lse.view(rows_lse.shape))

            tasks.append((len(keys), task))
    # The longest tasks first: the threads then finish together (causal rows differ in length).
    ordered = [task for _, task in sorted(tasks, key=lambda pair: -pair[0])]
    run_tasks(ordered, Buffers, on_cpu=q.device.type == "cpu")
    return out, lse


def _forward_rows(
    problem: Problem,
    group: Group,
    index: Indices,
    values: torch.Tensor,
    hits: torch.Tensor | None,
    q0: int,
    q1: int,
    keys: list[tuple[int, int, int]],
    buffers: Buffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query block against its key blocks: (context, lse) rows (Bg·Hkv, G·bq, ·)."""
    kv_heads = group.k.shape[1]
    q_block = query_block(group.q, kv_heads, q0, q1, problem.scale * problem.units)
    rows = q_block.shape[1]
    like = q_block
    row_max = torch.full((group.rows, rows, 1), NEG_INF, dtype=like.dtype, device=like.device)
    row_sum = torch.zeros((group.rows, rows, 1), dtype=like.dtype, device=like.device)
    acc = torch.zeros((group.rows, rows, values.shape[3]), dtype=like.dtype, device=like.device)
    reach = None if hits is None else acc.new_zeros((group.rows, rows, hits.shape[3]))
    drop_scale = 1.0 / (1.0 - problem.dropout_p)
    for k0, k1, kind in keys:
        out = buffers.get((group.rows, rows, k1 - k0), like)
        found = block_scores(problem, group, index, q_block, (q0, q1, k0, k1), kind, out)
        if found is None:
            continue
        new_max = torch.maximum(row_max, found.values.amax(dim=-1, keepdim=True))
        shift = new_max
        if problem.masked:  # a row with no allowed key yet: shift by 0, not by −inf
            shift = new_max.masked_fill(new_max == NEG_INF, 0.0)
        scores = found.exp_(shift)  # the unnormalised weights p = exp(s − m), in place
        rescale = torch.exp2(row_max - shift) if problem.base2 else torch.exp(row_max - shift)
        # l ← l · exp(m − m') + Σ p;  acc ← acc · exp(m − m') + p·V
        torch.addcmul(scores.sum(dim=-1, keepdim=True), row_sum, rescale, out=row_sum)
        acc.mul_(rescale)
        if problem.keep is not None:
            keep = dropout_block(problem, index, (q0, q1, k0, k1))
            scores.view(keep.shape[0], -1, q1 - q0, k1 - k0).mul_(keep)
            acc.baddbmm_(scores, group.values(values, k0, k1), alpha=drop_scale)
        else:
            acc.baddbmm_(scores, group.values(values, k0, k1))
        if reach is not None and hits is not None:
            reach.baddbmm_((scores > 0).to(scores.dtype), kv_block(hits, k0, k1))
        row_max = new_max
    empty = row_sum == 0
    context = acc / row_sum.masked_fill(empty, 1.0)
    if problem.base2:  # back to natural units
        row_lse = ((row_max + torch.log2(row_sum)) * LN2).squeeze(-1)
    else:
        row_lse = (row_max + torch.log(row_sum)).squeeze(-1)
    if reach is not None:
        context = put_back_nonfinite(context, reach)
    return context, row_lse
