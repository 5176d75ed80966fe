"""The forward pass of the tiled kernel: each query block runs once over its key blocks.

For every row it keeps the sum l of its weights p = exp(score − m) and the sum of p·v; the
result is exactly softmax(S')·V, and the log-sum-exp ``lse = m + log l`` of each row is kept
for the backward pass, with m and 1/l. The shift m is first held fixed (at 0, or at a
row's score when its scores in the first key block are all equal), which needs no maximum
and no rescaling; rows whose scores sit too far from it (see :func:`_accumulate`) are done
again with the FlashAttention update, where m is each row's running maximum and a block
that raises it from m to m' rescales the old sums by exp(m − m').
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv.kernels._block_scores import RowShift, block_scores, dropout_block, level_rows
from qkv.kernels._blockwise import (
    LN2,
    NEG_INF,
    Buffers,
    Group,
    Indices,
    Problem,
    blocks_of,
    kv_block,
    nonfinite,
    put_back_nonfinite,
    query_block,
    split_groups,
)
from qkv.kernels._threads import run_tasks
from qkv.masks import FULL

__all__ = ["attention_forward"]

SUMS_IN_PRODUCTS = 16
"""The fewest queries of a call for which the forward pass appends a column of ones to the
values when it does (see :func:`constant_column`): a copy of V, O(Lk · Dv), against
O(Lq · Lk · D) of work; one decoding step (Lq = 1) would pay for the copy as much as for
its attention."""


@dataclass(frozen=True)
class _Dest:
    """A query block's rows of the results, written in place: the context (Bg, Hkv, G, bq, Dv),
    and the lse, shift m and 1/l (Bg, Hkv, G, bq) each (views of the call's tensors)."""

    out: torch.Tensor
    lse: torch.Tensor
    shift: torch.Tensor
    inverse: torch.Tensor


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    problem: Problem,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(context, lse, shift, inverse sum) of checked, contiguous tensors: the context
    (B, H, Lq, Dv); each row's natural log-sum-exp (B, H, Lq); and what the backward pass
    makes the weights from, each row's shift m (in the units of the scores, see
    :attr:`Problem.units`) and 1/l (0 for a row with no allowed key), (B, H, Lq) each: a
    weight is exp(s − m) · (1/l), exactly 1/L in a row of L equal scores, as the reference
    has it (exp(s − lse) rounds log L).

    Each query block is one task (:func:`qkv.kernels._threads.run_tasks`); it writes only
    its own rows of the results.
    """
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len, dim_v = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((batch, heads, q_len, dim_v), dtype=q.dtype, device=q.device)
    rows = torch.empty((3, batch, heads, q_len), dtype=q.dtype, device=q.device)
    lse, shift, inverse = rows  # one allocation, three views
    grouped_out = out.view(batch, kv_heads, heads // kv_heads, q_len, dim_v)
    grouped_rows = rows.view(3, batch, kv_heads, heads // kv_heads, q_len)
    special = nonfinite(v) if problem.masks_keys else None
    given = v if special is None else special.clean
    if problem.keep is None and q_len >= SUMS_IN_PRODUCTS and constant_column(given):
        given = torch.cat([given, given.new_ones((*given.shape[:3], 1))], dim=3)
    tasks: list[tuple[int, Callable[[Buffers], None]]] = []
    for group in split_groups(q, k, v, bias, problem):
        index = Indices(group, heads, q_len, kv_len)
        g = slice(group.start, group.start + group.q.shape[0])
        values = given[g]
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
                dest = _Dest(grouped_out[g, :, :, q0:q1], *grouped_rows[:, g, :, :, q0:q1])
                _forward_rows(problem, group, index, values, hits, q0, q1, keys, buffers, dest)

            tasks.append((sum(k1 - k0 for k0, k1, _ in keys), task))
    # The longest tasks first: the threads then finish together (causal rows differ in length).
    ordered = [task for _, task in sorted(tasks, key=lambda pair: -pair[0])]
    run_tasks(ordered, Buffers, on_cpu=q.device.type == "cpu")
    return out, lse, shift, inverse


def constant_column(values: torch.Tensor) -> bool:
    """Whether some column of ``values`` (B, Hkv, Lk, Dv) holds one number at every key, for
    some batch element and head (all-ones values, a constant feature): then the forward
    pass sums each row's l in the same products as its context, so that such a column of
    the context comes out exactly as that number wherever the reference's does (values of
    1: exactly 1). One look at the first and last keys, and a whole pass only where they
    agree.

    Example:
        >>> constant_column(torch.ones(1, 2, 5, 3)), constant_column(torch.rand(1, 2, 5, 3))
        (True, False)
    """
    first = values[:, :, :1]
    if not bool((values[:, :, -1:] == first).any()):
        return False
    return bool((values == first).all(dim=2).any())


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
    dest: _Dest,
) -> None:
    """One query block against its key blocks: its rows of the context, lse, m and 1/l,
    written into ``dest``.

    First with a fixed shift (:func:`_accumulate`), which fails only for rows whose scores
    are far from it (or masked whole); those blocks run again with the running max.
    """
    kv_heads = group.k.shape[1]
    q_block = query_block(group.q, kv_heads, q0, q1, problem.scale * problem.units)
    block = (group, index, values, q_block, q0, q1, keys, buffers, dest)
    # Non-finite values need the weights of every allowed key positive: the running max.
    if hits is None and _accumulate(problem, *block, None, running_max=False):
        return
    done = _accumulate(problem, *block, hits, running_max=True)
    assert done  # the running max never gives up


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
    dest: _Dest,
    hits: torch.Tensor | None,
    *,
    running_max: bool,
) -> bool:
    """The online softmax over the key blocks, its rows written into ``dest`` with
    lse = m + log l in natural units (m is in the units of the scores); False if it gave
    up (then ``dest`` holds nothing of use).

    With ``running_max``, the FlashAttention update: each row's scores are shifted by their
    running maximum m, and a block that raises it to m' rescales the sums by exp(m − m').
    Without, m stays fixed: no maximum of each block and no rescaling. It is 0 (the weights
    are exp(s) themselves: not even a subtraction), except in the rows whose scores in the
    first key block are all equal (:func:`~qkv.kernels._block_scores.level_rows`): there it
    is that score, so that such a row gets weights of exactly 1, as in the reference
    (exp(s) of equal scores rounds, and the context missed by 1e-6). That is exact while
    every row's sum of weights l stays within [2⁻⁶⁰, 2¹⁰⁰]: no weight overflows, and a
    weight that underflows is below 2⁻⁶⁶ of the row's largest. Otherwise (or if the
    context overflows) it gives up, checked after the first block and at the end.

    l is summed block by block (with dropout it counts the weights before dropping), one
    pass over each block; but when ``values`` carry a last column of ones
    (:func:`constant_column`), l is that column of acc, summed by the same matrix products
    in the same order as the context: a row whose values are all 1 gets exactly 1 (acc / l)
    whatever its scores, and the backward pass's Δ = dO·O is exact there (dQ of all-ones
    inputs is exactly 0 under any bias). That column costs about a fifth of the product
    with the values (its width is no longer a multiple of the kernel's tile), so it is
    carried only where it can matter.
    """
    rows = q_block.shape[1]
    like = q_block
    row_max = torch.full((group.rows, rows, 1), NEG_INF, dtype=like.dtype, device=like.device)
    acc = torch.zeros((group.rows, rows, values.shape[3]), dtype=like.dtype, device=like.device)
    in_products = values.shape[3] > group.v.shape[3]  # l is acc's last column
    if in_products:
        row_sum, context_sums = acc[..., -1:], acc[..., :-1]
    else:
        row_sum, context_sums = torch.zeros_like(row_max), acc
    reach = None if hits is None else acc.new_zeros((group.rows, rows, hits.shape[3]))
    drop_scale = 1.0 / (1.0 - problem.dropout_p)
    exp = torch.exp2 if problem.base2 else torch.exp
    first = True
    # Without running_max: the shift, fixed for the query block, decided on its first block
    # with a score for some row (level_rows): None is a shift of 0 for every row.
    decided = False
    fixed: RowShift | None = None
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
            # l ← l · exp(m − m') + Σ p;  acc ← acc · exp(m − m') + p·V (l: acc's column)
            if not in_products:
                row_sum.mul_(rescale).add_(scores.sum(dim=-1, keepdim=True))
            acc.mul_(rescale)
            row_max = new_max
        else:
            if not decided:
                level = level_rows(found.values, unmasked=kind == FULL and not found.far)
                if level is False:  # every weight 0; skipping the block gives the same bits
                    continue
                decided, fixed = True, (level if isinstance(level, RowShift) else None)
            scores = found.exp_fixed_(fixed)
            if not in_products:
                row_sum.add_(scores.sum(dim=-1, keepdim=True))
        if problem.keep is not None:
            keep = dropout_block(problem, index, (q0, q1, k0, k1))
            scores.view(keep.shape[0], -1, q1 - q0, k1 - k0).mul_(keep)
            acc.baddbmm_(scores, group.values(values, k0, k1), alpha=drop_scale)
        else:
            acc.baddbmm_(scores, group.values(values, k0, k1))
        if reach is not None and hits is not None:
            reach.baddbmm_((scores > 0).to(scores.dtype), kv_block(hits, k0, k1))
        # With a fixed shift, large scores may overflow: give up after the first block.
        if first and not running_max and not bool(row_sum.amax() <= _MOST):
            return False
        first = False
    rows_shape = dest.lse.shape
    if not running_max:
        low, high = torch.aminmax(row_sum)
        # A sum over acc is finite if acc is (one pass, unlike isfinite); if it overflows,
        # the running max merely runs needlessly. NaN fails every comparison.
        if not (float(low) >= _LEAST and float(high) <= _MOST):
            return False
        if not math.isfinite(float(acc.sum())):
            return False
        # The weights were e^(s − m) (2^(s − m) in log2 units): lse = m + ln l; l ≥ 2⁻⁶⁰.
        _divide(context_sums, row_sum, dest.out, reach)
        torch.reciprocal(row_sum.view(rows_shape), out=dest.inverse)
        torch.log(row_sum.view(rows_shape), out=dest.lse)
        if fixed is None:
            dest.shift.zero_()
        else:
            dest.shift.copy_(fixed.full(row_sum).view(rows_shape))
            dest.lse.add_(dest.shift, alpha=LN2 if problem.base2 else 1.0)
        return True
    # A row whose scores are all −inf (a −inf bias on every allowed key): its weights are 0,
    # as in the reference (exp of the floor left them tiny but positive).
    dead = row_max == NEG_INF
    acc.masked_fill_(dead, 0.0)  # l too, when it is acc's column
    row_sum.masked_fill_(dead, 0.0)
    if reach is not None:
        reach.masked_fill_(dead, 0.0)
    _divide(context_sums, row_sum.masked_fill(row_sum == 0, 1.0), dest.out, reach)
    dest.inverse.copy_(torch.where(row_sum > 0, torch.reciprocal(row_sum), 0.0).view(rows_shape))
    if problem.base2:  # back to natural units
        row_lse = (row_max + torch.log2(row_sum)) * LN2
    else:
        row_lse = row_max + torch.log(row_sum)
    dest.lse.copy_(row_lse.view(rows_shape))
    dest.shift.copy_(row_max.masked_fill(dead, 0.0).view(rows_shape))
    return True


def _divide(
    acc: torch.Tensor, row_sum: torch.Tensor, dest: torch.Tensor, reach: torch.Tensor | None
) -> None:
    """acc / l, (Bg·Hkv, G·bq, Dv) by (Bg·Hkv, G·bq, 1), into ``dest``, the block's rows of
    the output (Bg, Hkv, G, bq, Dv), with non-finite values put back (``reach``)."""
    if reach is not None:
        dest.copy_(put_back_nonfinite(acc / row_sum, reach).view(dest.shape))
        return
    shape = (*dest.shape[:-1], 1)
    torch.div(acc.view(dest.shape), row_sum.view(shape), out=dest)


_LEAST = 2.0**-60
_MOST = 2.0**100
