"""The FlashAttention algorithm step by step, in plain NumPy float64: what ``qkv explain
--tiled`` shows.

The (Lq, Lk) scores of one head are cut into tiles of ``block_size`` queries by
``block_size`` keys. The forward pass visits, for each query block, the key blocks from left
to right and keeps three things per query row: the running maximum m, the running sum l and
the accumulator O. A tile's scaled scores S' (−∞ where masked) give:

- the tile's row maximum, and the new running maximum m_new = max(m_old, tile max);
- the rescale factor α = exp(m_old − m_new) (how much the old terms shrink);
- P̃ = exp(S' − m_new), the tile's unnormalised weights;
- l_new = α·l_old + rowsum(P̃) and O_new = α·O_old + P̃·V_tile.

At the end O / l is the output and L = m + log l the natural log-sum-exp. A row that has
seen no allowed key yet has m = −∞; the exponents then use 0 in place of m (α = 0, P̃ = 0),
so −∞ − (−∞) never makes a NaN, and a row with no allowed key at all is zeros (qkv's
policy: the reference gives the same) with L = −∞.

The backward pass (FlashAttention-2's order: each key block, then each query block) takes
an upstream gradient dO and recomputes each tile's weights from L: D = rowsum(dO ∘ O),
P = exp(S' − L), dP = dO·V_tileᵀ, dS = P ∘ (dP − D), then dV_j += Pᵀ·dO_i,
dQ_i += scale·dS·K_j and dK_j += scale·dSᵀ·Q_i.

Everything is computed once here; renderers only lay it out. Tiles whose keys are all masked
for all their queries are skipped (nothing computed), tiles with every key allowed are full,
the others (the diagonal of a causal mask) are masked element by element.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 3)) for _ in range(3))
    >>> steps = tiled_steps(q, k, v, block_size=2, causal=True)
    >>> [(t.q_block, t.k_block, t.kind) for t in steps.tiles][:4]
    [(0, 0, 'masked'), (0, 1, 'skipped'), (0, 2, 'skipped'), (1, 0, 'full')]
    >>> steps.output_difference < 1e-15, steps.gradient_difference < 1e-14
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["BackwardTile", "ForwardTile", "TileKind", "TiledSteps", "tile_kinds", "tiled_steps"]

TileKind = Literal["skipped", "full", "masked"]
"""What a tile is: ``skipped`` (every score masked: nothing computed), ``full`` (no score
masked: no mask applied) or ``masked`` (some scores masked, e.g. on a causal diagonal)."""

MAX_TILES = 4096
"""The most tiles an explanation holds: each is shown with its numbers."""


@dataclass(frozen=True)
class ForwardTile:
    """One tile of the forward pass, as visited.

    Shapes: bq = queries of the block, bk = keys of the block, Dv = value width.

    Attributes:
        q_block, k_block: the tile's query block and key block, from 0.
        rows, cols: the [start, stop) positions of its queries and keys.
        kind: see :data:`TileKind`.
        scores: (bq, bk) the scaled scores S' of the tile, −∞ where masked.
        tile_max: (bq,) each row's maximum over the tile (−∞ for a row masked in it).
        m_old, m_new: (bq,) the running maximum before and after the tile.
        rescale: (bq,) α = exp(m_old − m_new) (0 while a row has seen no allowed key).
        p: (bq, bk) P̃ = exp(S' − m_new), 0 where masked.
        l_old, l_new: (bq,) the running sum before and after.
        o_old, o_new: (bq, Dv) the accumulator before and after.
    """

    q_block: int
    k_block: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    kind: TileKind
    scores: np.ndarray
    tile_max: np.ndarray
    m_old: np.ndarray
    m_new: np.ndarray
    rescale: np.ndarray
    p: np.ndarray
    l_old: np.ndarray
    l_new: np.ndarray
    o_old: np.ndarray
    o_new: np.ndarray


@dataclass(frozen=True)
class BackwardTile:
    """One tile of the backward pass: its weights recomputed from L and its gradients.

    Attributes:
        q_block, k_block, rows, cols, kind: as in :class:`ForwardTile`.
        p: (bq, bk) P = exp(S' − L), 0 where masked.
        dp: (bq, bk) dP = dO_i·V_jᵀ.
        ds: (bq, bk) dS = P ∘ (dP − D_i).
        dq: (bq, D) this tile's part of dQ_i: scale·dS·K_j.
        dk: (bk, D) this tile's part of dK_j: scale·dSᵀ·Q_i.
        dv: (bk, Dv) this tile's part of dV_j: Pᵀ·dO_i.
    """

    q_block: int
    k_block: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    kind: TileKind
    p: np.ndarray
    dp: np.ndarray
    ds: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


@dataclass(frozen=True)
class TiledSteps:
    """The tiled forward and backward of one head, every tile with its numbers.

    Shapes: Lq queries, Lk keys, D = d_k, Dv = d_v; nq = ⌈Lq / block⌉, nk = ⌈Lk / block⌉.

    Attributes:
        q: (Lq, D), k: (Lk, D), v: (Lk, Dv), the inputs (float64).
        scale: what the scores Q·Kᵀ are multiplied by.
        block_size: queries and keys per tile (the last block may be shorter).
        allowed: (Lq, Lk) True where a query may attend a key.
        kinds: (nq, nk) each tile's :data:`TileKind`.
        tiles: every tile of the forward pass in the order visited (query block by query
            block, key blocks from left to right), skipped ones included (their state is
            unchanged).
        m, l: (Lq,) the final running maximum and sum. accumulator: (Lq, Dv) the final O
            before the division.
        output: (Lq, Dv) O / l (zeros for a row with no allowed key).
        lse: (Lq,) L = m + log l, natural log (−∞ for a row with no allowed key).
        plain_output, plain_lse: the same from the plain softmax of whole rows at once.
        output_difference, lse_difference: the largest |tiled − plain| (over finite L).
        d_out: (Lq, Dv) the upstream gradient dO the backward pass is given.
        delta: (Lq,) D = rowsum(dO ∘ O).
        backward: every computed tile of the backward pass in FlashAttention-2's order (key
            block by key block, query blocks from top to bottom).
        dq, dk, dv: the gradients (Lq, D), (Lk, D), (Lk, Dv).
        plain_dq, plain_dk, plain_dv: the same from the whole (Lq, Lk) matrices at once.
        gradient_difference: the largest |tiled − plain| over dQ, dK and dV.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    block_size: int
    allowed: np.ndarray
    kinds: np.ndarray
    tiles: tuple[ForwardTile, ...]
    m: np.ndarray
    l: np.ndarray  # noqa: E741 (the running sum's name in every FlashAttention paper)
    accumulator: np.ndarray
    output: np.ndarray
    lse: np.ndarray
    plain_output: np.ndarray
    plain_lse: np.ndarray
    output_difference: float
    lse_difference: float
    d_out: np.ndarray
    delta: np.ndarray
    backward: tuple[BackwardTile, ...]
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    plain_dq: np.ndarray
    plain_dk: np.ndarray
    plain_dv: np.ndarray
    gradient_difference: float

    @property
    def query_blocks(self) -> int:
        return int(self.kinds.shape[0])

    @property
    def key_blocks(self) -> int:
        return int(self.kinds.shape[1])

    def backward_of(self, k_block: int) -> tuple[BackwardTile, ...]:
        """The backward tiles of one key block, top to bottom."""
        return tuple(t for t in self.backward if t.k_block == k_block)


def _bounds(count: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, count)) for start in range(0, count, block)]


def tile_kinds(allowed: np.ndarray, block_size: int) -> np.ndarray:
    """Each tile's :data:`TileKind` from the (Lq, Lk) booleans of the allowed keys.

    Example:
        >>> tile_kinds(np.tril(np.ones((4, 4), dtype=bool)), 2).tolist()
        [['masked', 'skipped'], ['full', 'masked']]
    """
    rows = _bounds(allowed.shape[0], block_size)
    cols = _bounds(allowed.shape[1], block_size)
    kinds = np.empty((len(rows), len(cols)), dtype=object)
    for i, (q0, q1) in enumerate(rows):
        for j, (k0, k1) in enumerate(cols):
            tile = allowed[q0:q1, k0:k1]
            kinds[i, j] = "full" if tile.all() else "skipped" if not tile.any() else "masked"
    return kinds


def _exp_shifted(scores: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """exp(scores − shift) row by row, with 0 in place of a shift of −∞ (no NaN)."""
    safe = np.where(np.isneginf(shift), 0.0, shift)
    shifted: np.ndarray = np.exp(scores - safe[:, None])
    return shifted


def _check(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, block_size: int, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = tuple(np.asarray(x, dtype=np.float64) for x in (q, k, v))
    q64, k64, v64 = arrays
    if any(x.ndim != 2 for x in arrays):
        shapes = ", ".join(str(x.shape) for x in arrays)
        raise ValueError(f"q, k, v: expected (L, D) arrays of one head, got shapes {shapes}.")
    if q64.shape[1] != k64.shape[1] or k64.shape[0] != v64.shape[0] or 0 in q64.shape[:1]:
        raise ValueError(
            f"q, k, v: expected q (Lq, D), k (Lk, D), v (Lk, Dv) with Lq, Lk ≥ 1, got "
            f"{q64.shape}, {k64.shape}, {v64.shape}."
        )
    if k64.shape[0] == 0:
        raise ValueError("k: expected at least one key, got 0.")
    if not all(np.isfinite(x).all() for x in arrays):
        raise ValueError("q, k, v: expected finite numbers, got inf or NaN.")
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer):
        raise ValueError(f"block_size: expected a whole number of at least 1, got {block_size!r}.")
    if block_size < 1:
        raise ValueError(f"block_size: expected a number of at least 1, got {block_size}.")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive number, got {scale!r}.")
    return q64, k64, v64


def tiled_steps(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    block_size: int = 2,
    scale: float | None = None,
    causal: bool = False,
    allowed: np.ndarray | None = None,
    d_out: np.ndarray | None = None,
) -> TiledSteps:
    """Attention of one head computed tile by tile, forward and backward, with every step.

    Args:
        q: (Lq, D). k: (Lk, D). v: (Lk, Dv). Read as float64.
        block_size: queries and keys per tile (≥ 1; the last tile of a length that is no
            multiple of it is shorter).
        scale: what Q·Kᵀ is multiplied by (default 1/√D).
        causal: each query i may attend keys j ≤ i only (top-left alignment), combined
            with ``allowed``.
        allowed: (Lq, Lk) booleans, True = may attend (default: every key).
        d_out: (Lq, Dv) the upstream gradient of the output (default: all ones).

    Returns:
        Every tile's numbers, the final output and log-sum-exp, the gradients, and their
        differences from the plain computation over whole rows.

    Raises:
        ValueError: shapes that do not fit, numbers that are not finite, a block size below
            1, a scale that is not positive, or more than :data:`MAX_TILES` tiles.

    Example:
        >>> q = k = v = np.eye(2)
        >>> steps = tiled_steps(q, k, v, block_size=1, scale=1.0)
        >>> steps.tiles[3].rescale.round(4).tolist(), steps.output.round(4).tolist()
        ([0.3679], [[0.7311, 0.2689], [0.2689, 0.7311]])
    """
    q, k, v = _check(q, k, v, block_size, 1.0 if scale is None else float(scale))
    lq, lk = q.shape[0], k.shape[0]
    factor = 1.0 / math.sqrt(q.shape[1]) if scale is None else float(scale)
    block = int(block_size)
    rows, cols = _bounds(lq, block), _bounds(lk, block)
    if len(rows) * len(cols) > MAX_TILES:
        raise ValueError(
            f"block_size: {block} cuts {lq} queries × {lk} keys into "
            f"{len(rows) * len(cols)} tiles, more than {MAX_TILES} to show. Hint: a larger "
            "block size"
        )
    mask = np.ones((lq, lk), dtype=bool)
    if allowed is not None:
        given = np.asarray(allowed, dtype=bool)
        if given.shape != (lq, lk):
            raise ValueError(f"allowed: expected shape {(lq, lk)}, got {given.shape}.")
        mask &= given
    if causal:
        mask &= np.tril(np.ones((lq, lk), dtype=bool))
    grad = np.ones((lq, v.shape[1])) if d_out is None else np.asarray(d_out, dtype=np.float64)
    if grad.shape != (lq, v.shape[1]):
        raise ValueError(f"d_out: expected shape {(lq, v.shape[1])}, got {grad.shape}.")
    kinds = tile_kinds(mask, block)

    m = np.full(lq, -np.inf)
    l_sum = np.zeros(lq)
    acc = np.zeros((lq, v.shape[1]))
    tiles: list[ForwardTile] = []
    for i, (q0, q1) in enumerate(rows):
        for j, (k0, k1) in enumerate(cols):
            kind: TileKind = kinds[i, j]
            here = mask[q0:q1, k0:k1]
            scores = np.where(here, factor * (q[q0:q1] @ k[k0:k1].T), -np.inf)
            m_old, l_old, o_old = m[q0:q1].copy(), l_sum[q0:q1].copy(), acc[q0:q1].copy()
            if kind == "skipped":
                tile_max = np.full(q1 - q0, -np.inf)
                m_new, rescale, p = m_old.copy(), np.ones(q1 - q0), np.zeros(here.shape)
                l_new, o_new = l_old.copy(), o_old.copy()
            else:
                tile_max = scores.max(axis=1)
                m_new = np.maximum(m_old, tile_max)
                rescale = _exp_shifted(m_old[:, None], m_new)[:, 0]
                p = _exp_shifted(scores, m_new)
                l_new = rescale * l_old + p.sum(axis=1)
                o_new = rescale[:, None] * o_old + p @ v[k0:k1]
            m[q0:q1], l_sum[q0:q1], acc[q0:q1] = m_new, l_new, o_new
            tiles.append(
                ForwardTile(
                    i,
                    j,
                    (q0, q1),
                    (k0, k1),
                    kind,
                    scores,
                    tile_max,
                    m_old,
                    m_new,
                    rescale,
                    p,
                    l_old,
                    l_new,
                    o_old,
                    o_new,
                )
            )
    seen = l_sum > 0
    output = np.where(seen[:, None], acc / np.where(seen, l_sum, 1.0)[:, None], 0.0)
    lse = np.where(seen, m + np.log(np.where(seen, l_sum, 1.0)), -np.inf)

    # The plain computation: whole rows at once (for the comparison).
    dense = np.where(mask, factor * (q @ k.T), -np.inf)
    row_max = dense.max(axis=1)
    weights = _exp_shifted(dense, row_max)
    sums = weights.sum(axis=1)
    some = sums > 0
    weights = weights / np.where(some, sums, 1.0)[:, None]
    plain_output = weights @ v
    plain_lse = np.where(
        some, np.where(some, row_max, 0.0) + np.log(np.where(some, sums, 1)), -np.inf
    )
    finite = np.isfinite(lse) & np.isfinite(plain_lse)
    lse_gap = np.abs(lse[finite] - plain_lse[finite]).max(initial=0.0)
    if not np.array_equal(np.isfinite(lse), np.isfinite(plain_lse)):
        lse_gap = math.inf

    # The backward pass, FlashAttention-2's order: key blocks outside, query blocks inside.
    delta = (grad * output).sum(axis=1)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    backward: list[BackwardTile] = []
    for j, (k0, k1) in enumerate(cols):
        for i, (q0, q1) in enumerate(rows):
            kind = kinds[i, j]
            if kind == "skipped":
                continue
            here = mask[q0:q1, k0:k1]
            scores = np.where(here, factor * (q[q0:q1] @ k[k0:k1].T), -np.inf)
            p = np.where(here, _exp_shifted(scores, lse[q0:q1]), 0.0)
            dp = grad[q0:q1] @ v[k0:k1].T
            ds = p * (dp - delta[q0:q1, None])
            part_q = factor * ds @ k[k0:k1]
            part_k = factor * ds.T @ q[q0:q1]
            part_v = p.T @ grad[q0:q1]
            dq[q0:q1] += part_q
            dk[k0:k1] += part_k
            dv[k0:k1] += part_v
            backward.append(
                BackwardTile(i, j, (q0, q1), (k0, k1), kind, p, dp, ds, part_q, part_k, part_v)
            )
    plain_d_weights = grad @ v.T
    plain_ds = weights * (plain_d_weights - (plain_d_weights * weights).sum(axis=1)[:, None])
    plain_dq, plain_dk, plain_dv = factor * plain_ds @ k, factor * plain_ds.T @ q, weights.T @ grad
    gradient_gap = max(
        float(np.abs(a - b).max(initial=0.0))
        for a, b in ((dq, plain_dq), (dk, plain_dk), (dv, plain_dv))
    )
    return TiledSteps(
        q=q,
        k=k,
        v=v,
        scale=factor,
        block_size=block,
        allowed=mask,
        kinds=kinds,
        tiles=tuple(tiles),
        m=m,
        l=l_sum,
        accumulator=acc,
        output=output,
        lse=lse,
        plain_output=plain_output,
        plain_lse=plain_lse,
        output_difference=float(np.abs(output - plain_output).max(initial=0.0)),
        lse_difference=float(lse_gap),
        d_out=grad,
        delta=delta,
        backward=tuple(backward),
        dq=dq,
        dk=dk,
        dv=dv,
        plain_dq=plain_dq,
        plain_dk=plain_dk,
        plain_dv=plain_dv,
        gradient_difference=gradient_gap,
    )
