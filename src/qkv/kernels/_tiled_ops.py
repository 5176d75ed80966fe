"""The tiled kernel as operators that ``torch.compile`` takes whole.

Shape legend: B batch, H query heads, Hkv key/value heads, Lq / Lk query / key length,
D head dim, Dv value dim.

The kernel reads values to plan its work (which blocks a mask leaves empty, whether a bias
is huge or holds −inf, whether an input holds NaN) and runs Python loops over blocks and
threads: nothing a graph can hold. So a compiled graph calls it through two custom
operators, ``qkv::tiled_attention`` and its backward ``qkv::tiled_attention_backward``,
whose inside runs as without compilation (an eager island: the graph sees one operator with
a shape-only fake implementation). The backward gets what the forward kept (the output and
each row's shift m and 1/l) and builds the same block plan again from the same inputs
(:func:`qkv.kernels._api.prepare`); nothing is computed twice.

The forward takes an optional ``candidate``: torch's SDPA output of the same call, computed
in the graph. It is returned as it is when :func:`~qkv.kernels._torch_sdpa.sdpa_trusted`
keeps it (no NaN or ±inf in query, key, value or the output, no huge bias with a gradient),
else the tiled kernel redoes the call: the eager sdpa backend's check, with the same outcome.
A kept candidate passes its whole gradient on to torch's SDPA in the graph; a candidate
redone gets a zero gradient, which torch's backward turns into NaN if its inputs hold any,
so a graph that wants gradients computes the candidate from inputs whose NaN and ±inf are
replaced by 0 (:func:`finite`; equal to the inputs whenever the candidate is kept).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qkv.kernels._api import check_sinks, prepare, with_sinks
from qkv.kernels._backward import attention_backward
from qkv.kernels._forward import attention_forward
from qkv.kernels._threads import call_threads
from qkv.kernels._tiled import Problem
from qkv.kernels._torch_sdpa import sdpa_trusted
from qkv.masks import with_causal

__all__ = ["finite", "tiled_in_graph"]


def tiled_in_graph(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    seed: torch.Tensor | None,
    candidate: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    scale: float,
    dropout_p: float,
    grad: bool,
) -> torch.Tensor:
    """The context (B, H, Lq, Dv) in query's dtype, from a compiled graph: the tiled
    kernel (or a kept ``candidate``) as one operator, the sinks applied in the graph.

    Args:
        query, key, value: (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv).
        mask: booleans broadcastable to (B, H, Lq, Lk), True = may attend, or None.
        bias: 4 dimensions broadcastable to (B, H, Lq, Lk), or None.
        sinks: (H,) sink logits, or None (their values are checked when the graph runs).
        seed: the dropout seed as a one-element int64 tensor, or None.
        candidate: torch's SDPA output of the call (B, H, Lq, Dv), or None.
        is_causal, causal_alignment, scale, dropout_p: as in the tiled kernel.
        grad: a gradient will be asked for (a huge bias then refuses a candidate).
    """
    out, lse, _, _, _ = torch.ops.qkv.tiled_attention(
        query,
        key,
        value,
        mask,
        bias,
        sinks,
        seed,
        candidate,
        is_causal,
        causal_alignment,
        scale,
        dropout_p,
        grad,
    )
    if candidate is None and sinks is not None:
        out, _ = with_sinks(out, lse, sinks.to(out.dtype))
    result: torch.Tensor = out.to(query.dtype)
    return result


def finite(x: torch.Tensor) -> torch.Tensor:
    """x with its NaN and ±inf replaced by 0 (elementwise, in the graph)."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _problem(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    flags: tuple[bool, str, float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Problem]:
    is_causal, alignment, scale, dropout_p = flags
    side = "bottom-right" if alignment == "bottom-right" else "top-left"
    return prepare(
        query,
        key,
        value,
        rule=with_causal(None, is_causal, side),
        dense_mask=mask,
        bias=bias,
        score_mod=None,
        scale=scale,
        dropout_p=dropout_p,
        seed=None if seed is None else int(seed.item()),
    )


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype


@torch.library.custom_op("qkv::tiled_attention", mutates_args=())
def _forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    seed: torch.Tensor | None,
    candidate: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    scale: float,
    dropout_p: float,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, shift, inverse, ran): out (B, H, Lq, Dv), contiguous, and the three
    (B, H, Lq) in the compute dtype (float32 for half inputs): the log-sum-exp, and each
    row's shift m and 1/l, what the backward pass makes the weights from; ``ran``: whether
    the kernel ran (False: the candidate kept)."""
    if sinks is not None:
        check_sinks(sinks, query)  # the values: what the graph could not read
    batch, heads, q_len = query.shape[:3]
    compute = _compute_dtype(query)
    rows = query.new_zeros((batch, heads, q_len), dtype=compute)
    if candidate is not None and sdpa_trusted(candidate, query, key, bias, grad=grad, value=value):
        kept = candidate.to(compute, memory_format=torch.contiguous_format, copy=True)
        return kept, rows, rows.clone(), rows.clone(), _flag(False, query)
    if 0 in (batch, heads, q_len, key.shape[2]):  # nothing to compute: zeros, lse −inf
        out = query.new_zeros((batch, heads, q_len, value.shape[3]), dtype=compute)
        lse = query.new_full((batch, heads, q_len), -math.inf, dtype=compute)
        return out, lse, rows, rows.clone(), _flag(True, query)
    flags = (is_causal, causal_alignment, scale, dropout_p)
    with call_threads(query.device.type == "cpu"):
        q, k, v, b, problem = _problem(query, key, value, mask, bias, seed, flags)
        out, lse, shift, inverse = attention_forward(q, k, v, b, problem)
    # lse, shift and inverse are views of one allocation: outputs of an operator never alias
    return out, lse, shift.clone(), inverse.clone(), _flag(True, query)


@_forward_op.register_fake
def _forward_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shapes and dtypes of the forward's results (contiguous, as the kernel gives)."""
    batch, heads, q_len = query.shape[:3]
    compute = _compute_dtype(query)
    out = query.new_empty((batch, heads, q_len, value.shape[3]), dtype=compute)
    lse, shift, inverse = (query.new_empty((batch, heads, q_len), dtype=compute) for _ in "lmi")
    return out, lse, shift, inverse, query.new_empty((), dtype=torch.bool)


@torch.library.custom_op("qkv::tiled_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    out: torch.Tensor,
    shift: torch.Tensor,
    inverse: torch.Tensor,
    ran: torch.Tensor,
    is_causal: bool,
    causal_alignment: str,
    scale: float,
    dropout_p: float,
    wanted: list[bool],
) -> list[torch.Tensor]:
    """[d query, d key, d value, d bias, d candidate], each in its input's dtype, or an
    empty tensor where ``wanted`` says no. A kept candidate takes the whole gradient (the
    others are zeros); else the tiled kernel's backward pass gives them."""
    inputs = (query, key, value, bias)
    zeros = [
        x.new_zeros(x.shape) if w and x is not None else _nothing(query)
        for x, w in zip(inputs, wanted, strict=False)
    ]
    if not bool(ran):  # the candidate was kept: torch's SDPA takes the gradient
        kept = _nothing(query)
        if wanted[4]:
            kept = grad_out.to(query.dtype, memory_format=torch.contiguous_format, copy=True)
        return [*zeros, kept]
    candidate = query.new_zeros(grad_out.shape) if wanted[4] else _nothing(query)
    if 0 in (*query.shape[:3], key.shape[2]):
        return [*zeros, candidate]
    flags = (is_causal, causal_alignment, scale, dropout_p)
    with call_threads(query.device.type == "cpu"):
        q, k, v, b, problem = _problem(query, key, value, mask, bias, seed, flags)
        need_bias = bool(wanted[3]) and b is not None
        dq, dk, dv, dbias, _ = attention_backward(
            q, k, v, b, out, (shift, inverse), grad_out, grad_lse, problem, need_bias
        )
    grads = [dq, dk, dv, dbias]
    result = [
        g.to(x.dtype).contiguous() if w and g is not None and x is not None else z
        for g, x, w, z in zip(grads, inputs, wanted, zeros, strict=False)
    ]
    return [*result, candidate]


@_backward_op.register_fake
def _backward_fake(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *rest: Any,
) -> list[torch.Tensor]:
    """The gradients' shapes (contiguous, as the kernel gives them); ``rest[-1]``: wanted."""
    wanted = rest[-1]
    shaped = [
        x.new_empty(x.shape) if w and x is not None else _nothing(query)
        for x, w in zip((query, key, value, bias), wanted, strict=False)
    ]
    candidate = query.new_empty(grad_out.shape) if wanted[4] else _nothing(query)
    return [*shaped, candidate]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    query, key, value, mask, bias, _, seed, _, is_causal, alignment, scale, p, _ = inputs
    out, _, shift, inverse, ran = output
    ctx.save_for_backward(query, key, value, mask, bias, seed, out, shift, inverse, ran)
    ctx.flags = (is_causal, alignment, scale, p)


def _backward(
    ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None, *_: Any
) -> tuple[torch.Tensor | None, ...]:
    query, key, value, mask, bias, seed, out, shift, inverse, ran = ctx.saved_tensors
    need = ctx.needs_input_grad  # query, key, value, mask, bias, sinks, seed, candidate, …
    wanted = [bool(need[i]) for i in (0, 1, 2, 4, 7)]
    if grad_out is None:  # only the lse was used
        grad_out = torch.zeros_like(out)
    grads = torch.ops.qkv.tiled_attention_backward(
        grad_out,
        grad_lse,
        query,
        key,
        value,
        mask,
        bias,
        seed,
        out,
        shift,
        inverse,
        ran,
        *ctx.flags,
        wanted,
    )
    dq, dk, dv, dbias, dcandidate = (g if w else None for g, w in zip(grads, wanted, strict=True))
    return (dq, dk, dv, None, dbias, None, None, dcandidate, None, None, None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup)


def _nothing(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor: a gradient that is not asked for."""
    return like.new_empty((0,))


def _flag(value: bool, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, device=like.device)
