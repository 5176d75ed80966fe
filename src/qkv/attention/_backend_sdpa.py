"""The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention`` with qkv's meaning
(:mod:`qkv.kernels._torch_sdpa`): a mask rule as torch's ``is_causal`` where it is one, else
as a dense mask; a NaN or ±inf of a masked-out key that reaches the output sends the call to
the tiled kernel. On CPU, a plain call (no mask array) runs torch's flash kernel with its
log-sum-exp, which vouches for the output (the plan works that out once: ``prepare``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from qkv._array import Array
from qkv.attention._backend import (
    Backend,
    Notes,
    common_refusal,
    four,
    four_mask,
    half_name,
    shape4,
    three,
)
from qkv.attention._backend_tiled import run_tiled_call, tiled_operator
from qkv.attention._options import DENSE_MASK_LIMIT, Call
from qkv.masks import Mask

__all__ = [
    "RULE_BLOCK",
    "RULE_MASK_LIMIT",
    "RULE_SKIPPED_SHARE",
    "SDPA",
    "sdpa_checked",
    "sdpa_output",
    "sdpa_static_refusal",
]

RULE_MASK_LIMIT = 1 << 19
"""On CPU, auto avoids SDPA for a mask rule (:mod:`qkv.masks`) over more (query, key) pairs
per head than this (512 Ki: about 724 × 724) that rules out at least a quarter of its
blocks: torch would need the rule as a dense array and compute every pair, where the tiled
kernel (or the compiled path) skips those blocks. Measured on 2 cores: at N = 1024 a
sliding window or documents run 0.6–0.84× SDPA's time on the tiled kernel, forward and
forward + backward; at N = 512 SDPA is faster."""

RULE_BLOCK, RULE_SKIPPED_SHARE = 128, 0.25
"""The blocks and the share of them a mask rule must rule out for auto to avoid SDPA."""


def _refusal(call: Call, auto: bool) -> str | None:
    why = sdpa_static_refusal(call, auto)
    bias = call.options.bias
    if why is None and bias is not None and call.grad and _huge(bias):
        return (
            "a bias beyond ±65536 (such as finfo.min for blocked keys) and a gradient: "
            "torch's backward is wrong on rows whose keys are all blocked"
        )
    return why


def sdpa_static_refusal(call: Call, auto: bool) -> str | None:
    """Why sdpa refuses ``call``, from its shapes, dtypes and options alone (no value is
    read): what ``torch.compile`` decides on. The one refusal that reads values, a huge
    bias with a gradient, is :func:`qkv.kernels._torch_sdpa.sdpa_trusted`'s to catch there."""
    common = common_refusal(call, "torch's fused kernel")
    if common is not None:
        return common
    options = call.options
    if options.dropout_p > 0:
        return "dropout: torch draws its own random numbers, not qkv's generator pattern"
    if options.score_mod is not None:
        return "a score_mod: torch takes only a mask and an additive bias"
    if options.sinks is not None:
        return "attention sinks: torch's fused kernel has no sink logit (the tiled kernel has)"
    bias = options.bias
    if bias is not None and getattr(bias, "requires_grad", False):
        return "a bias that needs a gradient"
    if not auto:
        return None
    from qkv.kernels import dense_mask_elements

    q4, k4 = shape4(call.query.shape, call.lead), shape4(call.key.shape, call.lead)
    elements = dense_mask_elements(
        q4,
        k4,
        mask=four_mask(options.mask, call.lead),
        bias=four_mask(bias, call.lead),
        is_causal=options.is_causal,
        causal_alignment=options.causal_alignment,
    )
    if elements > DENSE_MASK_LIMIT:
        kind = "mask and bias" if bias is not None else "mask"
        return f"would need a dense {kind} array of {elements:,} elements"
    rule = options.mask
    if isinstance(rule, Mask) and not call.cuda and not _torch_causal(call, q4, k4):
        skipped = _skipped_share(rule, q4, k4)
        if skipped >= RULE_SKIPPED_SHARE:
            return (
                f"a mask rule that rules out {skipped:.0%} of its {RULE_BLOCK}-blocks: torch "
                "would compute every pair of its dense array, the tiled kernel skips them"
            )
    return None


def _torch_causal(call: Call, q4: tuple[int, ...], k4: tuple[int, ...]) -> bool:
    """Whether torch runs the call's mask rule as its own ``is_causal`` (the rule is exactly
    a causal rule that torch's top-left alignment expresses), with no mask array."""
    from qkv.kernels._torch_sdpa import as_causal_flag, causal_kind

    options = call.options
    mask, is_causal, alignment = as_causal_flag(
        options.mask, options.is_causal, options.causal_alignment
    )
    q_len, kv_len = q4[-2], k4[-2]
    return mask is None and causal_kind(is_causal, alignment, q_len, kv_len) != "rule"


def _skipped_share(rule: Mask, q4: tuple[int, ...], k4: tuple[int, ...]) -> float:
    """The share of (query, key) blocks of :data:`RULE_BLOCK` that ``rule`` rules out
    wholly, for a call of more than :data:`RULE_MASK_LIMIT` pairs per head (0 below)."""
    from qkv.masks import EMPTY

    q_len, kv_len = q4[-2], k4[-2]
    if q_len * kv_len <= RULE_MASK_LIMIT:
        return 0.0
    kinds = rule.blocks(q_len, kv_len, RULE_BLOCK, RULE_BLOCK, batch=q4[0])
    return float((kinds == EMPTY).mean())


def _huge(bias: Array) -> bool:
    """A bias beyond ±65536 (reads the bias: one reduction)."""
    from qkv.kernels import huge_bias

    return bool(huge_bias(bias))


def sdpa_output(call: Call, *, nan_rows: bool = False) -> tuple[Array, bool]:
    """torch's fused kernel on the call, (B, H, Lq, Dv), and whether its output is known to
    be the call's result (:func:`qkv.kernels._torch_sdpa.sdpa_forward`; ``nan_rows``: the
    rows whose scores were all NaN made zeros, as qkv's).

    Example:
        >>> import torch
        >>> from qkv.attention._options import make_call
        >>> q = torch.ones(1, 1, 4, 8)
        >>> out, clean = sdpa_output(make_call(q, q, q), nan_rows=True)
        >>> tuple(out.shape), clean
        ((1, 1, 4, 8), True)
    """
    from qkv.kernels._torch_sdpa import sdpa_forward

    options, lead = call.options, call.lead
    found: tuple[Array, bool] = sdpa_forward(
        four(call.query, lead),
        four(call.key, lead),
        four(call.value, lead),
        mask=four_mask(options.mask, lead),
        bias=four_mask(options.bias, lead),
        is_causal=options.is_causal,
        causal_alignment=options.causal_alignment,
        scale=options.scale,
        nan_rows=nan_rows,
    )
    return found


def sdpa_checked(call: Call) -> bool:
    """Whether sdpa's output needs a look for a NaN or ±inf (a mask or a bias: torch lets
    one of a masked-out key reach the output)."""
    return call.options.masked or call.options.bias is not None


def _run(call: Call) -> tuple[Array, Array | None]:
    from qkv.kernels._torch_sdpa import flash_forward, sdpa_trusted

    flash = call.prepared
    if flash is not None:  # a plain call on CPU: torch's flash kernel, its lse vouching
        found = flash_forward(
            call.query, call.key, call.value, is_causal=flash, scale=call.options.scale
        )  # (B, H, L, D): see _prepare
        if found is not None and found[1]:
            return found[0], None
    checked = sdpa_checked(call)  # else nan_rows: a row of NaN scores made zeros
    out, clean = sdpa_output(call, nan_rows=not checked)
    # torch lets a NaN or ±inf of a masked-out key reach every output (and its gradient), and
    # gives zeros to a row whose scores are all NaN; the tiled kernel keeps masked NaN out and
    # lets live NaN through. (A huge bias with a gradient was refused before: grad=False.)
    if (
        not clean
        and checked
        and not sdpa_trusted(out, call.query, call.key, call.options.bias, grad=False)
    ):
        return run_tiled_call(call)
    return three(out, call.lead), None


def _in_graph(call: Call, auto: bool) -> tuple[Array, Array | None] | str:
    """sdpa in a compiled graph: torch's kernel; with a mask or a bias its output is the
    *candidate* of the tiled kernel's operator, kept when the eager sdpa backend would keep
    it, else redone (with a gradient, SDPA sees NaN and ±inf replaced by 0, so that its
    backward stays finite on a redone call)."""
    why = sdpa_static_refusal(call, auto)
    if why is not None:
        return why
    if not sdpa_checked(call):
        return three(sdpa_output(call)[0], call.lead), None
    from qkv.kernels._tiled_ops import finite

    source = call
    if call.grad:  # torch's backward must not see a NaN of a redone call
        source = replace(
            call, query=finite(call.query), key=finite(call.key), value=finite(call.value)
        )
    candidate = sdpa_output(source)[0]  # (B, H, Lq, Dv)
    return three(tiled_operator(call, candidate=candidate), call.lead), None


def _sdpa_choice(call: Call) -> Any:
    """The kernel torch's SDPA runs for the call on CUDA (:mod:`qkv.kernels._sdpa_choice`),
    given what qkv's sdpa adapter would pass torch."""
    from qkv.kernels._sdpa_choice import sdpa_kernel_choice, torch_mask_stand_in

    options, lead = call.options, call.lead
    q4, k4, v4 = (four(x, lead) for x in (call.query, call.key, call.value))
    attn_mask, is_causal = torch_mask_stand_in(
        q4,
        k4,
        mask=four_mask(options.mask, lead),
        bias=four_mask(options.bias, lead),
        is_causal=options.is_causal,
        alignment=options.causal_alignment,
    )
    return sdpa_kernel_choice(
        q4,
        k4,
        v4,
        attn_mask=attn_mask,
        is_causal=is_causal,
        enable_gqa=int(q4.shape[1]) != int(k4.shape[1]),
    )


_CHOICE_ERRORS = (RuntimeError, TypeError, AttributeError)  # an older torch's API


def _notes(call: Call) -> Notes:
    notes, kernel = [], None
    if call.cuda:
        try:
            choice = _sdpa_choice(call)
        except _CHOICE_ERRORS as error:
            notes.append(f"torch's SDPA kernel: not known ({type(error).__name__}: {error})")
        else:
            kernel = choice.kernel
            notes.append(str(choice))
    half = half_name(call)
    if half is not None:
        notes.append(
            f"{half}: given to torch's fused kernel as {half} (it accumulates in float32 but "
            f"rounds the weights to {half})"
        )
    return Notes(tuple(notes), kernel)


def _prepare(call: Call) -> bool | str | None:
    """What a plan of sdpa works out once: for a call with no mask and no bias on CPU, in
    (B, H, L, D), the ``is_causal`` flag torch's flash kernel runs it with where its
    log-sum-exp can vouch for the output, or ``"bottom-right"`` where it runs in two parts
    (:func:`qkv.kernels._torch_sdpa.flash_causal_flag`); else None."""
    options = call.options
    plain = options.mask is None and options.bias is None
    if call.grad or call.lead != ("batch", "head") or not plain:
        return None
    from qkv.kernels._torch_sdpa import flash_causal_flag

    return flash_causal_flag(
        call.query,
        call.key,
        call.value,
        is_causal=options.is_causal,
        alignment=options.causal_alignment,
    )


SDPA = Backend(
    "sdpa",
    "torch's fused scaled_dot_product_attention",
    _refusal,
    _run,
    why=lambda call: "fused kernel; runs this call without a large dense mask",
    checks_output=sdpa_checked,
    half_in=None,
    plans=True,
    prepare=_prepare,
    notes=_notes,
    in_graph=_in_graph,
)
