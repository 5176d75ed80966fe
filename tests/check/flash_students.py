"""Students' FlashAttention submissions, right and with each slip ``--kind flash`` names,
written for these tests in the style real ones are written (never copied). Each is the text
of a file: ``load`` runs it in the test's process, the grade tests hand it in as a file.

What was studied (the style, and the bugs seen there):

- ezhoureal/assignment2-systems, cs336_systems/flash_attention.py: a CS336
  ``torch.autograd.Function`` with ``torch.split`` into tiles of 16, einops, the running
  max/sum updated in place, ``ctx.save_for_backward(L)``; it ignores ``is_causal`` and
  asserts ``Q.shape == K.shape`` (n_q ≠ n_k crashes): ``IGNORES_CAUSAL``, ``SAME_SHAPE``.
- rwtarpit/assignment2-systems, cs336_systems/flash_attention/autograd.py: loops
  ``for j in tile_q`` (the key tiles counted from the query length: ``KV_FROM_Q``) and divides
  the scores by d_model (``SCALED_BY_DK``), ``torch.diag(exp(m_old - m_new)) @ O``.
- The FlashAttention-1 paper's merge (the tile's own max, then rescaling both parts) as the
  "flash attention from scratch" tutorials write it: NaN on a fully masked tile
  (``EMPTY_TILE_NAN``).

The truth of each is decided by ``reference`` below (float64, plain softmax), not by qkv.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# A right CS336-style forward and backward; {SLIP} lines are where each submission differs.
_CS336 = """\
import math

import torch


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        Bq, Bk = {BQ}, {BK}
        *batch, n_q, d = Q.shape
        n_k = K.shape[-2]
        scale = {SCALE}
        O = torch.zeros_like(Q)
        L = torch.zeros(*batch, n_q, device=Q.device)
        for i in range({TQ}):
            q = Q[..., i * Bq : (i + 1) * Bq, :]
            rows = torch.arange(i * Bq, i * Bq + q.shape[-2])
            m = torch.full(q.shape[:-1], float("-inf"))
            l = torch.zeros(q.shape[:-1])
            o = torch.zeros_like(q)
            for j in range({TK}):
                k = K[..., j * Bk : (j + 1) * Bk, :]
                v = V[..., j * Bk : (j + 1) * Bk, :]
                S = q @ k.transpose(-1, -2) * scale
                if is_causal{CAUSAL_OFF}:
                    cols = torch.arange(j * Bk, j * Bk + k.shape[-2])
                    if cols[0] > rows[-1]:
                        continue
                    S = S.masked_fill({MASK}, float("-inf"))
                m_new = {M_NEW}
                P = torch.exp(S - m_new.unsqueeze(-1))
                alpha = torch.exp(m - m_new)
                l = {L_UPDATE}
                o = {O_UPDATE}
                m = m_new
            O[..., i * Bq : (i + 1) * Bq, :] = {O_FINAL}
            L[..., i * Bq : (i + 1) * Bq] = {LSE}
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        scale = 1 / math.sqrt(Q.shape[-1])
        S = Q @ K.transpose(-1, -2) * scale
        if ctx.is_causal:
            n_q, n_k = S.shape[-2:]
            S = S.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
        P = torch.exp(S - L.unsqueeze(-1))
        dV = P.transpose(-1, -2) @ dO
        dP = dO @ V.transpose(-1, -2)
        D = {D}
        dS = P * (dP - D.unsqueeze(-1))
        dQ = dS @ K * {GRAD_SCALE}
        dK = dS.transpose(-1, -2) @ Q * {GRAD_SCALE}
        return dQ, dK, dV, None
"""

_RIGHT = {
    "BQ": "32",
    "BK": "32",
    "SCALE": "1 / math.sqrt(d)",
    "TQ": "math.ceil(n_q / Bq)",
    "TK": "math.ceil(n_k / Bk)",
    "CAUSAL_OFF": "",
    "MASK": "cols[None, :] > rows[:, None]",
    "M_NEW": "torch.maximum(m, S.amax(dim=-1))",
    "L_UPDATE": "alpha * l + P.sum(dim=-1)",
    "O_UPDATE": "alpha.unsqueeze(-1) * o + P @ v",
    "O_FINAL": "o / l.unsqueeze(-1)",
    "LSE": "m + torch.log(l)",
    "D": "(dO * O).sum(dim=-1)",
    "GRAD_SCALE": "scale",
}


def cs336(**slip: str) -> str:
    """The CS336-style file with the lines of ``slip`` changed."""
    text = _CS336
    for key, value in {**_RIGHT, **slip}.items():
        text = text.replace("{" + key + "}", value)
    return text


# FlashAttention-1's merge, as tutorials write it: the tile's own max, P from it.
EMPTY_TILE_NAN = """\
import math

import torch


def flash_attention(Q, K, V, is_causal=False):
    B = 16
    n_q, d = Q.shape[-2:]
    n_k = K.shape[-2]
    O = torch.zeros_like(Q)
    L = torch.zeros(Q.shape[:-1])
    for i in range(0, n_q, B):
        q = Q[..., i : i + B, :]
        m_i = torch.full(q.shape[:-1], -math.inf)
        l_i = torch.zeros(q.shape[:-1])
        o_i = torch.zeros_like(q)
        for j in range(0, n_k, B):
            s = q @ K[..., j : j + B, :].transpose(-1, -2) / math.sqrt(d)
            if is_causal:
                r = torch.arange(i, i + q.shape[-2])[:, None]
                c = torch.arange(j, j + s.shape[-1])[None, :]
                s = torch.where(c <= r, s, torch.tensor(-math.inf))
            m_ij = s.max(dim=-1).values
            p_ij = torch.exp(s - m_ij[..., None])
            l_ij = p_ij.sum(dim=-1)
            m_new = torch.maximum(m_i, m_ij)
            a, b = torch.exp(m_i - m_new), torch.exp(m_ij - m_new)
            l_new = a * l_i + b * l_ij
            o_i = a[..., None] * o_i + b[..., None] * (p_ij @ V[..., j : j + B, :])
            m_i, l_i = m_new, l_new
        O[..., i : i + B, :] = o_i / l_i[..., None]
        L[..., i : i + B] = m_i + torch.log(l_i)
    return O, L
"""

# ezhoureal's shape of it: torch.split into tiles, is_causal never read, einsum.
IGNORES_CAUSAL = """\
import torch
from torch import einsum  # einops.einsum in the original; not installed here

TILE = 16


class FlashAttentionPytorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        scale = Q.shape[-1] ** -0.5
        O = torch.zeros_like(Q)
        L = torch.zeros(*Q.shape[:-1])
        for q, o, l in zip(Q.split(TILE, -2), O.split(TILE, -2), L.split(TILE, -1)):
            m = torch.full(l.shape, float("-inf"))
            for k, v in zip(K.split(TILE, -2), V.split(TILE, -2)):
                s = einsum("...qd,...kd->...qk", q, k) * scale
                new_m = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - new_m.unsqueeze(-1))
                alpha = torch.exp(m - new_m)
                l.mul_(alpha).add_(p.sum(-1))
                o.mul_(alpha.unsqueeze(-1)).add_(einsum("...qk,...kd->...qd", p, v))
                m.copy_(new_m)
            o.div_(l.unsqueeze(-1))
            l.copy_(m + torch.log(l))
        ctx.save_for_backward(L, Q, K, V, O)
        return O

    @staticmethod
    def backward(ctx, dO):
        raise NotImplementedError
"""

SAME_SHAPE = cs336().replace(
    "        Bq, Bk = 32, 32\n", "        assert Q.shape == K.shape\n        Bq, Bk = 32, 32\n"
)

SUBMISSIONS: dict[str, tuple[str, str]] = {
    # code: (what its name is in the file, the file)
    "": ("FlashAttention", cs336()),
    "unscaled": ("FlashAttention", cs336(SCALE="1.0")),
    "scaled-by-dk": ("FlashAttention", cs336(SCALE="1 / d")),
    "flash-no-rescale": ("FlashAttention", cs336(O_UPDATE="o + P @ v")),
    "flash-sum-not-rescaled": ("FlashAttention", cs336(L_UPDATE="l + P.sum(dim=-1)")),
    "flash-max-not-updated": (
        "FlashAttention",
        cs336(M_NEW="S.amax(dim=-1) if j == 0 else m"),
    ),
    "flash-final-divide-missing": ("FlashAttention", cs336(O_FINAL="o")),
    "flash-lse-wrong-base": ("FlashAttention", cs336(LSE="m + torch.log2(l)")),
    "flash-lse-without-max": ("FlashAttention", cs336(LSE="torch.log(l)")),
    "flash-empty-tile-nan": ("flash_attention", EMPTY_TILE_NAN),
    "flash-causal-diagonal": (
        "FlashAttention",
        cs336(MASK="torch.zeros_like(S, dtype=torch.bool) if j == i else cols > rows[:, None]"),
    ),
    "flash-causal-offset": (
        "FlashAttention",
        cs336(MASK="torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)"),
    ),
    "flash-causal-ignored": ("FlashAttentionPytorch", IGNORES_CAUSAL),
    "causal-off-by-one": ("FlashAttention", cs336(MASK="cols[None, :] >= rows[:, None]")),
    "flash-last-tile-dropped": ("FlashAttention", cs336(BQ="64", TQ="n_q // Bq")),
    "flash-kv-tiles-from-q": ("FlashAttention", cs336(BK="16", TK="math.ceil(n_q / Bk)")),
    "flash-raised": ("FlashAttention", SAME_SHAPE),
    "flash-backward-D": ("FlashAttention", cs336(D="dO.sum(dim=-1)")),
    "flash-backward-scale": ("FlashAttention", cs336(GRAD_SCALE="1")),
}
"""Each code with the submission that makes it ("" for a right one)."""


def load(code: str) -> Any:
    """The entry point of the submission for ``code``, loaded in this process."""
    name, text = SUBMISSIONS[code]
    namespace: dict[str, Any] = {}
    exec(compile(text, f"<{code or 'right'}>", "exec"), namespace)
    return namespace[name]


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The truth, in float64: softmax(QKᵀ/√d)V and the natural log-sum-exp."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.exp(s - top)
    return e @ v / e.sum(-1, keepdims=True), (top + np.log(e.sum(-1, keepdims=True)))[..., 0]


def run(
    entry: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """The submission's O and L on float32 inputs (NumPy arrays): L returned second, or
    saved by the autograd Function (the saved tensor of shape Q's less its last axis)."""
    import torch

    def as_numpy(t: Any) -> np.ndarray:
        return np.asarray(t.detach().double().numpy())

    autograd = isinstance(entry, type)
    args = [torch.tensor(x, dtype=torch.float32, requires_grad=autograd) for x in (q, k, v)]
    result = entry.apply(*args, causal) if autograd else entry(*args, causal)
    out = result[0] if isinstance(result, tuple) else result
    if autograd:
        saved = [t for t in out.grad_fn.saved_tensors if t.shape == args[0].shape[:-1]]
        lse = saved[0] if saved else None
    else:
        lse = result[1] if isinstance(result, tuple) else None
    return as_numpy(out), None if lse is None else as_numpy(lse)
