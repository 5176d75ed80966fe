"""The scores of one block of the tiled kernel and the weights made from them: scaled,
biased, modified and masked (:func:`block_scores`), then exponentiated in place with a shift
per row (:class:`BlockScores`); and the rows of a query block that the forward pass shifts
by their own score (:func:`level_rows`).

Shapes: a block of scores is (Bg·Hkv, G·bq, bk), seen as (Bg, H, bq, bk) by masks and score
modifiers (:mod:`qkv.kernels._blockwise` has the layout).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import array_api_compat.torch as torch_xp
import torch

from qkv.kernels._blockwise import NEG_INF, Group, Indices, Problem, partial_mask
from qkv.masks import FULL

__all__ = ["EXP_FLOOR", "BlockScores", "RowShift", "block_scores", "dropout_block", "level_rows"]

EXP_FLOOR = -80.0
"""Under a bias or a score modifier, scores more than 80 below their row's shift are raised
to it before exp (see :meth:`BlockScores.exp_`)."""
_NORMAL_FLOOR2 = -126.0  # 2**-126 and e**-87: the smallest normal float32 exponents
_NORMAL_FLOOR = -87.0


@dataclass(frozen=True)
class RowShift:
    """The fixed shift of some rows of a query block's scores: ``rows`` (n,) indices into its
    rows flattened, (Bg·Hkv·G·bq), and ``amounts`` (n, 1) each one's shift."""

    rows: torch.Tensor
    amounts: torch.Tensor

    def full(self, like: torch.Tensor) -> torch.Tensor:
        """The shift of every row, 0 where none is given, shaped as ``like`` (…, 1)."""
        every = torch.zeros(like.numel(), 1, dtype=like.dtype, device=like.device)
        every[self.rows] = self.amounts
        return every.view(like.shape)


@dataclass
class BlockScores:
    """The scores of one block and what turns them into weights.

    Attributes:
        values: (Bg·Hkv, G·bq, bk) scaled, biased, modified and masked scores.
        shape4: (Bg, H, bq, bk), the layout masks and modifiers see.
        base2: the scores are in log2 units (exp2 makes the weights).
        far: a bias or a score modifier may put finite scores far below their row's shift
            (where exp is several times slower: see :meth:`exp_`).
        allowed: True where allowed, broadcastable to ``shape4``; None when the whole block
            is allowed.
        raw: the scores before the score modifier, when its gradient is needed.
        blocked: a score may be −inf where the mask allows it (``Problem.blocked_scores``).
    """

    values: torch.Tensor
    shape4: tuple[int, int, int, int]
    base2: bool
    far: bool
    allowed: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    blocked: bool = False

    def exp_(self, shift: torch.Tensor | None, values: torch.Tensor | None = None) -> torch.Tensor:
        """exp(values − shift) (exp2 in log2 units), in place, with exact zeros where masked;
        ``shift`` (…, G·bq, 1), or None for a shift of 0 in every row (no pass).

        exp(x) is several times slower on CPUs where its result is subnormal (x in about
        [−104, −87] in float32; exp2 of x in [−150, −126]), and the natural exp also for
        x below (−inf included). Where scores may lie far below the shift (:attr:`far`), x
        is first raised to :data:`EXP_FLOOR`: a weight below e^−80 ≈ 2e−35 of exp(shift)
        (the row's running maximum; in the backward pass the forward's shift, whose own
        weight is part of l) becomes 2e−35 of it (far below any rounding), and the masked
        ones are then multiplied by 0. Plain scores (no bias, no modifier) are exponentiated
        as they are: a pass fewer, and masked scores (−inf) give exact zeros.
        """
        target = self.values if values is None else values
        if shift is not None:
            target.sub_(shift)
        return self._exp_(target, EXP_FLOOR if self.far else None)

    def exp_fixed_(self, shift: RowShift | None) -> torch.Tensor:
        """exp(values − shift) (exp2 in log2 units), in place: the weights with each row's
        shift fixed (not its running maximum). ``shift`` names the rows shifted and by how
        much (finite), every other row's shift is 0; None shifts none (no pass at all).

        Masked scores are −inf and become exact zeros. Where scores may lie far below the
        shift (:attr:`far`: a bias or a score modifier such as ALiBi), they are first raised
        to the smallest normal float's exponent, below which exp is several times slower.
        """
        lowest = _NORMAL_FLOOR2 if self.base2 else _NORMAL_FLOOR
        if shift is not None:
            flat = self.values.view(-1, self.values.shape[-1])  # (Bg·Hkv·G·bq, bk)
            flat[shift.rows] = flat[shift.rows] - shift.amounts
        return self._exp_(self.values, lowest if self.far else None)

    def _exp_(self, x: torch.Tensor, floor: float | None) -> torch.Tensor:
        """exp(x) in place; with a floor, x is first raised to it and masked weights (no
        longer exp(−inf) = 0) are then set to 0, as are the weights of −inf scores when the
        block may hold them (a −inf bias is a mask: weight exactly 0, as in the reference)."""
        dead = x == NEG_INF if floor is not None and self.blocked else None
        if floor is not None:
            x.clamp_(min=floor)
        weights = x.exp2_() if self.base2 else x.exp_()
        if floor is not None and self.allowed is not None:
            weights.view(self.shape4).mul_(self.allowed)
        if dead is not None:
            weights.masked_fill_(dead, 0.0)
        return weights


def block_scores(
    problem: Problem,
    group: Group,
    index: Indices,
    q_block: torch.Tensor,
    block: tuple[int, int, int, int],
    kind: int,
    out: torch.Tensor,
    *,
    keep_raw: bool = False,
) -> BlockScores | None:
    """The scaled, biased, modified and masked scores of one block, (Bg·Hkv, G·bq, bk).

    Returns None when the block's mask turns out empty (nothing to do). With ``keep_raw``
    (the backward pass of a score modifier), the scores before the modifier are kept, and
    the modified scores are computed under autograd.
    """
    q0, q1, k0, k1 = block
    batch, heads = group.q.shape[0], group.q.shape[1]
    shape4 = (batch, heads, q1 - q0, k1 - k0)
    allowed: torch.Tensor | None = None
    if kind != FULL:
        empty, allowed = partial_mask(problem, group, index, q0, q1, k0, k1)
        if empty:
            return None
    scores = torch.bmm(q_block, group.keys_t(k0, k1), out=out)
    view = scores.view(shape4)  # h = kv_head · G + g
    if group.bias is not None:
        view.add_(group.bias[:, :, q0:q1, k0:k1], alpha=problem.units)
    if problem.score_mod is not None:
        b, h, qi, ki = index.at(q0, q1, k0, k1)
        raw = view.detach().clone().requires_grad_(True) if keep_raw else None
        with torch.enable_grad() if keep_raw else contextlib.nullcontext():
            modified = problem.score_mod(
                view if raw is None else raw, b, h, qi, ki, index.q_len, index.kv_len, torch_xp
            )
            # A result that broadcasts (it ignores some index) gets memory of its own: the
            # weights are computed from it in place.
            modified = modified.expand(shape4).contiguous()
            if allowed is not None:
                modified = modified.masked_fill(allowed.logical_not(), NEG_INF)
            values = modified.reshape(scores.shape)
        return BlockScores(
            values, shape4, problem.base2, True, allowed, raw, problem.blocked_scores
        )
    if allowed is not None:
        if problem.exact_masking:  # a masked score may be NaN: overwrite it
            view.masked_fill_(allowed.logical_not(), NEG_INF)
        else:  # adding 0 / −inf is many times faster than masked_fill on CPUs
            view.add_(torch.where(allowed, 0.0, NEG_INF))
    far = group.bias is not None  # (or a score modifier, above)
    return BlockScores(scores, shape4, problem.base2, far, allowed, blocked=problem.blocked_scores)


def dropout_block(
    problem: Problem, index: Indices, block: tuple[int, int, int, int]
) -> torch.Tensor:
    """The dropout pattern of one block, (Bg, H, bq, bk) booleans."""
    assert problem.keep is not None
    b, h, qi, ki = index.at(*block)
    keep: torch.Tensor = problem.keep(b, h, qi, ki, index.q_len, index.kv_len, torch_xp)
    return keep


_SAMPLES = 8
"""How many keys of a block :func:`level_rows` looks at in every row, spread over the block,
before it reads whole rows: only those of the rows whose allowed keys among them have equal
scores (rarely any with real inputs; every row with constant ones)."""


def level_rows(values: torch.Tensor, *, unmasked: bool) -> RowShift | bool | None:
    """The rows of a query block's first key block with a score for some row, ``values``
    (Bg·Hkv, G·bq, bk), whose allowed scores there are all equal (one allowed key
    included), with each one's score as its shift: such a row then gets weights of exactly
    1 and the exact result the reference gets, where exp(s) rounds each weight (the context
    missed by 1e-6, dV by a few units in the last place). None when there is no such row
    (every shift 0: no pass to subtract it), False when no row has a score in the block.

    A few keys of each row first (:data:`_SAMPLES`), a whole row only where those allowed
    agree: a handful of small operations per query block, not three passes over its first
    block. ``unmasked``: no score is −inf (a full block, no bias or modifier). NaN scores
    never agree.
    """
    width = values.shape[-1]
    flat = values.view(-1, width)  # (R, bk), R = Bg·Hkv·G·bq
    seen = flat[:, :: max(1, width // _SAMPLES)]  # (R, ≤ 2·S), a view
    finite = seen if unmasked else _masked_to_inf(seen)
    # NaN compares False: a row with one is looked at whole, and is never level.
    spread = finite.amin(dim=-1) < seen.amax(dim=-1)
    if bool(spread.all()):
        return None
    candidates = spread.logical_not_().nonzero().squeeze(-1)
    rows = flat[candidates]  # (n, bk)
    largest = rows.amax(dim=-1, keepdim=True)
    lowest = (rows if unmasked else _masked_to_inf(rows)).amin(dim=-1, keepdim=True)
    scored = largest != NEG_INF
    if candidates.numel() == flat.shape[0] and not bool(scored.any()):
        return False
    level = ((lowest == largest) & scored).squeeze(-1)
    if not bool(level.any()):
        return None
    return RowShift(candidates[level], largest[level])


def _masked_to_inf(scores: torch.Tensor) -> torch.Tensor:
    """The scores with −inf (masked) made +inf, for the least allowed score; NaN stays."""
    return scores.nan_to_num(nan=math.nan, posinf=math.inf, neginf=math.inf)
