"""``tiled_attention``: the public entry of the tiled kernel, with its input checks."""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Callable
from typing import Any

import array_api_compat.torch as torch_xp
import torch

from qkv._array import DtypeMismatchError, check_scale, like_layout
from qkv.kernels._blocks import plan_blocks
from qkv.kernels._threads import call_threads
from qkv.kernels._tiled import Problem, tiled_function
from qkv.masks import Mask, ScoreMod, draw_seed, dropout_keep, with_causal
from qkv.masks._scores import as_score_mod

__all__ = [
    "HUGE_BIAS",
    "as_score_mod",
    "captured_tensors",
    "closes_over_learnable",
    "huge_bias",
    "prepare",
    "run_tiled",
    "tiled_attention",
    "with_sinks",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top-left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: Any = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    skip_blocks: bool = True,
) -> Any:
    """Exact attention in O(L) memory: the FlashAttention algorithm in PyTorch operations.

    The same result as :func:`qkv.scaled_dot_product_attention` (which calls this kernel
    with ``backend="tiled"``, after checking every argument), without ever holding the
    (Lq, Lk) matrix: memory grows with Lq + Lk, not Lq · Lk. Gradients flow to query, key,
    value, bias, sinks and the tensors a ``score_mod`` captures (learned ALiBi slopes, a
    relative-position table) through a backward pass that recomputes each block.

    Args:
        query: (B, H, Lq, D). key: (B, Hkv, Lk, D). value: (B, Hkv, Lk, Dv). Hkv divides H
            (grouped-query attention when smaller).
        mask: a :class:`qkv.masks.Mask` (its block structure lets whole blocks be skipped),
            or booleans broadcastable to (B, H, Lq, Lk), True = may attend.
        bias: added to the scaled scores, broadcastable to (B, H, Lq, Lk).
        score_mod: a :class:`qkv.masks.ScoreMod` or ``fn(score, b, h, q_idx, kv_idx)``,
            applied after the bias and before the mask.
        is_causal, causal_alignment, scale, dropout_p, generator: as in
            :func:`qkv.scaled_dot_product_attention` (dropout follows
            :func:`qkv.masks.dropout_keep`, the same weights as the reference drops).
        sinks: per-head sink logits, shape (H,): each row's softmax gets one more term
            exp(sink_h) (a key with value 0), so its weights sum to less than 1.
        return_lse: also return the log-sum-exp of each row's scaled scores, (B, H, Lq)
            (−inf for a row with no allowed key); with ``sinks``, the sink's term is part
            of it: log(Σ_j exp(S'_ij) + exp(sink_h)).
        block_q, block_kv: block sizes (default: chosen from the mask's block structure).
        skip_blocks: False evaluates the mask on every block instead of skipping; the
            result is the same to the bit.

    Returns:
        The context (B, H, Lq, Dv), in the dtype of query (float16 and bfloat16 are
        computed in float32); with ``return_lse``, ``(context, lse)``.

    Example:
        >>> import torch
        >>> from qkv import masks
        >>> q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
        >>> out = tiled_attention(q, k, v, mask=masks.sliding_window(16), block_q=64,
        ...                       block_kv=64)
        >>> expected = torch.nn.functional.scaled_dot_product_attention(
        ...     q, k, v, attn_mask=masks.sliding_window(16).dense(300, 300, xp=torch))
        >>> bool(torch.allclose(out, expected, atol=1e-5))
        True
    """
    _check(query, key, value)
    check_scale(scale)
    if isinstance(mask, Mask):
        mask.check_batch(query.shape[0])
    return run_tiled(
        query,
        key,
        value,
        rule=with_causal(mask if isinstance(mask, Mask) else None, is_causal, causal_alignment),
        dense_mask=None if mask is None or isinstance(mask, Mask) else _four_dims(mask, "mask"),
        bias=None if bias is None else _four_dims(bias, "bias"),
        score_mod=as_score_mod(score_mod),
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
        dropout_p=float(dropout_p),
        seed=draw_seed(generator, torch_inputs=True) if dropout_p > 0 else None,
        sinks=None if sinks is None else check_sinks(sinks, query),
        return_lse=return_lse,
        block_q=block_q,
        block_kv=block_kv,
        skip_blocks=skip_blocks,
    )


def run_tiled(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rule: Mask | None,
    dense_mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    score_mod: ScoreMod | None,
    scale: float,
    dropout_p: float,
    seed: int | None,
    return_lse: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    skip_blocks: bool = True,
    sinks: torch.Tensor | None = None,
) -> Any:
    """The tiled kernel on checked 4-D inputs, with the options resolved to numbers.

    What :func:`tiled_attention` and the dispatcher's ``tiled`` backend both run: ``rule``
    already holds the causal rule (:func:`qkv.masks.with_causal`), ``dense_mask`` and
    ``bias`` have 4 dimensions broadcastable to (B, H, Lq, Lk), ``scale`` is a number and
    ``seed`` the dropout seed (None without dropout), ``sinks`` the checked (H,) sink
    logits or None.

    Tensors that a ``score_mod`` captures and that require grad are found by running it
    once on a 1 × 1 block (:func:`captured_tensors`) and get their gradients from the
    backward pass, block by block.
    """
    # One call of the kernel: its thread mode is chosen once (see call_threads).
    with call_threads(query.device.type == "cpu"):
        batch, heads, q_len, _ = query.shape
        dtype = query.dtype
        if 0 in (batch, heads, q_len, key.shape[2]):  # nothing to compute: zeros, lse −inf
            return _empty(query, key, value, bias, return_lse)
        q, k, v, bias, problem = prepare(
            query,
            key,
            value,
            rule=rule,
            dense_mask=dense_mask,
            bias=bias,
            score_mod=score_mod,
            scale=scale,
            dropout_p=dropout_p,
            seed=seed,
            block_q=block_q,
            block_kv=block_kv,
            skip_blocks=skip_blocks,
        )
        captured: tuple[torch.Tensor, ...] = ()
        if score_mod is not None and torch.is_grad_enabled():
            captured = captured_tensors(score_mod, query, exclude=(query, key, value, bias, sinks))
        out, lse = tiled_function(q, k, v, bias, problem, captured)
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks.to(q.dtype))
        out = like_layout(out.to(dtype), query)  # the query's memory layout, as torch's
        return (out, lse) if return_lse else out


def prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rule: Mask | None,
    dense_mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    score_mod: ScoreMod | None,
    scale: float,
    dropout_p: float,
    seed: int | None,
    block_q: int | None = None,
    block_kv: int | None = None,
    skip_blocks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Problem]:
    """(q, k, v, bias, problem): the inputs in the compute dtype (float32 for half
    precision), contiguous, and everything else the kernel needs, in numbers: the block
    plan, the dropout pattern, and what the values ask for (non-finite entries, a huge or
    −inf bias; a look at each, made once per call). The same inputs give the same problem,
    so the backward pass of a compiled graph builds it again (``_tiled_ops.py``)."""
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    # The plan first: it refuses a call too long for it before anything is copied.
    plan = plan_blocks(
        rule,
        batch=batch,
        heads=heads,
        q_len=q_len,
        kv_len=kv_len,
        heads_per_kv=heads // kv_heads,
        block_q=block_q,
        block_kv=block_kv,
        skip=skip_blocks,
        dense_mask=dense_mask is not None,
    )
    dtype = query.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = (x.to(compute).contiguous() for x in (query, key, value))
    if bias is not None and bias.dtype != compute:
        bias = bias.to(compute)
    keep = None
    if dropout_p > 0 and seed is not None:
        keep = dropout_keep(dropout_p, seed)
    masked = rule is not None or dense_mask is not None
    exact = masked and (score_mod is not None or not _all_finite(q, k, bias))
    huge = bias is not None and huge_bias(bias)
    # A −inf bias (or a score modifier, which may return −inf) masks keys out: their weights
    # must be exactly 0. Checked once per call; the no-bias path never pays for it.
    blocked = score_mod is not None or (bias is not None and _holds_neg_inf(bias))
    problem = Problem(
        scale=scale,
        rule=rule,
        dense_mask=dense_mask,
        score_mod=score_mod,
        dropout_p=dropout_p,
        keep=keep,
        plan=plan,
        skip=skip_blocks,
        exact_masking=exact,
        huge=huge,
        blocked_scores=blocked,
    )
    return q, k, v, bias, problem


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context and log-sum-exp of attention with sinks, from those without.

    The sink of head h is one more key with score sink_h and value 0, so with
    Z_i = exp(lse_i) (the row's sum without the sink), the weights become
    exp(S'_ij) / (Z_i + exp(sink_h)) and the context O_i · Z_i / (Z_i + exp(sink_h)) =
    O_i · σ(lse_i − sink_h): O(L) work after the kernel, and exact. Autograd through these
    few operations gives d(sinks)_h = −Σ_i share_i (dO_i · O'_i) (share_i = σ(sink_h −
    lse_i), O' the context with the sink) and sends the rest back through the kernel's
    backward as the gradients of its output and its lse. A fully masked row (lse = −inf)
    gives zeros; a −inf sink is no sink.
    """
    sink = sinks.view(1, -1, 1)
    real = ~torch.isneginf(sink)
    finite = torch.where(real, sink, torch.zeros_like(sink))
    kept = torch.where(real, torch.sigmoid(lse - finite), torch.ones_like(lse))
    new_lse = torch.where(real, torch.logaddexp(lse, finite), lse)
    return out * kept.unsqueeze(-1), new_lse


def captured_tensors(
    score_mod: ScoreMod, like: torch.Tensor, *, exclude: tuple[torch.Tensor | None, ...] = ()
) -> tuple[torch.Tensor, ...]:
    """The leaf tensors requiring grad that ``score_mod``'s output depends on (learned ALiBi
    slopes, a bias table, per-head scalars), found by running it on a 1 × 1 block of
    position 0 and walking the autograd graph of the result.

    A captured tensor computed from a leaf (``slopes = log_slopes.exp()``) leads to the
    leaf: the backward pass differentiates through that computation for each block.
    """
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=like.device)
    score = torch.zeros((1, 1, 1, 1), dtype=like.dtype, device=like.device)
    with torch.enable_grad():
        try:
            probe = score_mod(score, zero, zero, zero, zero, 1, 1, torch_xp)
        except Exception:  # the forward pass reports the modifier's own error
            return ()  # not callable on one position: assume it captures nothing
    grad_fn = getattr(probe, "grad_fn", None)
    found: dict[int, torch.Tensor] = {}
    skip = {id(t) for t in exclude if t is not None}
    seen: set[int] = set()
    stack = [grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in skip:
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return tuple(found.values())


def closes_over_learnable(
    score_mod: object, *, exclude: tuple[torch.Tensor | None, ...] = (), depth: int = 0
) -> bool:
    """Whether ``score_mod`` holds a tensor that requires grad: in its closure, its defaults,
    the module-level names its code reads, a ScoreMod's fields, or the lists, tuples and
    dictionaries among them (``exclude``'s tensors do not count).

    A check by reading, which the probe of :func:`captured_tensors` cannot replace: a
    modifier that raises on a 1 × 1 block, or whose probe leaves no autograd graph, still
    holds its learned tables. It answers "may learn" (a held tensor the output does not use
    counts too), which is what dispatch needs to keep such a modifier off FlexAttention.

    Example:
        >>> table = torch.zeros(3, requires_grad=True)
        >>> closes_over_learnable(lambda s, b, h, q, kv: s + table[0])
        True
        >>> closes_over_learnable(lambda s, b, h, q, kv: s * 0.5)
        False
    """
    if depth > 16:
        return False
    skip = {id(t) for t in exclude if t is not None}

    def inner(obj: object) -> bool:
        return closes_over_learnable(obj, exclude=exclude, depth=depth + 1)

    if isinstance(score_mod, torch.Tensor):
        return bool(score_mod.requires_grad) and id(score_mod) not in skip
    if isinstance(score_mod, ScoreMod):
        return any(inner(value) for value in vars(score_mod).values())
    if isinstance(score_mod, types.FunctionType):
        cells = []
        for cell in score_mod.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not filled yet
                cells.append(cell.cell_contents)
        names = [
            score_mod.__globals__[name]
            for name in score_mod.__code__.co_names
            if name in score_mod.__globals__
        ]
        return any(inner(x) for x in (*cells, *(score_mod.__defaults__ or ()), *names))
    if isinstance(score_mod, functools.partial):
        return any(
            inner(x) for x in (score_mod.func, *score_mod.args, *score_mod.keywords.values())
        )
    if isinstance(score_mod, list | tuple):
        return any(inner(x) for x in score_mod)
    if isinstance(score_mod, dict):
        return any(inner(x) for x in score_mod.values())
    return False


def check_sinks(sinks: Any, query: torch.Tensor) -> torch.Tensor:
    """``sinks`` for a query (B, H, L, D): a floating (H,) tensor, finite or −inf."""
    heads = query.shape[1]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(
            f"sinks must be a floating-point torch.Tensor of shape ({heads},), got "
            f"{type(sinks).__name__}. Hint: torch.zeros({heads}) or an nn.Parameter."
        )
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape ({heads},), one logit per query head; got "
            f"{tuple(sinks.shape)}. Hint: under grouped-query attention each query head "
            "has its own sink."
        )
    if bool((torch.isnan(sinks) | torch.isposinf(sinks)).any()):
        raise ValueError(
            "sinks must be finite or −inf (no sink), got NaN or +inf. Hint: check the "
            "parameter for a diverged update."
        )
    return sinks


HUGE_BIAS = 2.0**16
"""A bias with a finite entry beyond ±this (transformers' "blocked" −3.4e38, a −1e9 mask) is
added in natural units, and each row's maximum is kept apart from its log-sum
(:attr:`qkv.kernels._blockwise.Problem.huge`)."""


def huge_bias(bias: torch.Tensor) -> bool:
    """Whether a finite entry of ``bias`` lies beyond ±:data:`HUGE_BIAS` (one pass over the
    bias, two when it holds ±inf or NaN)."""
    with torch.no_grad():
        if bias.numel() == 0 or bool(bias.abs().amax() <= HUGE_BIAS):
            return False
        finite = torch.where(torch.isfinite(bias), bias.abs(), 0.0)
        return bool(finite.amax() > HUGE_BIAS)


def _empty(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    return_lse: bool,
) -> Any:
    """The result of a call with no batch element, head, query or key: zeros (a query with
    no key attends to nothing), lse −inf, part of the graph (its gradients are zeros)."""
    batch, heads, q_len = query.shape[:3]
    out = query.new_zeros((batch, heads, q_len, value.shape[3]))
    inputs = [query, key, value] + ([] if bias is None else [bias])
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        out = out + sum(x.sum() * 0 for x in inputs)
    lse = query.new_full((batch, heads, q_len), -math.inf)
    return (out, lse) if return_lse else out


def _all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every entry is finite (one pass over each; then masking by adding −inf is
    exact, as a finite score plus −inf is −inf)."""
    for t in tensors:
        # A sum is finite when every entry is (one fast pass); if it overflows, look closer.
        summed = math.inf if t is None else float(t.detach().sum())
        if t is not None and not math.isfinite(summed) and not bool(torch.isfinite(t).all()):
            return False
    return True


def _holds_neg_inf(bias: torch.Tensor) -> bool:
    """Whether ``bias`` has a −inf entry (one pass when its sum is finite)."""
    with torch.no_grad():
        return not _all_finite(bias) and bool(torch.isneginf(bias).any())


def _four_dims(x: torch.Tensor, name: str) -> torch.Tensor:
    """Add leading axes of size 1 (views) up to (B, H, Lq, Lk)."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions (B, H, Lq, Lk), got {x.ndim}")
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def _check(query: Any, key: Any, value: Any) -> None:
    named = (("query", query), ("key", key), ("value", value))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor for the tiled kernel, got {type(x).__name__}. "
                "Hint: qkv.scaled_dot_product_attention runs NumPy arrays with the reference."
            )
        if x.ndim != 4 or x.dtype not in _FLOATS:
            raise ValueError(
                f"{name} must be a floating-point tensor of 4 dimensions (B, H, L, D), got "
                f"{x.dtype} of shape {tuple(x.shape)}. Hint: qkv.scaled_dot_product_attention "
                "takes other layouts and checks them."
            )
    if len({x.dtype for _, x in named}) > 1:
        raise DtypeMismatchError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}. Hint: convert them with .to(query.dtype)."
        )
    if len({x.device for _, x in named}) > 1:
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device} "
            f"and {value.device}. Hint: move them with .to(query.device)."
        )
    (b, h, _, d), (bk, hkv, lk, dk), (bv, hv, lv, _) = query.shape, key.shape, value.shape
    if d != dk or (bk, hkv, lk) != (bv, hv, lv):
        raise ValueError(
            f"shapes do not fit: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}. Hint: (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)."
        )
    if b != bk or (hkv == 0 and h != 0) or (hkv and h % hkv):
        raise ValueError(
            f"query has {h} heads and batch {b}, key {hkv} heads and batch {bk}: the batch "
            "must agree and Hkv must divide H (grouped-query attention)."
        )
