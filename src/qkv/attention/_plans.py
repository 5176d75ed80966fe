"""Plans of plain PyTorch calls: what :func:`qkv.scaled_dot_product_attention` checked and
chose for a call signature, kept so that the next call of that signature goes straight to
torch's fused kernel.

A plain call has PyTorch tensors (no subclass) and only options that are no array, function
or random draw: no mask, bias, score modifier, sinks, dropout, weights, trace or tracing
block, outside ``torch.compile``. Every check of such a call (``make_call``) and auto's
choice (``choose``) depend on its signature alone:
the shapes, dtypes, devices and gradient flags of query, key and value, the options and the
requested backend. So the first call of a signature is checked and dispatched in full, and
when sdpa ran it, its checked options are kept here; a later call with the same signature
is the same call on other numbers. Only the look at torch's output (a NaN or ±inf reaching
it) runs again, as it reads values.

Why: after a large fused kernel the processor's caches hold its data, and the Python of a
full check and dispatch then costs several hundred microseconds, 3-5 % of a forward at
N = 1024 on a 2-core CPU (docs/benchmarks.md, "auto's cost").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

from qkv.attention._options import Call, Options

__all__ = ["PLANS", "Plan", "PlanKey", "plain_signature"]

PLAN_LIMIT = 256
"""Signatures kept at most (a model has a few: one per layer shape); beyond, the oldest go."""


class PlanKey(NamedTuple):
    """The signature of a plain call: everything its checks and auto's choice read. Each
    field is one fact of the call; two calls that differ in any of them get two plans
    (``tests/core/test_plan_key.py`` changes each field in turn)."""

    query_shape: Any
    key_shape: Any
    value_shape: Any
    query_dtype: Any
    key_dtype: Any
    value_dtype: Any
    query_device: Any
    key_device: Any
    value_device: Any
    query_grad: bool
    key_grad: bool
    value_grad: bool
    grad_mode: bool
    is_causal: bool
    causal_alignment: str
    scale: float | None
    enable_gqa: bool
    backend: str


@dataclass(frozen=True)
class Plan:
    """What the checks made of a plain call's signature: all but its three tensors.

    ``flash``: the ``is_causal`` flag of torch's CPU flash kernel where it runs these calls
    and its log-sum-exp can vouch for the output
    (:func:`qkv.kernels._torch_sdpa.flash_causal_flag`), else None.
    """

    library: str
    xp: Any
    lead: tuple[str, ...]
    options: Options
    flash: bool | None = None

    def call(self, query: Any, key: Any, value: Any) -> Call:
        """The checked call of this signature on these tensors."""
        return Call(self.library, self.xp, query, key, value, self.lead, self.options)

    def clean_flash(self, query: Any, key: Any, value: Any) -> Any:
        """The output of torch's CPU flash kernel on these tensors when its log-sum-exp
        vouches for it (:func:`qkv.kernels._torch_sdpa.flash_forward`: no NaN or ±inf of
        the inputs reached it), else None: then the usual path runs the call, checks
        included (a NaN or ±inf in the inputs, rare, costs a second kernel call)."""
        if self.flash is None:
            return None
        from qkv.kernels._torch_sdpa import flash_forward

        found = flash_forward(query, key, value, is_causal=self.flash, scale=self.options.scale)
        return found[0] if found is not None and found[1] else None


class Plans(dict[PlanKey, Plan]):
    """Plans by signature, at most :data:`PLAN_LIMIT` (the oldest dropped first)."""

    def keep(self, signature: PlanKey, call: Call) -> None:
        if len(self) >= PLAN_LIMIT:
            del self[next(iter(self))]
        self[signature] = Plan(call.library, call.xp, call.lead, call.options, _flash(call))


def _flash(call: Call) -> bool | None:
    """:attr:`Plan.flash` of a plain call that sdpa runs: (B, H, L, D) torch tensors."""
    if call.library != "torch" or call.lead != ("batch", "head"):
        return None
    from qkv.kernels._torch_sdpa import flash_causal_flag

    options = call.options
    return flash_causal_flag(
        call.query,
        call.key,
        call.value,
        is_causal=options.is_causal,
        alignment=options.causal_alignment,
    )


PLANS = Plans()


def plain_signature(
    query: Any, key: Any, value: Any, arguments: dict[str, Any], open_blocks: bool
) -> PlanKey | None:
    """The signature of a plain call (module docstring), or None for any other call.

    ``arguments``: the keyword arguments of :func:`qkv.scaled_dot_product_attention`;
    ``open_blocks``: whether a tracing block is open (then the call is traced).
    """
    torch = sys.modules.get("torch")
    if torch is None or open_blocks:
        return None
    tensor = torch.Tensor
    if type(query) is not tensor or type(key) is not tensor or type(value) is not tensor:
        return None
    a = arguments
    if (
        a["mask"] is not None
        or a["bias"] is not None
        or a["score_mod"] is not None
        or a["sinks"] is not None
        or a["generator"] is not None
        or a["trace"] is not None
        or a["return_weights"] is not False
        or a["dropout_p"] != 0.0
        or type(a["is_causal"]) is not bool
        or type(a["enable_gqa"]) is not bool
        or not (a["scale"] is None or type(a["scale"]) is float)
        or type(a["causal_alignment"]) is not str
        or type(a["backend"]) is not str
        or torch.compiler.is_compiling()
    ):
        return None
    return PlanKey(
        query.shape,
        key.shape,
        value.shape,
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        query.requires_grad,
        key.requires_grad,
        value.requires_grad,
        torch.is_grad_enabled(),
        a["is_causal"],
        a["causal_alignment"],
        a["scale"],
        a["enable_gqa"],
        a["backend"],
    )
