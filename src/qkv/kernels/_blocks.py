"""The block plan of the tiled kernel: block sizes and which blocks of (Lq, Lk) to compute.

The (Lq, Lk) score matrix of each head is cut into blocks of ``block_q`` queries by
``block_kv`` keys. A mask with a block structure (:meth:`qkv.masks.Mask.blocks`) says which
blocks are empty (skipped: they cost nothing), partial (the mask is evaluated on the block)
or full (no mask evaluation). Without a structure every block is partial, and the kernel
still skips a block whose evaluated mask turns out empty.

The block sizes are chosen with a small cost model: each computed block costs its area
(matrix products and the softmax's elementwise work) plus a fixed overhead (several PyTorch
calls), so a sparse mask (a sliding window, many short documents) gets smaller blocks that
waste less area, a dense one larger blocks with fewer calls.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qkv.masks import EMPTY, FULL, PARTIAL, Mask

__all__ = ["BlockPlan", "plan_blocks"]

DEFAULT_BLOCK = 256
"""Queries and keys per block for dense and causal attention: 8 heads of 256 × 256 float32
scores are 2 MiB, the matrix products run near their peak, and a 4096-token sequence makes
16 query blocks to share among threads."""

_CANDIDATES = (64, 128, 256)

MAX_PLAN_BLOCKS = 1 << 24
"""The most blocks a plan may hold: (Lq / block_q) · (Lk / block_kv), times B for a mask made
per batch element. A plan keeps a byte per block and briefly several (the mask's structure,
evaluated on every block), so it is sized before anything is allocated: 2²⁴ blocks plan in a
few hundred MiB, and at blocks of 256 they hold 10¹² scores, hours of work on a CPU; a call
beyond is refused in one line (10⁷ tokens asked 22.7 GiB for the plan alone)."""
# The fixed cost of one block, in units of score elements (about 30 µs of PyTorch calls,
# against about 1.5 ns per score element for the products and the softmax, fitted to the
# times of 64, 128 and 256 blocks on a sliding window of 512 at N = 4096, one core), and
# the extra cost of a partial block (the mask is evaluated and applied).
_BLOCK_OVERHEAD = 30_000
_PARTIAL_COST = 1.3


@dataclass(frozen=True)
class BlockPlan:
    """Block sizes and the kind of every block.

    Attributes:
        block_q, block_kv: queries and keys per block.
        kinds: int8 (B or 1, nq, nk) of :data:`~qkv.masks.EMPTY`, :data:`~qkv.masks.PARTIAL`
            and :data:`~qkv.masks.FULL`, already combined over heads (a block is empty only
            when it is empty for every head). The batch axis has size B only when the
            structure differs between batch elements.
        structure: the kinds the mask's structure gives, when ``kinds`` differs from them
            (``skip=False``: every block is computed and its mask evaluated), else None.
            Runs (:func:`qkv.kernels._blockwise.blocks_of`) follow the structure, so the
            blocks are summed in the same groups with or without skipping, and the result
            is the same to the bit.
        runs: adjacent full blocks are computed as one run (one matrix product over
            them); False when the block sizes were given, so that exactly those blocks are
            computed.
    """

    block_q: int
    block_kv: int
    kinds: np.ndarray
    structure: np.ndarray | None = None
    runs: bool = True

    @property
    def per_batch(self) -> bool:
        return bool(self.kinds.shape[0] > 1)

    def computed(self) -> int:
        """How many blocks are computed (not empty), summed over the batch axis."""
        return int((self.kinds != EMPTY).sum())

    def kinds_for(self, batch_index: int) -> np.ndarray:
        """The (nq, nk) kinds for one batch element (or for all, when shared)."""
        kinds: np.ndarray = self.kinds[batch_index if self.per_batch else 0]
        return kinds

    def structure_for(self, batch_index: int) -> np.ndarray | None:
        """The (nq, nk) ``structure`` for one batch element, or None."""
        if self.structure is None:
            return None
        structure: np.ndarray = self.structure[batch_index if self.per_batch else 0]
        return structure


def plan_blocks(
    rule: Mask | None,
    *,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    heads_per_kv: int = 1,
    block_q: int | None = None,
    block_kv: int | None = None,
    skip: bool = True,
    dense_mask: bool = False,
) -> BlockPlan:
    """Choose block sizes and find the kind of every block.

    Args:
        rule: the mask rule (the user's mask and the causal rule combined), None if none.
        batch, heads, q_len, kv_len: B, H, Lq, Lk.
        heads_per_kv: H / Hkv (the queries of a group go through one matrix product, so a
            block holds this many times ``block_q`` rows).
        block_q, block_kv: fixed sizes; None to choose.
        skip: False to compute every block (the mask is then evaluated everywhere); the
            result is bit-identical, only slower.
        dense_mask: a boolean array is given as well: no block is known to be full.

    Plans are kept for the last :data:`_PLANS_KEPT` (mask, shape) pairs: a model calls the
    kernel with the same mask object and shapes in every layer and step, and the plan
    (three candidate block sizes, each the mask's structure over every block) cost about
    0.5 ms, 2 % of a 16-document call at N = 4,096. The kept arrays are read-only.
    """
    args = (batch, heads, q_len, kv_len, heads_per_kv, block_q, block_kv, skip, dense_mask)
    key = (None if rule is None else id(rule), *args)
    with _plans_lock:
        kept = _plans.get(key)
        if kept is not None and kept[0]() is rule:
            _plans.move_to_end(key)
            return kept[1]
    plan = _choose(rule, *args)
    for array in (plan.kinds, plan.structure):
        if array is not None:
            array.setflags(write=False)
    with _plans_lock:
        # A dead rule's id may be reused by a new one: the weak reference tells them apart.
        _plans[key] = ((lambda: None) if rule is None else weakref.ref(rule), plan)
        while len(_plans) > _PLANS_KEPT:
            _plans.popitem(last=False)
    return plan


_PLANS_KEPT = 64
_plans: OrderedDict[tuple[Any, ...], tuple[Any, BlockPlan]] = OrderedDict()
_plans_lock = threading.Lock()


def _choose(
    rule: Mask | None,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    heads_per_kv: int,
    block_q: int | None,
    block_kv: int | None,
    skip: bool,
    dense_mask: bool,
) -> BlockPlan:
    """The plan of :func:`plan_blocks`, computed."""
    copies = batch if rule is not None and rule.per_batch else 1
    if block_q is not None or block_kv is not None or rule is None or not rule.knows_blocks:
        bq = min(block_q or _default_rows(heads_per_kv), q_len)
        bk = min(block_kv or DEFAULT_BLOCK, kv_len)
        _check_plan_size(q_len, kv_len, [(bq, bk)], copies)
        args = (batch, heads, q_len, kv_len, bq, bk, skip, dense_mask)
        given = block_q is not None or block_kv is not None
        return replace(_plan(rule, *args), runs=not given)
    candidates = [
        (min(_rows_for(size, heads_per_kv), q_len), min(size, kv_len)) for size in _CANDIDATES
    ]
    best: tuple[float, BlockPlan] | None = None
    for bq, bk in _check_plan_size(q_len, kv_len, candidates, copies):
        # the sizes follow the structure, with or without skipping (the same runs, bits)
        plan = _plan(rule, batch, heads, q_len, kv_len, bq, bk, True, dense_mask)
        per_block = batch * heads * plan.block_q * plan.block_kv
        full = int((plan.kinds == FULL).sum()) * (batch if not plan.per_batch else 1)
        partial = int((plan.kinds == PARTIAL).sum()) * (batch if not plan.per_batch else 1)
        cost = full * (per_block + _BLOCK_OVERHEAD) + partial * (
            per_block * _PARTIAL_COST + _BLOCK_OVERHEAD
        )
        if best is None or cost < best[0]:
            best = (cost, plan)
    assert best is not None
    chosen = best[1]
    if skip:
        return chosen
    sizes = (chosen.block_q, chosen.block_kv)
    return _plan(rule, batch, heads, q_len, kv_len, *sizes, skip, dense_mask)


def _check_plan_size(
    q_len: int, kv_len: int, sizes: list[tuple[int, int]], copies: int
) -> list[tuple[int, int]]:
    """The block sizes whose plan holds at most :data:`MAX_PLAN_BLOCKS` blocks; none is a
    one-line ValueError with the count, before anything is allocated."""

    def count(bq: int, bk: int) -> int:
        return -(-q_len // max(bq, 1)) * -(-kv_len // max(bk, 1)) * copies

    fitting = [(bq, bk) for bq, bk in sizes if count(bq, bk) <= MAX_PLAN_BLOCKS]
    if not fitting:
        bq, bk = sizes[-1]
        raise ValueError(
            f"Lq = {q_len:,} and Lk = {kv_len:,} are too long for one call of the tiled "
            f"kernel: its plan would hold {count(bq, bk):,} blocks of {bq} × {bk} (at most "
            f"{MAX_PLAN_BLOCKS:,}). Hint: split the sequence across processes "
            "(qkv.distributed.ring_attention), or attend to shorter sequences."
        )
    return fitting


def _default_rows(heads_per_kv: int) -> int:
    return _rows_for(DEFAULT_BLOCK, heads_per_kv)


def _rows_for(size: int, heads_per_kv: int) -> int:
    """Query positions per block: fewer when a GQA group stacks several heads' rows."""
    return max(32, size // heads_per_kv)


def _plan(
    rule: Mask | None,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_kv: int,
    skip: bool,
    dense_mask: bool,
) -> BlockPlan:
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    structure: np.ndarray | None = None
    if rule is None:
        kinds = np.full((1, nq, nk), FULL, dtype=np.int8)
    else:
        per_head = rule.blocks(q_len, kv_len, block_q, block_kv, batch=batch, heads=heads)
        low, high = per_head.min(axis=1), per_head.max(axis=1)  # over heads
        kinds = np.where(low == high, low, PARTIAL).astype(np.int8)  # (B or 1, nq, nk)
        if kinds.shape[0] > 1 and (kinds == kinds[:1]).all():
            kinds = kinds[:1]
    if dense_mask:  # the array may mask any block: evaluate it on every one
        kinds = np.where(kinds == FULL, PARTIAL, kinds).astype(np.int8)
    if rule is not None and not skip:  # evaluate the mask on every block
        structure = np.ascontiguousarray(kinds)
        kinds = np.full_like(kinds, PARTIAL)
    return BlockPlan(block_q, block_kv, np.ascontiguousarray(kinds), structure)
