"""The pieces of the tiled kernel shared by its forward and backward passes: the problem,
the layout of blocks and their runs, the evaluated masks of partial blocks, and values that
hold NaN or ±inf. The scores of one block and their weights: :mod:`qkv.kernels._block_scores`.

Layout (one matrix product serves every head of the batch, and the query heads that share a
key/value head, GQA, are stacked along the rows):

    query (B, H, Lq, D) → block (B·Hkv, G·bq, D)        G = H / Hkv
    key   (B, Hkv, Lk, D) → block (B·Hkv, bk, D)
    scores block (B·Hkv, G·bq, bk) = a view (B, H, bq, bk) for masks and score modifiers
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import array_api_compat.torch as torch_xp
import torch

from qkv.kernels._blocks import BlockPlan
from qkv.masks import EMPTY, FULL, Mask, ScoreMod

NEG_INF = float("-inf")
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class Problem:
    """Everything about one call of the kernel except the tensors.

    Attributes:
        scale: multiplies the scores.
        rule: the mask rule (the user's Mask combined with the causal rule), or None.
        dense_mask: a boolean tensor of 4 dimensions that broadcasts to (B, H, Lq, Lk), or
            None.
        score_mod: applied to the scaled scores (after the bias, before the mask).
        dropout_p: the dropout probability.
        keep: the dropout pattern (:func:`qkv.masks.dropout_keep`), None without dropout.
        plan: the block sizes and kinds.
        skip: skip blocks whose evaluated mask is empty (False only to test that skipping
            changes nothing).
        exact_masking: replace masked scores by −inf (``masked_fill``), needed when a
            masked score may be NaN or ±inf (non-finite query, key or bias, or a score
            modifier); otherwise a 0/−inf block is added, which is many times faster.
        huge: the bias has finite entries beyond ±HUGE_BIAS (a "blocked" −3.4e38, −1e9): the
            scores are kept in natural units (they must round as the reference's do, and
            would overflow times log2 e). The backward pass makes its weights from each
            row's m and l apart (exp(S' − m) / l), so a huge m does not lose log l.
        blocked_scores: an allowed score may be −inf (a −inf bias, a score modifier): such a
            key is masked out, so its weight must be exactly 0 (not the floor's tiny
            positive weight) and a NaN or ±inf value there must not reach the output.
    """

    scale: float
    rule: Mask | None
    dense_mask: torch.Tensor | None
    score_mod: ScoreMod | None
    dropout_p: float
    keep: Mask | None
    plan: BlockPlan
    skip: bool = True
    exact_masking: bool = False
    huge: bool = False
    blocked_scores: bool = False

    @property
    def base2(self) -> bool:
        """Scores are kept in units of log2 (multiplied by log2 e) and exponentiated with
        exp2, about twice as fast as exp on CPUs; not with a score modifier, which sees
        the scores in their own units, nor with a ``huge`` bias."""
        return self.score_mod is None and not self.huge

    @property
    def units(self) -> float:
        """What the scores are multiplied by: log2 e, or 1."""
        return LOG2E if self.base2 else 1.0

    @property
    def masked(self) -> bool:
        return self.rule is not None or self.dense_mask is not None

    @property
    def masks_keys(self) -> bool:
        """Whether some key may get weight 0 (a mask, or a −inf score): then a NaN or ±inf
        value must be kept out of the matrix products."""
        return self.masked or self.blocked_scores


class Buffers:
    """A reusable score buffer, grown to the largest block seen (a fresh 8 MiB tensor per
    block costs page faults); each request gets a view of its start, so blocks of
    different shapes share it (one block at a time)."""

    def __init__(self) -> None:
        self._store: dict[tuple[Any, ...], torch.Tensor] = {}

    def get(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        size = math.prod(shape)
        buffer = self._store.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=like.dtype, device=like.device)
            self._store[key] = buffer
        return buffer[:size].view(shape)


@dataclass
class Group:
    """The tensors of one group of batch elements (all of them, unless the block structure
    differs between batch elements)."""

    start: int  # first batch element
    q: torch.Tensor  # (Bg, H, Lq, D)
    k: torch.Tensor  # (Bg, Hkv, Lk, D)
    v: torch.Tensor  # (Bg, Hkv, Lk, Dv)
    bias: torch.Tensor | None  # broadcasts to (Bg, H, Lq, Lk)
    mask: torch.Tensor | None  # broadcasts to (Bg, H, Lq, Lk)
    kinds: Any  # (nq, nk) numpy int8
    structure: Any = None  # (nq, nk) numpy int8: the structural kinds (skip=False), or None
    views: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:  # Bg · Hkv: the batch of the matrix products
        return int(self.k.shape[0] * self.k.shape[1])

    def keys_t(self, k0: int, k1: int) -> torch.Tensor:
        """The key block transposed, (Bg·Hkv, D, bk): a view, made once per call."""
        found = self.views.get((0, k0, k1))
        if found is None:  # two threads may both make it: the same view, no harm
            found = kv_block(self.k, k0, k1).transpose(1, 2)
            self.views[(0, k0, k1)] = found
        return found

    def values(self, v: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """The block of ``v`` (the values, or their cleaned copy), (Bg·Hkv, bk, Dv)."""
        found = self.views.get((id(v), k0, k1))
        if found is None:
            found = kv_block(v, k0, k1)
            self.views[(id(v), k0, k1)] = found
        return found


class Indices:
    """The index arrays a mask or score rule sees for one block: b, h, q_idx, kv_idx."""

    def __init__(self, group: Group, heads: int, q_len: int, kv_len: int) -> None:
        device = group.q.device
        batch = group.q.shape[0]
        self.b = torch.arange(group.start, group.start + batch, device=device).view(-1, 1, 1, 1)
        self.h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        self._q = torch.arange(q_len, device=device)
        self._kv = torch.arange(kv_len, device=device)
        self.q_len, self.kv_len = q_len, kv_len

    def at(self, q0: int, q1: int, k0: int, k1: int) -> tuple[torch.Tensor, ...]:
        return (
            self.b,
            self.h,
            self._q[q0:q1].view(1, 1, -1, 1),
            self._kv[k0:k1].view(1, 1, 1, -1),
        )


def split_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    problem: Problem,
) -> list[Group]:
    """One group for the whole batch, or one per batch element when their blocks differ."""
    plan = problem.plan
    lq, lk = q.shape[2], k.shape[2]
    bias = None if bias is None else bias.expand(*bias.shape[:2], lq, lk)
    mask = problem.dense_mask
    mask = None if mask is None else mask.expand(*mask.shape[:2], lq, lk)
    if not plan.per_batch:
        return [Group(0, q, k, v, bias, mask, plan.kinds_for(0), plan.structure_for(0))]

    def pick(x: torch.Tensor | None, b: int) -> torch.Tensor | None:
        return None if x is None else (x[b : b + 1] if x.shape[0] > 1 else x)

    return [
        Group(
            b,
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            pick(bias, b),
            pick(mask, b),
            plan.kinds_for(b),
            plan.structure_for(b),
        )
        for b in range(q.shape[0])
    ]


def query_block(q: torch.Tensor, kv_heads: int, q0: int, q1: int, scale: float) -> torch.Tensor:
    """(Bg, H, Lq, D) → the scaled block (Bg·Hkv, G·bq, D)."""
    batch, heads, _, dim = q.shape
    grouped = q.view(batch, kv_heads, heads // kv_heads, q.shape[2], dim)[:, :, :, q0:q1]
    return torch.mul(grouped, scale).view(batch * kv_heads, -1, dim)


def row_block(x: torch.Tensor, kv_heads: int, q0: int, q1: int) -> torch.Tensor:
    """(Bg, H, Lq, E) → the block (Bg·Hkv, G·bq, E), contiguous (for per-row statistics)."""
    batch, heads = x.shape[0], x.shape[1]
    grouped = x.view(batch, kv_heads, heads // kv_heads, x.shape[2], *x.shape[3:])
    block = grouped[:, :, :, q0:q1]
    return block.reshape(batch * kv_heads, -1, *x.shape[3:])


def kv_block(x: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """(Bg, Hkv, Lk, E) → (Bg·Hkv, bk, E), a view of a contiguous tensor."""
    return x[:, :, k0:k1].reshape(-1, k1 - k0, x.shape[3])


def _allowed(
    problem: Problem, group: Group, index: Indices, q0: int, q1: int, k0: int, k1: int
) -> torch.Tensor | None:
    """The boolean mask of a partial block, broadcastable to (Bg, H, bq, bk)."""
    allowed: torch.Tensor | None = None
    if problem.rule is not None:
        b, h, qi, ki = index.at(q0, q1, k0, k1)
        allowed = problem.rule(b, h, qi, ki, index.q_len, index.kv_len, torch_xp)
    if group.mask is not None:
        block = group.mask[:, :, q0:q1, k0:k1]
        allowed = block if allowed is None else allowed & block
    return allowed


_NOTHING = torch.zeros(0, dtype=torch.bool)  # a kept block that turned out empty


class _KeptMasks:
    """The evaluated masks of partial blocks, kept from one call to the next.

    A model calls the kernel with the same mask object and shapes in every layer and step;
    evaluating a partial block's rule and counting its allowed pairs takes several small
    PyTorch operations, about 12 % of a 16-document forward at N = 4,096 on 2 threads. A
    block is kept under its plan (itself kept per mask object and shape, see
    :func:`qkv.kernels._blocks.plan_blocks`), which the entry holds, so a plan made for
    another mask never matches. At most :data:`_KEPT_MASK_BYTES` in all, least recently
    used first out. Only the mask rule's blocks are kept: a boolean array given with the
    call is read on each call.
    """

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._bytes = 0
        self._entries: OrderedDict[tuple[Any, ...], tuple[Any, torch.Tensor | None]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], plan: Any) -> tuple[bool, torch.Tensor | None]:
        """(found, mask): the mask None when the whole block is allowed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not plan:
                return False, None
            self._entries.move_to_end(key)
            return True, entry[1]

    def put(self, key: tuple[Any, ...], plan: Any, mask: torch.Tensor | None) -> None:
        size = 0 if mask is None else mask.numel() * mask.element_size()
        if size > self._budget // 8:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None and old[1] is not None:
                self._bytes -= old[1].numel() * old[1].element_size()
            self._entries[key] = (plan, mask)
            self._bytes += size
            while self._bytes > self._budget or len(self._entries) > _KEPT_MASK_BLOCKS:
                _, (_, dropped) = self._entries.popitem(last=False)
                if dropped is not None:
                    self._bytes -= dropped.numel() * dropped.element_size()


_KEPT_MASK_BYTES = 32 << 20
_KEPT_MASK_BLOCKS = 1 << 14
_kept_masks = _KeptMasks(_KEPT_MASK_BYTES)


def partial_mask(
    problem: Problem, group: Group, index: Indices, q0: int, q1: int, k0: int, k1: int
) -> tuple[bool, torch.Tensor | None]:
    """(empty, allowed) of a partial block: ``empty`` when nothing is allowed (the block is
    skipped), ``allowed`` None when everything is (with ``problem.skip``; without, the
    evaluated mask as it is). Kept from call to call for a mask rule alone."""
    key = None
    if group.mask is None and problem.rule is not None and group.q.device.type == "cpu":
        key = (group.start, group.q.shape[0], problem.skip, q0, q1, k0, k1)
        found, kept = _kept_masks.get(key, problem.plan)
        if found:
            return kept is _NOTHING, kept
    allowed = _allowed(problem, group, index, q0, q1, k0, k1)
    if allowed is not None and problem.skip:
        count = int(allowed.sum())  # one pass and one wait, for "none" and "all"
        if count == 0:
            allowed = _NOTHING
        elif count == allowed.numel():
            allowed = None
    if key is not None:
        _kept_masks.put(key, problem.plan, allowed)
    return allowed is _NOTHING, allowed


RUN_ELEMENTS = 1 << 19
"""The most score elements (2 MiB of float32, as one 256 × 256 block of 8 heads) one run
of blocks computes at once: longer runs are cut (a long run's passes over its scores leave
the caches: runs of 8 and 32 MiB were measured slower)."""


def blocks_of(kinds: Any, plan: BlockPlan, q_len: int, kv_len: int, group: Group) -> Any:
    """(q0, q1, [(k0, k1, kind), ...]) for every query block, with its runs of keys.

    A run is a stretch of adjacent full key blocks computed as one: one matrix product and
    one softmax pass over the stretch instead of one per block; a partial block is a run of
    its own (measured: evaluating and adding the mask over a whole mixed run cost more than
    the calls it saved). Runs are cut at :data:`RUN_ELEMENTS` scores; each block is a run
    of its own when the plan's block sizes were given (``plan.runs`` False).
    """
    per_position = group.q.shape[0] * group.q.shape[1]  # Bg·H score rows per query
    for i, q0 in enumerate(range(0, q_len, plan.block_q)):
        q1 = min(q0 + plan.block_q, q_len)
        structure = None if group.structure is None else group.structure[i]
        longest = RUN_ELEMENTS // (per_position * (q1 - q0)) if plan.runs else 0
        yield q0, q1, _runs(kinds[i], structure, plan.block_kv, kv_len, longest)


def columns_of(kinds: Any, plan: BlockPlan, q_len: int, kv_len: int, group: Group) -> Any:
    """(k0, k1, [(q0, q1, kind), ...]) for every key block, with its runs of queries (as
    :func:`blocks_of`, along the other axis)."""
    per_position = group.q.shape[0] * group.q.shape[1]
    for j, k0 in enumerate(range(0, kv_len, plan.block_kv)):
        k1 = min(k0 + plan.block_kv, kv_len)
        structure = None if group.structure is None else group.structure[:, j]
        longest = RUN_ELEMENTS // (per_position * (k1 - k0)) if plan.runs else 0
        yield k0, k1, _runs(kinds[:, j], structure, plan.block_q, q_len, longest)


def _runs(
    kinds: Any, structure: Any, size: int, length: int, longest: int
) -> list[tuple[int, int, int]]:
    """The non-empty blocks of one row (or column) of the plan as runs: adjacent full blocks
    merged into runs of at most ``max(longest, size)`` positions, each partial block a run
    of its own (its mask is evaluated and added on that block only). ``structure``, when
    given, says which blocks are full or empty by the mask's structure (``skip=False``
    computes every block as partial): the runs then follow it."""
    runs: list[tuple[int, int, int]] = []
    joinable = False  # whether the last run is full by the structure and may grow
    for j, kind in enumerate(kinds.tolist()):
        if kind == EMPTY:
            joinable = False
            continue
        shape = kind if structure is None else int(structure[j])
        start, end = j * size, min((j + 1) * size, length)
        if joinable and shape == FULL and runs[-1][1] == start and end - runs[-1][0] <= longest:
            runs[-1] = (runs[-1][0], end, runs[-1][2])
        else:
            runs.append((start, end, int(kind)))
            joinable = shape == FULL
    return runs


# -- forward -------------------------------------------------------------------------------


@dataclass
class NonFinite:
    clean: torch.Tensor  # the values with NaN and ±inf replaced by 0
    hits: torch.Tensor  # (B, Hkv, Lk, 3·Dv): 1 where +inf, −inf, NaN


def nonfinite(v: torch.Tensor) -> NonFinite | None:
    """The slow path for values holding NaN or ±inf (one check over V otherwise).

    Matrix products would turn weight 0 × NaN into NaN; as in the reference, a non-finite
    value reaches a query's context only when the query gives it a positive weight.
    """
    if math.isfinite(
        float(v.detach().sum())
    ):  # a finite sum: every entry is finite (one fast pass)
        return None
    finite = torch.isfinite(v)
    if bool(finite.all()):  # the sum overflowed
        return None
    clean = torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device))
    hits = torch.cat([torch.isposinf(v), torch.isneginf(v), torch.isnan(v)], dim=-1)
    return NonFinite(clean, hits.to(v.dtype))


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def put_back_nonfinite(context: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    pos, neg, nan = (
        reach[..., i * context.shape[-1] : (i + 1) * context.shape[-1]] > 0 for i in range(3)
    )
    nan = nan | (pos & neg)
    inf = torch.tensor(math.inf, dtype=context.dtype, device=context.device)
    context = torch.where(pos, inf, torch.where(neg, -inf, context))
    not_a_number = torch.tensor(math.nan, dtype=context.dtype, device=context.device)
    return torch.where(nan, not_a_number, context)
