"""Attention under ``torch.compile``: what the graph holds, and what runs outside it.

Shape legend: B batch, H query heads, Lq / Lk query / key length, Dv value dim.

While ``torch.compile`` traces a call (``fullgraph=True`` included), the dispatcher decides
from shapes, dtypes and options alone, and reads no value:

- a qkv mask rule becomes a boolean tensor of the rule's own broadcast shape ((B, 1, 1, Lk)
  for key padding), an additive score modifier (ALiBi) a bias (``make_call``);
  causality stays a flag;
- when torch's fused SDPA can run the call (:func:`~qkv.attention._backends.sdpa_static_refusal`),
  it runs in the graph. With a mask or a bias, its output is the *candidate* of the tiled
  kernel's operator, which keeps it when the eager sdpa backend would (no NaN or ±inf
  reached it, no huge bias with a gradient) and else redoes the call
  (:mod:`qkv.kernels._tiled_ops`; when a gradient is wanted, SDPA then sees the inputs with
  NaN and ±inf replaced by 0, so that its backward stays finite on a redone call);
- else the tiled kernel runs as that operator (dropout, sinks, masks too large for SDPA): an
  eager island, whose backward is the kernel's own;
- the rest runs outside the graph, as a graph break that ``fullgraph=True`` reports with
  its reason: weights asked for (the reference forms them), a backend torch.compile cannot
  trace (``reference``, ``flex``), more than four dimensions, a trace.

Every path computes what the eager dispatcher computes; only which fast backend runs a call
may differ (on CUDA, auto's eager choice of compiled FlexAttention for a rule becomes SDPA
on the evaluated mask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from qkv._array import Array
from qkv.attention._backend import four, refusal_error, three
from qkv.attention._backends import BACKENDS
from qkv.attention._options import Call
from qkv.kernels import _tiled_ops  # noqa: F401  (its operators exist before a graph is traced)
from qkv.masks import Mask

__all__ = ["outside_graph", "run_compiled", "run_eagerly", "run_in_graph"]


def _run_eagerly(function: Any, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def _outside_graph(function: Any, call: Call, backend: str) -> Any:
    seed = call.options.seed
    if isinstance(seed, torch.Tensor):
        call = replace(call, options=replace(call.options, seed=int(seed.item())))
    return function(call, backend)


run_eagerly: Callable[..., Any] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _run_eagerly,
    reason="qkv.tracing records eager calls: a traced call runs outside the compiled graph",
)
"""``function(*args, **kwargs)`` outside the compiled graph, for a trace (a graph break;
with ``fullgraph=True`` torch.compile raises and says why)."""

outside_graph: Callable[[Any, Call, str], Any] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _outside_graph,
    reason="qkv runs this attention call eagerly: the weights are asked for, or its backend "
    "(reference, flex) or layout (more than 4 dimensions) has no compiled form",
)
"""``function(call, backend)`` outside the compiled graph, the dropout seed drawn in the
graph read as a number (a graph break, as :data:`run_eagerly`)."""


def run_in_graph(
    call: Call, backend: str, eager: Callable[[Call, str], tuple[Array, Array | None]]
) -> tuple[Array, Array | None]:
    """Run ``call`` while torch.compile traces it: in the graph where a backend's
    ``in_graph`` form takes it (:func:`run_compiled`), else ``eager(call, backend)`` outside
    the graph (a trace is recorded there too)."""
    if call.recorder.trace is None:
        result = run_compiled(call, backend)
        if result is not None:
            return result
    return outside_graph(eager, call, backend)  # type: ignore[no-any-return]


def run_compiled(call: Call, backend: str) -> tuple[Array, Array | None] | None:
    """Run ``call`` (torch tensors, no trace) while torch.compile traces it; returns
    (context, None) in the call's layout, or None when the call must run outside the graph
    (:func:`outside_graph`). Auto takes the first backend of the registry whose
    ``in_graph`` form runs the call; a backend without one runs outside the graph.

    Raises:
        ValueError: the backend asked for has an in-graph form that cannot run the call
            (as without torch.compile).
    """
    call = _static(call)
    auto = backend == "auto"
    asked = [backend] if not auto else [n for n, b in BACKENDS.items() if b.in_graph]
    for name in asked:
        form = BACKENDS[name].in_graph if name in BACKENDS else None
        if form is None:
            return None
        result = form(call, auto)
        if not isinstance(result, str):
            return result
        if not auto:
            raise refusal_error(backend, result)
    return None


def _static(call: Call) -> Call:
    """The call with a mask rule as a boolean tensor; a score modifier left here is not
    additive (ALiBi became a bias in ``make_call``) and cannot enter the graph."""
    options = call.options
    modifier = options.score_mod
    if modifier is not None:
        raise TypeError(
            f"score_mod={modifier!r} under torch.compile: only an additive modifier (ALiBi) "
            "becomes a bias in the graph. Hint: compile torch's flex_attention with it, or "
            "run this call outside the compiled code (torch.compiler.disable)."
        )
    mask = options.mask
    if not isinstance(mask, Mask):
        return call
    from qkv.kernels._torch_sdpa import evaluate_rule

    q4, k4 = four(call.query, call.lead), four(call.key, call.lead)
    allowed = three(evaluate_rule(mask, q4, k4), call.lead)  # the call's layout
    return replace(call, options=replace(options, mask=allowed))
