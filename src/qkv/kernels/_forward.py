"""The forward pass of the tiled kernel: each query block runs once over its key blocks.

For every row it keeps the sum l of its weights p = exp(score − m) and the sum of p·v; the
result is exactly softmax(S')·V, and the log-sum-exp ``lse = m + log l`` of each row is kept
for the backward pass. The shift m is first held at 0, which needs no maximum and no
rescaling; rows whose scores sit too far from 0 for that (see :func:`_accumulate`) are done
again with the FlashAttention update, where m is each row's running maximum and a block that
raises it from m to m' rescales the old sums by exp(m − m').
"""

from __future__ import annotations

import math
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Context (B, H, Lq, Dv), log-sum-exp (B, H, Lq) and None, of checked, contiguous
    tensors; for a ``huge`` bias, the lse in two parts: (context, log l, m).

    Each query block is one task (:func:`qkv.kernels._threads.run_tasks`); it writes only
    its own rows of the output.
    """
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len, dim_v = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((batch, heads, q_len, dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, q_len), dtype=q.dtype, device=q.device)
    grouped_out = out.view(batch, kv_heads, heads // kv_heads, q_len, dim_v)
    grouped_lse = lse.view(batch, kv_heads, heads // kv_heads, q_len)
    maxima = torch.empty_like(lse) if problem.huge else None
    grouped_max = None if maxima is None else maxima.view(grouped_lse.shape)
    special = nonfinite(v) if problem.masks_keys else None
    tasks: list[tuple[int, Callable[[Buffers], None]]] = []
    for group in split_groups(q, k, v, bias, problem):
        index = Indices(group, heads, q_len, kv_len)
        g = slice(group.start, group.start + group.q.shape[0])
        values = group.v if special is None else special.clean[g]
        hits = None if special is None else special.hits[g]
        for q0, q1, keys in blocks_of(group.kinds, problem.plan, q_len, kv_len, group):

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
                rows_out = grouped_out[g, :, :, q0:q1]
                rows_lse = grouped_lse[g, :, :, q0:q1]
                dest = (rows_out, rows_lse)
                context, row_lse, row_max = _forward_rows(
                    problem, group, index, values, hits, q0, q1, keys, buffers, dest
                )
                if context is not rows_out:
                    rows_out.copy_(context.view(rows_out.shape))
                if row_lse is not rows_lse:
                    rows_lse.copy_(row_lse.view(rows_lse.shape))
                if grouped_max is not None and row_max is not None:
                    rows_max = grouped_max[g, :, :, q0:q1]
                    rows_max.copy_(row_max.view(rows_max.shape))

            tasks.append((sum(k1 - k0 for k0, k1, _ in keys), task))
    # The longest tasks first: the threads then finish together (causal rows differ in length).
    ordered = [task for _, task in sorted(tasks, key=lambda pair: -pair[0])]
    run_tasks(ordered, Buffers, on_cpu=q.device.type == "cpu")
    return out, lse, maxima


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
    dest: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One query block against its key blocks: (context, lse, None) rows (Bg·Hkv, G·bq, ·);
    for a ``huge`` bias (context, log l, m). ``dest`` is the block's rows of the output and
    of the lse, (Bg, Hkv, G, bq, Dv) and (Bg, Hkv, G, bq): the context, and the lse when it
    can be, are written there and returned as those tensors (no copy).

    First with the shift fixed at 0 (:func:`_accumulate`), which fails only for rows whose
    scores are far from 0 (or masked whole); those blocks run again with the running max.
    """
    kv_heads = group.k.shape[1]
    q_block = query_block(group.q, kv_heads, q0, q1, problem.scale * problem.units)
    block = (group, index, values, q_block, q0, q1, keys, buffers, dest)
    if hits is None:  # non-finite values need the weights of every allowed key positive
        found = _accumulate(problem, *block, None, running_max=False)
        if found is not None:
            return found
    result = _accumulate(problem, *block, hits, running_max=True)
    assert result is not None  # the running max never gives up
    return result


def _accumulate(
    problem: Problem,
    group: Group,
    index: Indices,
    values: torch.Tensor,
    q_block: torch.Tensor,
    q0: int,
    q1: int,
    keys: list[tuple[int, int, int]],
    buffers: Buffers,
    dest: tuple[torch.Tensor, torch.Tensor],
    hits: torch.Tensor | None,
    *,
    running_max: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The online softmax over the key blocks: (context, lse, None) rows, or None; for a
    ``huge`` bias (context, log l, m), with lse = m + log l.

    With ``running_max``, the FlashAttention update: each row's scores are shifted by their
    running maximum m, and a block that raises it to m' rescales the sums by exp(m − m').
    Without, the shift stays 0 (the weights are exp(s) themselves, no max, no rescaling:
    three fewer passes over each block). That is exact while every row's sum of weights l
    stays within [2⁻⁶⁰, 2¹⁰⁰]: no weight overflows, and a weight that underflows is below
    2⁻⁶⁶ of the row's largest. Otherwise (or if the context overflows) it returns None,
    checked after the first block and at the end.
    """
    rows = q_block.shape[1]
    like = q_block
    row_max = torch.full((group.rows, rows, 1), NEG_INF, dtype=like.dtype, device=like.device)
    row_sum = torch.zeros((group.rows, rows, 1), dtype=like.dtype, device=like.device)
    acc = torch.zeros((group.rows, rows, values.shape[3]), dtype=like.dtype, device=like.device)
    reach = None if hits is None else acc.new_zeros((group.rows, rows, hits.shape[3]))
    drop_scale = 1.0 / (1.0 - problem.dropout_p)
    exp = torch.exp2 if problem.base2 else torch.exp
    far = group.bias is not None or problem.score_mod is not None  # scores may be ≪ 0
    first = True
    for k0, k1, kind in keys:
        out = buffers.get((group.rows, rows, k1 - k0), like)
        found = block_scores(problem, group, index, q_block, (q0, q1, k0, k1), kind, out)
        if found is None:
            continue
        if running_max:
            new_max = torch.maximum(row_max, found.values.amax(dim=-1, keepdim=True))
            # A row of only −inf so far (masked, or a −inf bias): shift by 0, not by −inf.
            shift = new_max.masked_fill(new_max == NEG_INF, 0.0)
            scores = found.exp_(shift)  # the unnormalised weights p = exp(s − m), in place
            rescale = exp(row_max - shift)
            # l ← l · exp(m − m') + Σ p;  acc ← acc · exp(m − m') + p·V
            torch.addcmul(scores.sum(dim=-1, keepdim=True), row_sum, rescale, out=row_sum)
            acc.mul_(rescale)
            row_max = new_max
        else:
            scores = found.exp_unshifted_(floor=far)
            block_sum = scores.sum(dim=-1, keepdim=True)
            if first and not bool(block_sum.amax() <= _MOST):  # large scores: give up early
                return None
            row_sum.add_(block_sum)
        first = False
        if problem.keep is not None:
            keep = dropout_block(problem, index, (q0, q1, k0, k1))
            scores.view(keep.shape[0], -1, q1 - q0, k1 - k0).mul_(keep)
            acc.baddbmm_(scores, group.values(values, k0, k1), alpha=drop_scale)
        else:
            acc.baddbmm_(scores, group.values(values, k0, k1))
        if reach is not None and hits is not None:
            reach.baddbmm_((scores > 0).to(scores.dtype), kv_block(hits, k0, k1))
    dest_out, dest_lse = dest
    if not running_max:
        low, high = torch.aminmax(row_sum)
        # A sum over acc is finite if acc is (one pass, unlike isfinite); if it overflows,
        # the running max merely runs needlessly. NaN fails every comparison.
        if not (float(low) >= _LEAST and float(high) <= _MOST):
            return None
        if not math.isfinite(float(acc.sum())):
            return None
        # m = 0: the weights were e^s (2^(s·log2 e) in log2 units), so lse = ln l; l ≥ 2⁻⁶⁰.
        context = _divide(acc, row_sum, dest_out, reach)
        log_sum = torch.log(row_sum.view(dest_lse.shape), out=dest_lse)
        return context, log_sum, (torch.zeros_like(log_sum) if problem.huge else None)
    # A row whose scores are all −inf (a −inf bias on every allowed key): its weights are 0,
    # as in the reference (exp of the floor left them tiny but positive).
    dead = row_max == NEG_INF
    row_sum.masked_fill_(dead, 0.0)
    acc.masked_fill_(dead, 0.0)
    if reach is not None:
        reach.masked_fill_(dead, 0.0)
    context = _divide(acc, row_sum.masked_fill(row_sum == 0, 1.0), dest_out, reach)
    if problem.huge:  # natural units; m apart from log l (m + log l would lose log l)
        kept = row_max.masked_fill(dead, 0.0)
        return context, torch.log(row_sum).squeeze(-1), kept.squeeze(-1)
    if problem.base2:  # back to natural units
        row_lse = ((row_max + torch.log2(row_sum)) * LN2).squeeze(-1)
    else:
        row_lse = (row_max + torch.log(row_sum)).squeeze(-1)
    return context, row_lse, None


def _divide(
    acc: torch.Tensor, row_sum: torch.Tensor, dest: torch.Tensor, reach: torch.Tensor | None
) -> torch.Tensor:
    """acc / l, (Bg·Hkv, G·bq, Dv) by (Bg·Hkv, G·bq, 1): straight into ``dest``, the block's
    rows of the output (Bg, Hkv, G, bq, Dv), unless non-finite values are put back."""
    if reach is not None:
        return put_back_nonfinite(acc / row_sum, reach)
    shape = (*dest.shape[:-1], 1)
    return torch.div(acc.view(dest.shape), row_sum.view(shape), out=dest)


_LEAST = 2.0**-60
_MOST = 2.0**100
