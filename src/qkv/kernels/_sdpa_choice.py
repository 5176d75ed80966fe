"""Which of torch's fused SDPA kernels runs a call on CUDA, and why, by torch's own checks.

On a CUDA device ``torch.nn.functional.scaled_dot_product_attention`` tries its kernels in a
priority order (flash, memory-efficient, math, cuDNN by default; ``sdpa_kernel(...,
set_priority=True)`` changes it) and runs the first that is enabled
(``torch.backends.cuda.flash_sdp_enabled()`` and the others, which ``sdpa_kernel`` sets) and
whose checks accept the inputs (``torch.backends.cuda.can_use_flash_attention(params)`` and
the others, on an ``SDPAParams`` of the call). :func:`sdpa_kernel_choice` asks the same
questions in the same order, with ``debug=True`` so that torch says, as a warning, why a
kernel does not fit; nothing is computed. The math kernel has no check: it runs anything.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qkv.kernels._torch_sdpa import as_causal_flag, causal_kind
from qkv.masks import Mask

__all__ = [
    "KERNELS",
    "SdpaChoice",
    "sdpa_kernel_choice",
    "sdpa_params",
    "torch_mask_stand_in",
]

KERNELS: dict[str, tuple[str, str, str | None]] = {
    # torch's SDPBackend name: (qkv's word, the enabled flag, the check; None: no check)
    "FLASH_ATTENTION": ("flash", "flash_sdp_enabled", "can_use_flash_attention"),
    "EFFICIENT_ATTENTION": (
        "memory-efficient",
        "mem_efficient_sdp_enabled",
        "can_use_efficient_attention",
    ),
    "MATH": ("math", "math_sdp_enabled", None),
    "CUDNN_ATTENTION": ("cuDNN", "cudnn_sdp_enabled", "can_use_cudnn_attention"),
}
"""The kernels qkv names, in torch's default priority order."""

_DEFAULT_ORDER = tuple(KERNELS)
_REASON_CHARS = 160


@dataclass(frozen=True)
class SdpaChoice:
    """The SDPA kernel torch would run and why each one before it does not.

    Attributes:
        kernel: ``"flash"``, ``"memory-efficient"``, ``"cuDNN"``, ``"math"``, or ``"none"``
            (torch would raise: no enabled kernel fits).
        reasons: (kernel, why it runs or why not), in torch's priority order; kernels after
            the chosen one are "not reached".
    """

    kernel: str
    reasons: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        """One line: the kernel and why, then why not each kernel tried before it."""
        why = dict(self.reasons)
        head = f"torch's SDPA kernel: {self.kernel}"
        if self.kernel in why:
            head += f" ({why[self.kernel]})"
        before = [
            f"{name}: {text}"
            for name, text in self.reasons
            if name != self.kernel and text != "not reached"
        ]
        return head + ("; " + "; ".join(before) if before else "")


def sdpa_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> Any:
    """torch's ``SDPAParams`` of a call (what its kernel checks look at)."""
    return torch.backends.cuda.SDPAParams(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa)
    )


def _priority() -> tuple[str, ...]:
    """torch's current priority order of the kernels, by SDPBackend name (the default when
    this torch does not say)."""
    from torch.nn.attention import SDPBackend

    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    if getter is None:
        return _DEFAULT_ORDER
    by_value = {int(member.value): name for name, member in SDPBackend.__members__.items()}
    try:
        order = tuple(by_value.get(int(v), "") for v in getter())
    except (TypeError, ValueError, RuntimeError):
        return _DEFAULT_ORDER
    known = tuple(name for name in order if name in KERNELS)
    return known + tuple(name for name in _DEFAULT_ORDER if name not in known)


def _ask(check: Any, params: Any) -> tuple[bool, str]:
    """Run one of torch's ``can_use_*`` checks with debug on; (fits, torch's reason)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fits = bool(check(params, True))
    said = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    text = "; ".join(dict.fromkeys(said))  # each message once, in order
    if len(text) > _REASON_CHARS:
        text = text[: _REASON_CHARS - 1] + "…"
    return fits, text


def sdpa_kernel_choice(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> SdpaChoice:
    """The kernel torch's SDPA runs for these arguments on CUDA, as torch decides it.

    Args:
        query: (B, H, Lq, D). key: (B, Hkv, Lk, D). value: (B, Hkv, Lk, Dv).
        attn_mask: what torch receives as ``attn_mask`` (boolean or additive), or None; a
            zero-stride stand-in of the right shape and dtype does (nothing reads it).
        dropout_p, is_causal, enable_gqa: as torch's function takes them.

    Returns:
        An :class:`SdpaChoice`; ``str()`` of it is a one-line report.
    """
    params = sdpa_params(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
    )
    cuda = torch.backends.cuda
    reasons: list[tuple[str, str]] = []
    chosen = "none"
    for name in _priority():
        word, enabled_flag, check_name = KERNELS[name]
        if chosen != "none":
            reasons.append((word, "not reached"))
            continue
        if not getattr(cuda, enabled_flag)():
            reasons.append((word, f"disabled (torch.backends.cuda.{enabled_flag}() is False)"))
            continue
        if check_name is None:
            chosen = word
            reasons.append((word, "the first enabled kernel whose checks pass; runs anything"))
            continue
        fits, said = _ask(getattr(cuda, check_name), params)
        if fits:
            chosen = word
            reasons.append((word, "the first enabled kernel in torch's order whose checks pass"))
        else:
            said = said or "its checks fail for these inputs"
            reasons.append((word, f"refused by torch: {said}"))
    return SdpaChoice(chosen, tuple(reasons))


def torch_mask_stand_in(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    alignment: str,
) -> tuple[torch.Tensor | None, bool]:
    """The ``attn_mask`` and ``is_causal`` qkv's sdpa adapter gives torch, without building
    the mask: a zero-stride tensor of its shape and dtype (boolean, or the query's dtype
    with a bias), or None. Mirrors :func:`qkv.kernels._torch_sdpa._torch_mask`."""
    q_len = int(query.shape[2])
    kv_len = int(key.shape[2])
    mask, is_causal, alignment = as_causal_flag(mask, is_causal, alignment)
    dense = None if isinstance(mask, Mask) else mask
    kind = causal_kind(is_causal, alignment, q_len, kv_len)
    use_is_causal = kind == "top-left" and mask is None and bias is None
    needs_rule = (
        isinstance(mask, Mask) or kind == "rule" or (kind == "top-left" and not use_is_causal)
    )
    shapes: list[tuple[int, ...]] = []
    if needs_rule:  # the rule's own broadcast; most rules depend on positions only
        shapes.append((1, 1, q_len, kv_len))
    if dense is not None:
        shapes.append(tuple(int(n) for n in dense.shape))
    if bias is not None:
        shapes.append(tuple(int(n) for n in bias.shape))
    if not shapes:
        return None, use_is_causal
    shape = tuple(int(n) for n in np.broadcast_shapes(*shapes))
    dtype = torch.bool if bias is None else query.dtype
    return torch.zeros((), dtype=dtype, device=query.device).expand(shape), False
