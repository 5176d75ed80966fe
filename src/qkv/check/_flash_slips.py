"""The FlashAttention forward made in float64 NumPy, right or with one slip on purpose, and
the backward (dense: the tiled one computes the same numbers) with its slips.

:func:`tiled` runs the FlashAttention-2 loop (a query block at a time, its key blocks in
order, the running maximum ``m``, sum ``l`` and accumulator ``O``) with the flags of a
:class:`FlashSlip`; ``FlashSlip()`` is the algorithm itself, and equals the plain
softmax (:func:`oracle`) to rounding.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 40, 16)) for _ in range(3))
    >>> o, lse = oracle(q, k, v, causal=True)
    >>> o2, lse2 = tiled(q, k, v, True, FlashSlip(), 16, 16)
    >>> bool(np.allclose(o, o2) and np.allclose(lse, lse2))
    True
    >>> o3, _ = tiled(q, k, v, False, FlashSlip(rescale_acc=False), 16, 16)
    >>> bool(np.allclose(o3, oracle(q, k, v, causal=False)[0]))
    False
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["FlashSlip", "backward", "oracle", "tiled"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class FlashSlip:
    """What a FlashAttention forward does, the right way by default.

    Attributes:
        scale: ``sqrt`` (1/√d), ``none`` (unscaled) or ``dk`` (1/d).
        rescale_acc: the accumulator is rescaled when the maximum grows.
        rescale_sum: the running sum is rescaled when the maximum grows.
        max_rule: ``running`` (max(m_old, rowmax)), or ``first`` (kept from the first block).
        local_max: FlashAttention-1's merge (P̃ from the block's own maximum: NaN for a
            fully masked block).
        divide: O is divided by l at the end.
        lse: ``natural`` (m + ln l), ``log2`` (log2 of the sum), ``log2-l`` (m + log2 l) or
            ``no-max`` (ln l).
        causal: ``right``, ``all-blocks`` (right, blocks above the diagonal visited and
            masked), ``diag-full`` (the diagonal block unmasked), ``diag-skip`` (the diagonal
            block skipped), ``strict`` (j < i), ``local`` (block-local indices in every
            block), ``local-skip`` (the same, blocks above the diagonal skipped) or
            ``ignored``.
        drop_q, drop_k: the last, shorter query (key) block is dropped (n // B blocks).
        kv_from_q: the key blocks are counted from the query length.
    """

    scale: str = "sqrt"
    rescale_acc: bool = True
    rescale_sum: bool = True
    max_rule: str = "running"
    local_max: bool = False
    divide: bool = True
    lse: str = "natural"
    causal: str = "right"
    drop_q: bool = False
    drop_k: bool = False
    kv_from_q: bool = False


def _scale(kind: str, d: int) -> float:
    return {"sqrt": 1.0 / math.sqrt(d), "none": 1.0, "dk": 1.0 / d}[kind]


def _allow(rows: NDArray[np.int64], cols: NDArray[np.int64], how: str) -> NDArray[np.bool_]:
    if how == "strict":
        return cols[None, :] < rows[:, None]
    if how == "ignored":
        return np.ones((rows.size, cols.size), dtype=bool)
    return cols[None, :] <= rows[:, None]


def tiled(
    q: Array, k: Array, v: Array, causal: bool, slip: FlashSlip, bq: int, bk: int
) -> tuple[Array, Array]:
    """(O, L) of FlashAttention with ``slip``, blocks of ``bq`` queries and ``bk`` keys;
    q, k, v of shape (..., n, d), float64. Rows a dropped block never writes are 0."""
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = _scale(slip.scale, d)
    out = np.zeros((*q.shape[:-1], v.shape[-1]))
    lse = np.zeros(q.shape[:-1])
    q_blocks = nq // bq if slip.drop_q else -(-nq // bq)
    kv_len = min(nq, nk) if slip.kv_from_q else nk
    k_blocks = kv_len // bk if slip.drop_k else -(-kv_len // bk)
    with np.errstate(all="ignore"):
        for i in range(q_blocks):
            rows = np.arange(i * bq, min(nq, (i + 1) * bq))
            qi = q[..., rows, :]
            m = np.full(qi.shape[:-1], -np.inf)
            total = np.zeros(qi.shape[:-1])
            acc = np.zeros((*qi.shape[:-1], v.shape[-1]))
            for j in range(k_blocks):
                cols = np.arange(j * bk, min(nk, (j + 1) * bk))
                if cols.size == 0:
                    continue
                s = qi @ np.swapaxes(k[..., cols, :], -1, -2) * scale
                if causal and slip.causal != "ignored":
                    above = cols[0] > rows[-1]
                    on_diagonal = cols[-1] > rows[0] and not above
                    if above and slip.causal not in ("local", "all-blocks"):
                        continue
                    if slip.causal == "diag-skip" and on_diagonal:
                        continue
                    if slip.causal in ("local", "local-skip"):
                        allow = _allow(rows - rows[0], cols - cols[0], "right")
                    elif slip.causal == "diag-full":
                        allow = np.ones((rows.size, cols.size), dtype=bool)
                    else:
                        allow = _allow(rows, cols, slip.causal)
                    s = np.where(allow, s, -np.inf)
                block_max = s.max(axis=-1)
                vj = v[..., cols, :]
                if slip.local_max:
                    p = np.exp(s - block_max[..., None])
                    new = np.maximum(m, block_max)
                    alpha, beta = np.exp(m - new), np.exp(block_max - new)
                    total = alpha * total + beta * p.sum(axis=-1)
                    acc = alpha[..., None] * acc + beta[..., None] * (p @ vj)
                    m = new
                    continue
                new = np.maximum(m, block_max) if slip.max_rule == "running" or j == 0 else m
                p = np.exp(s - new[..., None])
                alpha = np.exp(m - new)
                total = (alpha if slip.rescale_sum else 1.0) * total + p.sum(axis=-1)
                acc = (alpha[..., None] if slip.rescale_acc else 1.0) * acc + p @ vj
                m = new
            out[..., rows, :] = acc / total[..., None] if slip.divide else acc
            lse[..., rows] = {
                "natural": m + np.log(total),
                "log2": (m + np.log(total)) / math.log(2.0),
                "log2-l": m + np.log2(total),
                "no-max": np.log(total),
            }[slip.lse]
    return out, lse


def _probabilities(q: Array, k: Array, causal: bool, scale: float) -> tuple[Array, Array]:
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.tril(np.ones((nq, nk), dtype=bool)), s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, (top + np.log(total))[..., 0]


def oracle(q: Array, k: Array, v: Array, *, causal: bool) -> tuple[Array, Array]:
    """(O, L): attention and its natural log-sum-exp in float64, the plain way (query i
    sees keys 0 … i when causal, PyTorch's ``is_causal``)."""
    p, lse = _probabilities(q, k, causal, 1.0 / math.sqrt(q.shape[-1]))
    return p @ v, lse


def backward(
    q: Array, k: Array, v: Array, d_out: Array, *, causal: bool, slip: str = ""
) -> tuple[Array, Array, Array]:
    """dQ, dK, dV of attention for the output gradient ``d_out``, in float64; ``slip``:
    ``""`` (right), ``D-zero`` (dS = P ∘ dP), ``D-dO`` (D = rowsum(dO)), ``unscaled``
    (dQ, dK without 1/√d) or ``scale-twice`` (1/d)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p, _ = _probabilities(q, k, causal, scale)
    out = p @ v
    d_v = np.swapaxes(p, -1, -2) @ d_out
    d_p = d_out @ np.swapaxes(v, -1, -2)
    if slip == "D-zero":
        big_d = np.zeros(out.shape[:-1])
    elif slip == "D-dO":
        big_d = d_out.sum(axis=-1)
    else:
        big_d = (d_out * out).sum(axis=-1)
    d_s = p * (d_p - big_d[..., None])
    grad_scale = {"unscaled": 1.0, "scale-twice": scale * scale}.get(slip, scale)
    return d_s @ k * grad_scale, np.swapaxes(d_s, -1, -2) @ q * grad_scale, d_v
