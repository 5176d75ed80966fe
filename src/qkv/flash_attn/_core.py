"""The one computation behind every function of ``qkv.flash_attn``, and its checks.

Each public function turns its layout into (B, H, L, D) tensors and a :class:`Positions`:
where each query and key row sits in its sequence, counted from the sequence's end (as
flash-attn aligns causal masks, windows and ALiBi to the bottom-right corner). One call of
:func:`attend` then runs qkv's attention with the matching mask rule and score modifier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import array_api_compat.torch as torch_xp
import torch

from qkv.attention import scaled_dot_product_attention
from qkv.kernels import tiled_attention
from qkv.masks import Mask, ScoreMod, draw_seed, dropout_keep
from qkv.masks import softcap as softcap_mod

__all__ = ["Positions", "Result", "attend", "check_dtypes", "check_heads", "fail", "window"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fail(who: str, message: str) -> ValueError:
    """The one-line error of ``who``: ``"flash_attn_func: <message>"``."""
    return ValueError(f"{who}: {message}")


def check_dtypes(who: str, **tensors: torch.Tensor) -> None:
    """Tensors of one floating dtype and one device, each named in the error."""
    first_name, first = next(iter(tensors.items()))
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise fail(
                who,
                f"{name} must be a torch.Tensor, got {type(x).__name__}. Hint: torch.as_tensor(x).",
            )
        if x.dtype not in _FLOATS:
            raise fail(
                who,
                f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}. "
                "Hint: x.float().",
            )
        if x.dtype != first.dtype:
            raise fail(
                who,
                f"{name} is {x.dtype} but {first_name} is {first.dtype}; expected one dtype. "
                f"Hint: {name}.to({first_name}.dtype).",
            )
        if x.device != first.device:
            raise fail(
                who,
                f"{name} is on {x.device} but {first_name} on {first.device}; expected one device.",
            )


def check_block_table(who: str, block_table: Any, batch: int) -> None:
    """``block_table`` must be integers of shape (batch, max_num_blocks_per_seq): each row
    the pages of one sequence.

    Raises:
        ValueError: anything else, in one line naming it.
    """
    if not integers(block_table, 2, batch):
        raise fail(
            who,
            f"block_table must be integers of shape ({batch}, max_num_blocks_per_seq), the "
            f"pages of each sequence, got {described(block_table)}.",
        )


def integers(x: Any, ndim: int, batch: int) -> TypeGuard[torch.Tensor]:
    """Whether ``x`` is an integer tensor of ``ndim`` axes, the first of size ``batch``."""
    return (
        isinstance(x, torch.Tensor)
        and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
        and x.ndim == ndim
        and x.shape[0] == batch
    )


def described(x: Any) -> str:
    """A tensor's dtype and shape, or another value's type: what came, for an error."""
    return (
        f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
    )


def check_heads(who: str, heads: int, kv_heads: int, kv_name: str = "k") -> None:
    """The key/value heads divide the query heads (GQA/MQA)."""
    if kv_heads == 0 or heads % kv_heads != 0:
        raise fail(
            who,
            f"{kv_name} has {kv_heads} heads, which must divide q's {heads} heads. Hint: in "
            "grouped-query attention each key/value head serves nheads / nheads_k query heads.",
        )


def window(who: str, window_size: Any, causal: bool) -> tuple[int | None, int | None]:
    """flash-attn's ``window_size=(left, right)`` (a tuple, or two integers in a tensor, as
    flash-attn's tests pass it) as limits (None: no limit); causal sets right to 0."""
    ok = isinstance(window_size, tuple | list | torch.Tensor) and len(window_size) == 2
    values = list(window_size) if ok else []
    values = [int(n) if isinstance(n, torch.Tensor) and n.numel() == 1 else n for n in values]
    if not ok or any(isinstance(n, bool) or not isinstance(n, int) or n < -1 for n in values):
        raise fail(
            who,
            f"window_size must be two integers (left, right), each ≥ 0 or −1 for no limit, "
            f"got {window_size!r}. Hint: window_size=(255, 0) is a causal window of 256 keys.",
        )
    left, right = (None if n < 0 else n for n in values)
    if causal:
        right = 0
    return left, right


@dataclass(frozen=True)
class Positions:
    """Where each row of the (B, H, Lq, Lk) problem sits in its sequence.

    Attributes:
        seq_q: (B, Lq) int64, the sequence of each query row (which ALiBi slopes it uses).
        rel_q: (B, Lq) int64, i − (the sequence's number of queries): −1 for its last query.
        seq_k: (B, Lk) int64, the sequence of each key row, −1 for rows that are no key
            (beyond a cache's length, before its left padding).
        rel_k: (B, Lk) int64, j − (the index one past the sequence's last key).
        keys_q: (B, Lq) int64, how many keys the query's sequence has.
        sequences: the number of sequences (rows of a (batch, nheads) ``alibi_slopes``).
        mask: the rule qkv runs (None: every key), equal to what the tables say.
    """

    seq_q: torch.Tensor
    rel_q: torch.Tensor
    seq_k: torch.Tensor
    rel_k: torch.Tensor
    keys_q: torch.Tensor
    sequences: int
    mask: Mask | None


@dataclass(frozen=True)
class Result:
    """The output (B, H, Lq, Dv), and when asked the log-sum-exp (B, H, Lq) and the
    probabilities with dropped entries negative (B, H, Lq, Lk)."""

    out: torch.Tensor
    lse: torch.Tensor | None
    probs: torch.Tensor | None


def alibi_table(who: str, slopes: Any, sequences: int, heads: int, device: Any) -> torch.Tensor:
    """``alibi_slopes`` (nheads,) or (batch, nheads) as a (batch, nheads) float64 table."""
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        got = f"{slopes.dtype}" if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise fail(
            who,
            f"alibi_slopes must be a float tensor (nheads,) or (batch, nheads), got {got}. "
            "Hint: torch.tensor(qkv.masks.alibi_slopes(nheads)).",
        )
    shape = tuple(slopes.shape)
    if shape not in ((heads,), (sequences, heads)):
        raise fail(
            who,
            f"alibi_slopes must be ({heads},) or ({sequences}, {heads}) (nheads, or batch × "
            f"nheads), got {shape}. Hint: one slope per query head.",
        )
    table = slopes.detach().to(device=device, dtype=torch.float64)
    return table.expand(sequences, heads) if table.ndim == 1 else table


def _alibi_mod(slopes: torch.Tensor, where: Positions) -> ScoreMod:
    """−slope · |i + Lk − Lq − j| of each query's sequence: the bias flash-attn adds."""

    def rule(s: Any, b: Any, h: Any, q: Any, kv: Any, lq: int, lk: int, xp: Any) -> Any:
        seq = where.seq_q[b, q]
        slope = slopes[seq.clamp(min=0), h]
        distance = (where.rel_q[b, q] - where.rel_k[b, kv]).abs()
        return s - (slope * distance).to(s.dtype)

    return ScoreMod(rule, "alibi(flash_attn slopes, bottom-right)")


def attend(
    who: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: Positions,
    *,
    softmax_scale: float | None,
    kernel_causal: bool,
    softcap: float,
    alibi_slopes: Any,
    dropout_p: float,
    want_lse: bool,
    want_probs: bool,
) -> Result:
    """Attention of q (B, H, Lq, D) over k, v (B, Hkv, Lk, D) under ``where.mask``.

    ``kernel_causal``: flash-attn's kernel ran its causal path, where ALiBi is added as
    slope · j (the same softmax); its log-sum-exp is then larger by slope · (i + Lk − Lq)
    than that of −slope · |i + Lk − Lq − j|, and that is what is returned.
    """
    if isinstance(softmax_scale, bool) or not (
        softmax_scale is None or isinstance(softmax_scale, int | float)
    ):
        raise fail(who, f"softmax_scale must be a number or None, got {softmax_scale!r}.")
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    if not math.isfinite(scale):
        raise fail(who, f"softmax_scale must be finite, got {softmax_scale!r}.")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float):
        raise fail(who, f"dropout_p must be a number in [0, 1), got {dropout_p!r}.")
    if not 0.0 <= dropout_p < 1.0:
        raise fail(
            who,
            f"dropout_p must be in [0, 1), got {dropout_p!r}. Hint: 0.0 at evaluation.",
        )
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or softcap < 0:
        raise fail(
            who, f"softcap must be a number ≥ 0 (0: off), got {softcap!r}. Hint: softcap=50.0."
        )
    heads = int(q.shape[1])
    mod: ScoreMod | None = softcap_mod(float(softcap)) if softcap > 0 else None
    slopes: torch.Tensor | None = None
    if alibi_slopes is not None:
        slopes = alibi_table(who, alibi_slopes, where.sequences, heads, q.device)
        alibi = _alibi_mod(slopes, where)
        mod = alibi if mod is None else mod.then(alibi)
    seed = draw_seed(None, torch_inputs=True) if dropout_p > 0 else 0
    gqa = heads != int(k.shape[1])
    lse: torch.Tensor | None = None
    if torch.compiler.is_compiling() and (mod is not None or want_lse or want_probs):
        out, row_lse, shown = _in_graph(q, k, v, where.mask, mod, scale, float(dropout_p), seed)
        if want_lse:
            lse = _flash_lse(row_lse, q.dtype, where, slopes if kernel_causal else None)
        return Result(out, lse, shown if want_probs else None)
    if want_lse:
        out, lse = tiled_attention(
            q,
            k,
            v,
            mask=where.mask,
            score_mod=mod,
            scale=scale,
            dropout_p=float(dropout_p),
            generator=seed,
            return_lse=True,
        )
        lse = _flash_lse(lse.detach(), q.dtype, where, slopes if kernel_causal else None)
    else:
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=where.mask,
            score_mod=mod,
            scale=scale,
            enable_gqa=gqa,
            dropout_p=float(dropout_p),
            generator=seed,
        )
    probs: torch.Tensor | None = None
    if want_probs:
        probs = _probs(q, k, v, where.mask, mod, scale, gqa, float(dropout_p), seed)
    return Result(out, lse, probs)


def _in_graph(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    mod: ScoreMod | None,
    scale: float,
    dropout_p: float,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call as plain tensor operations, what a compiled graph holds when a score
    modifier (softcap, ALiBi) or the log-sum-exp is asked for (qkv's dispatcher takes
    neither into a graph): the (B, H, Lq, Lk) scores in float32 (float64 for float64
    inputs), torch's autograd for the backward.

    Returns:
        The output (B, H, Lq, Dv) in q's dtype, the natural log-sum-exp (B, H, Lq) (−inf for
        a row with no key; no gradient) and the probabilities (B, H, Lq, Lk), negative where
        dropout drops them (no gradient).
    """
    from qkv.kernels._torch_sdpa import evaluate_rule

    batch, heads, lq, lk = int(q.shape[0]), int(q.shape[1]), int(q.shape[2]), int(k.shape[2])
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = heads // int(k.shape[1])
    keys = k.to(work).repeat_interleave(group, dim=1)  # (B, H, Lk, D)
    values = v.to(work).repeat_interleave(group, dim=1)  # (B, H, Lk, Dv)
    scores = q.to(work) @ keys.mT * scale  # (B, H, Lq, Lk)
    if mod is not None:
        b, h, i, j = (
            torch.arange(n, device=q.device).view(shape)
            for n, shape in (
                (batch, (-1, 1, 1, 1)),
                (heads, (1, -1, 1, 1)),
                (lq, (1, 1, -1, 1)),
                (lk, (1, 1, 1, -1)),
            )
        )
        scores = mod(scores, b, h, i, j, lq, lk, torch_xp)
    if mask is not None:
        scores = scores.masked_fill(~evaluate_rule(mask, q, k), -math.inf)
    top = scores.detach().amax(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=work, device=q.device))
    exp = torch.exp(scores - top)  # 0 for every key a row may not attend
    total = exp.sum(dim=-1, keepdim=True)
    probs = exp / torch.where(total > 0, total, torch.ones((), dtype=work, device=q.device))
    lse = (top + torch.log(total.detach()))[..., 0]  # (B, H, Lq)
    kept = probs
    if dropout_p > 0:
        keep = dropout_keep(dropout_p, seed).dense(
            lq, lk, batch=batch, heads=heads, xp=torch_xp, device=q.device
        )
        kept = torch.where(keep, probs / (1.0 - dropout_p), torch.zeros_like(probs))
        shown = torch.where(keep, probs, -probs).detach()
    else:
        shown = probs.detach()
    out = (kept @ values).to(q.dtype)  # (B, H, Lq, Dv)
    return out, lse, shown.to(q.dtype)


def _flash_lse(
    lse: torch.Tensor, dtype: torch.dtype, where: Positions, causal_slopes: torch.Tensor | None
) -> torch.Tensor:
    """The log-sum-exp as flash-attn returns it: float32 (float64 for float64 inputs),
    +inf for a row with no key, ALiBi's causal form added where its kernel uses it."""
    lse = lse.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if causal_slopes is not None:
        seq = where.seq_q.clamp(min=0)  # (B, Lq)
        shift = (where.rel_q + where.keys_q).to(torch.float64)  # i + Lk − Lq
        per_head = causal_slopes[seq].permute(0, 2, 1) * shift[:, None, :]  # (B, H, Lq)
        lse = torch.where(torch.isfinite(lse), lse + per_head.to(lse.dtype), lse)
    return torch.where(lse == -math.inf, math.inf, lse)


def _probs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    mod: ScoreMod | None,
    scale: float,
    gqa: bool,
    dropout_p: float,
    seed: int,
) -> torch.Tensor:
    """The exact softmax (B, H, Lq, Lk) on qkv's reference, negative where dropout drops
    (flash-attn's S_dmask convention)."""
    with torch.no_grad():
        _, weights = scaled_dot_product_attention(
            q.detach(),
            k.detach(),
            v.detach(),
            mask=mask,
            score_mod=mod,
            scale=scale,
            enable_gqa=gqa,
            return_weights=True,
            backend="reference",
        )
        if dropout_p > 0:
            batch, heads, lq, lk = weights.shape
            keep = dropout_keep(dropout_p, seed).dense(
                lq, lk, batch=batch, heads=heads, xp=torch_xp, device=q.device
            )
            weights = torch.where(keep, weights, -weights)
    return weights  # type: ignore[no-any-return]
