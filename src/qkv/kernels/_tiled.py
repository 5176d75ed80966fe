"""The tiled attention kernel: exact attention in O(L) memory, in plain PyTorch operations.

The FlashAttention algorithm (Dao et al. 2022; Rabe & Staats 2021). The scores are never
held whole: queries are cut into blocks of ``block_q`` rows and keys into blocks of
``block_kv``, and each query block runs once over the key blocks it may see, keeping for
every row

    m  the running maximum of its scores          (for a stable exp)
    l  the running sum of exp(score − m)          (the softmax denominator)
    acc  the running sum of exp(score − m) · v    (the context, not yet divided by l)

When a new block raises the maximum from m to m', the old sums are multiplied by
exp(m − m'), so the result is exactly softmax(S')·V, computed in one pass. (The forward pass
first holds m fixed and takes the running maximum only for the query blocks that need it:
:mod:`qkv.kernels._forward`.) The kernel
keeps only the output, the log-sum-exp ``lse = m + log l`` of each row, and m and 1/l; the
backward pass recomputes each block's weights from them as ``exp(S' − m) · (1/l)``, as the
reference's exp(S' − max) / Σ (a row of equal scores gets exactly 1/L). The layout of the
blocks: :mod:`qkv.kernels._blockwise`.
"""

from __future__ import annotations

from typing import Any

import torch

from qkv.kernels._backward import attention_backward
from qkv.kernels._blockwise import Problem
from qkv.kernels._forward import attention_forward
from qkv.kernels._threads import call_threads

__all__ = ["Problem", "attention_forward", "tiled_function"]


class _TiledAttention(torch.autograd.Function):
    """Forward and backward of the tiled kernel; saves only q, k, v, (bias,) the output and
    two numbers per row (its shift m and 1/l: the backward's weights are exp(s − m) / l).

    ``captured`` are the tensors the score modifier captures (inputs only so that autograd
    sends them their gradients; the modifier itself reads them)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        problem: Problem,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, shift, inverse = attention_forward(q, k, v, bias, problem)
        ctx.save_for_backward(q, k, v, bias, out, shift, inverse)
        ctx.problem = problem
        ctx.captured = captured
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, bias, out, shift, inverse = ctx.saved_tensors
        if grad_out is None:  # only the lse was used
            grad_out = torch.zeros_like(out)
        need_bias = bias is not None and ctx.needs_input_grad[3]
        captured = tuple(ctx.captured)
        wanted = tuple(
            t for t, needed in zip(captured, ctx.needs_input_grad[5:], strict=True) if needed
        )
        with call_threads(q.device.type == "cpu"):  # a call of its own: see there
            dq, dk, dv, dbias, d_wanted = attention_backward(
                q, k, v, bias, out, (shift, inverse), grad_out, grad_lse, ctx.problem,
                need_bias, wanted,
            )  # fmt: skip
        found = dict(zip((id(t) for t in wanted), d_wanted, strict=True))
        d_captured = tuple(found.get(id(t)) for t in captured)
        return (dq, dk, dv, dbias, None, *d_captured)


def tiled_function(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    problem: Problem,
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel, through autograd when a gradient is wanted (for q, k, v, the bias or
    a tensor the score modifier captures)."""
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias, *captured)
    )
    if not wants_grad:
        with torch.no_grad():
            out, lse, _, _ = attention_forward(q, k, v, bias, problem)
            return out, lse
    result: tuple[torch.Tensor, torch.Tensor] = _TiledAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, bias, problem, *captured
    )
    return result
