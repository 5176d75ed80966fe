"""The ``tiled`` backend: qkv's tiled kernel (:func:`qkv.kernels.tiled_attention`), O(L)
memory, masks evaluated block by block and their empty blocks skipped; under
``torch.compile`` a custom operator with its own backward. The other PyTorch backends
redo a call on it when a masked NaN reached their output."""

from __future__ import annotations

from typing import Any

from qkv._array import Array
from qkv.attention._backend import Backend, common_refusal, four, four_mask, three
from qkv.attention._options import Call
from qkv.masks import Mask

__all__ = ["TILED", "run_tiled_call", "tiled_operator"]


def tiled_refusal(call: Call, auto: bool = False) -> str | None:
    """Why the tiled kernel refuses ``call`` (from its layout and options alone), or None."""
    return common_refusal(call, "the tiled kernel")


def run_tiled_call(call: Call) -> tuple[Array, Array | None]:
    """The call on the tiled kernel: (context in the call's layout, None)."""
    from qkv.kernels._api import run_tiled

    options, lead = call.options, call.lead
    out = run_tiled(
        four(call.query, lead),
        four(call.key, lead),
        four(call.value, lead),
        rule=options.rule,
        dense_mask=four_mask(options.dense_mask, lead),
        bias=four_mask(options.bias, lead),
        score_mod=options.score_mod,
        scale=options.scale_for(int(call.query.shape[-1])),
        dropout_p=options.dropout_p,
        seed=options.seed,
        sinks=options.sinks,
    )
    return three(out, lead), None


def tiled_operator(call: Call, *, candidate: Any) -> Any:
    """The call on the tiled kernel's operator (keeping sdpa's ``candidate`` when it can):
    the context (B, H, Lq, Dv)."""
    import torch

    from qkv.kernels._tiled_ops import tiled_in_graph

    options, lead = call.options, call.lead
    seed = options.seed
    return tiled_in_graph(
        four(call.query, lead),
        four(call.key, lead),
        four(call.value, lead),
        mask=four_mask(options.dense_mask, lead),
        bias=four_mask(options.bias, lead),
        sinks=options.sinks,
        seed=seed if isinstance(seed, torch.Tensor) else None,
        candidate=candidate,
        is_causal=options.is_causal,
        causal_alignment=options.causal_alignment,
        scale=options.scale_for(int(call.query.shape[-1])),
        dropout_p=options.dropout_p,
        grad=call.grad,
    )


def _in_graph(call: Call, auto: bool) -> tuple[Array, Array | None] | str:
    """The tiled kernel in a compiled graph: its custom operator (an eager island)."""
    why = tiled_refusal(call)
    if why is not None:
        return why
    return three(tiled_operator(call, candidate=None), call.lead), None


def _why(call: Call) -> str:
    mask = call.options.mask
    if isinstance(mask, Mask) and mask.knows_blocks:
        return "structured mask: empty blocks are skipped, no (Lq, Lk) array"
    return "runs in O(L) memory, evaluating masks block by block"


TILED = Backend(
    "tiled",
    "qkv's tiled O(L)-memory kernel",
    tiled_refusal,
    run_tiled_call,
    why=_why,
    in_graph=_in_graph,
)
