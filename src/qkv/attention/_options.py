"""One attention call, checked once: its options, its trace settings, and the inputs.

Shape legend: B batch, H query heads, Hkv key/value heads, Lq / Lk query / key length,
D head dim, Dv value dim; ``lead`` names the axes before (L, D).

:func:`make_call` checks every argument of :func:`qkv.scaled_dot_product_attention` once and
returns a :class:`Call`: the arrays, an :class:`Options` (what the mathematics needs: the
mask, bias, score modifier, causality, scale, dropout with its seed already drawn) and a
:class:`Recorder` (where the steps go: the trace, the formulas of the Q, K, V steps, whether
a single head axis is dropped, and which rows a partial trace holds). Every backend takes
the same Call; nothing below re-checks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from qkv._array import Array, as_array, compiling, inputs, with_layout
from qkv.attention import _checks
from qkv.attention._recorder import NO_FORMULAS, Recorder
from qkv.masks import Alignment, Mask, ScoreMod, draw_seed, with_causal
from qkv.masks._scores import as_score_mod
from qkv.trace import Trace, resolve

__all__ = [
    "DENSE_MASK_LIMIT",
    "Call",
    "Jagged",
    "Options",
    "Recorder",
    "default_lead",
    "handed_back",
    "make_call",
]


@dataclass(frozen=True)
class Options:
    """The options of one attention call, checked: what the mathematics receives.

    Attributes:
        mask: a boolean array broadcastable to (..., H, Lq, Lk) (True = may attend), a
            :class:`qkv.masks.Mask` rule, or None.
        bias: added to the scaled scores, broadcastable to (..., H, Lq, Lk), or None.
        score_mod: applied after the bias and before the mask, or None.
        is_causal: combined with ``mask`` (see :attr:`rule`).
        causal_alignment: ``"top-left"`` or ``"bottom-right"``.
        scale: multiplies the scores; None means 1/√D (see :meth:`scale_for`).
        enable_gqa: H may be a multiple of Hkv.
        dropout_p: the probability of dropping a weight.
        seed: the dropout seed, drawn once per call (None without dropout); under
            ``torch.compile`` a one-element int64 tensor drawn inside the graph, which the
            kernel reads when it runs.
        sinks: per-head sink logits, shape (H,) (one per query head), or None: each row's
            softmax gets one more term exp(sink_h) in its denominator, for a key whose value
            is 0, so the weights of a row sum to less than 1 (a −inf sink is no sink).
    """

    mask: Array | Mask | None = None
    bias: Array | None = None
    score_mod: ScoreMod | None = None
    is_causal: bool = False
    causal_alignment: Alignment = "top-left"
    scale: float | None = None
    enable_gqa: bool = False
    dropout_p: float = 0.0
    seed: int | Array | None = None
    sinks: Array | None = None

    @cached_property
    def rule(self) -> Mask | None:
        """The Mask rule to evaluate: the caller's rule and the causal rule, combined
        (:func:`qkv.masks.with_causal`); None when neither is given."""
        given = self.mask if isinstance(self.mask, Mask) else None
        return with_causal(given, self.is_causal, self.causal_alignment)

    @property
    def dense_mask(self) -> Array | None:
        """The caller's boolean mask array, or None (a rule is in :attr:`rule`)."""
        return None if self.mask is None or isinstance(self.mask, Mask) else self.mask

    @property
    def structured(self) -> bool:
        """A qkv Mask rule or a score modifier: what the block-skipping kernels are for."""
        return isinstance(self.mask, Mask) or self.score_mod is not None

    @property
    def masked(self) -> bool:
        """Whether some key may be masked out (a mask or causality)."""
        return self.mask is not None or self.is_causal

    def scale_for(self, d_k: int) -> float:
        """The number the scores are multiplied by: ``scale``, or 1/√d_k."""
        return 1.0 / math.sqrt(d_k) if self.scale is None else float(self.scale)


DENSE_MASK_LIMIT = 1 << 22
"""Auto avoids SDPA when it would need a mask array of more elements than this (4 Mi: a
2048 × 2048 matrix); the tiled kernel evaluates such masks block by block instead. ALiBi
becomes an (H, Lq, Lk) bias up to this size (:func:`make_call`)."""


@dataclass(frozen=True)
class Jagged:
    """The result of nested jagged inputs is nested jagged too, with the query's offsets
    (B + 1,) along the sequence."""

    offsets: Any


@dataclass(frozen=True)
class Call:
    """One attention call, checked: what the plan and every backend receive.

    Everything a backend or the plan asks of the inputs is looked up here once: the
    library and namespace, the device, the layout of the result, whether a gradient is
    wanted.

    Attributes:
        library: the inputs' library, ``"numpy"`` or ``"torch"`` (looked up once).
        xp: the array namespace of the inputs.
        query: (…lead, Lq, D). key: (…lead, Lk, D) with Hkv heads. value: (…lead, Lk, Dv).
        lead: the names of the axes before (L, D), e.g. ``("batch", "head")``.
        options: the call's :class:`Options`.
        return_weights: the weights are asked for.
        recorder: where the steps go (:class:`Recorder`).
        torch: the inputs are PyTorch tensors.
        cuda: they live on a CUDA device.
        grad: autograd records and query, key or value requires a gradient.
        layout: how the result is handed back: laid out as the query's strides
            (:func:`qkv._array.with_layout`), :class:`Jagged`, or None (as it comes).
        prepared: what the planned backend worked out once for calls of this signature
            (its ``prepare``), or None.
    """

    library: str
    xp: Any
    query: Array
    key: Array
    value: Array
    lead: tuple[str, ...]
    options: Options
    return_weights: bool = False
    recorder: Recorder = field(default_factory=Recorder)
    torch: bool = False
    cuda: bool = False
    grad: bool = False
    layout: tuple[int, ...] | Jagged | None = None
    prepared: Any = None

    @property
    def trace(self) -> Trace | None:
        return self.recorder.trace

    def scores_elements(self) -> int:
        """Elements of one (..., H, Lq, Lk) matrix."""
        return math.prod(int(n) for n in self.query.shape[:-1]) * int(self.key.shape[-2])


def default_lead(ndim: int, *, enable_gqa: bool) -> tuple[str, ...]:
    """Names of the axes before (L, D): (B, H, ...) as in PyTorch; 3-D is (B, ...) or (H, ...)."""
    n = ndim - 2
    if n == 0:
        return ()
    if n == 1:
        return ("head",) if enable_gqa else ("batch",)
    return (*(f"extra{i}" for i in range(n - 2)), "batch", "head")


def make_call(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | Mask | None = None,
    bias: Array | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top-left",
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    generator: Any = None,
    sinks: Array | None = None,
    return_weights: bool = False,
    trace: Trace | None = None,
    lead: tuple[str, ...] | None = None,
    formulas: Mapping[str, str] | None = None,
    squeeze_heads: bool = False,
) -> Call:
    """Check the arguments of :func:`qkv.scaled_dot_product_attention` once and bundle them.

    Nested jagged inputs become their packed tokens (1, H, total, D) with the document rule
    of their sequences (:mod:`qkv.attention._packed`), and the call's ``layout`` says how
    to hand the result back. An additive score modifier (ALiBi) becomes an (H, Lq, Lk)
    bias where that is best (:func:`_positional_bias`).

    ``lead``, ``formulas`` and ``squeeze_heads`` come from callers that made query, key and
    value themselves (:func:`qkv.multi_head_attention`): the names of the axes before
    (L, D) (default: PyTorch's layout, :func:`default_lead`) and the recorder's settings.
    """
    layout: tuple[int, ...] | Jagged | None = None
    if getattr(query, "is_nested", False):
        query, key, value, mask, layout = _packed_tokens(
            query, key, value, mask, bias, is_causal, causal_alignment, return_weights
        )
        is_causal = False
    found = inputs(query, key, value)
    _checks.check_qkv(found, enable_gqa=enable_gqa)
    kind, xp, query, key, value = found.library, found.xp, found.query, found.key, found.value
    _checks.check_options(scale, dropout_p, causal_alignment)
    scores_shape = (*query.shape[:-2], query.shape[-2], key.shape[-2])
    _checks.check_mask(mask, kind, found.device, scores_shape)
    bias = None if bias is None else as_array(bias, "bias")
    _checks.check_bias(bias, kind, found.device, scores_shape)
    if lead is None:
        lead = default_lead(query.ndim, enable_gqa=enable_gqa)
    if isinstance(mask, Mask):  # one length per batch element, on every backend
        mask.check_batch(int(query.shape[lead.index("batch")]) if "batch" in lead else 1)
    heads = int(query.shape[-3]) if "head" in lead else 1
    torch = kind == "torch"
    compiled = torch and compiling()
    if sinks is not None:
        sinks = _checks.check_sinks(sinks, kind, found.device, heads)
        if not compiled:  # compiled: the tiled kernel's operator checks them when it runs
            _checks.check_sink_values(xp, sinks)
    seed: int | Array | None = None
    if dropout_p > 0 and compiled:
        seed = graph_seed(generator)
    elif dropout_p > 0:
        seed = draw_seed(generator, torch_inputs=torch)
    recorder = Recorder(resolve(trace), formulas or NO_FORMULAS, squeeze_heads)
    modifier = as_score_mod(score_mod)
    if modifier is not None and modifier.additive:
        table = _positional_bias(
            modifier,
            (heads, int(query.shape[-2]), int(key.shape[-2])),
            xp,
            found.device,
            query.dtype,
            formed=bool(return_weights) or recorder.trace is not None or compiled,
        )
        if table is not None:
            table = table if "head" in lead else table[0]  # (H, Lq, Lk) or (Lq, Lk)
            bias, modifier = table if bias is None else bias + table, None
    options = Options(
        mask=mask,
        bias=bias,
        score_mod=modifier,
        is_causal=bool(is_causal),
        causal_alignment="bottom-right" if causal_alignment == "bottom-right" else "top-left",
        scale=scale,
        enable_gqa=bool(enable_gqa),
        dropout_p=float(dropout_p),
        seed=seed,
        sinks=sinks,
    )
    grad = False
    if torch:
        import torch as torch_module

        grad = torch_module.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
        )
    return Call(
        kind,
        xp,
        query,
        key,
        value,
        lead,
        options,
        bool(return_weights),
        recorder,
        torch=torch,
        cuda=torch and is_cuda(found.device),
        grad=grad,
        layout=found.strides if layout is None else layout,
    )


def is_cuda(device: Any) -> bool:
    """Whether a tensor's device is a CUDA device (where auto considers ``flex`` first)."""
    return bool(device.type == "cuda")


def _positional_bias(
    modifier: ScoreMod,
    shape: tuple[int, int, int],
    xp: Any,
    where: Any,
    dtype: Any,
    *,
    formed: bool,
) -> Array | None:
    """ALiBi (an additive score modifier) as an (H, Lq, Lk) bias where that is best, else
    None (the modifier stays).

    The bias array when it holds at most :data:`DENSE_MASK_LIMIT` elements (PyTorch's
    fused kernel takes a bias, not a modifier), or when the (Lq, Lk) steps are ``formed``
    anyway (weights or a trace are asked for) or under ``torch.compile`` (a graph takes
    tensors, not modifiers); beyond, the modifier stays, and the tiled kernel computes the
    same numbers block by block.
    """
    if math.prod(shape) > DENSE_MASK_LIMIT and not formed:
        return None
    return modifier.as_bias(*shape, xp=xp, device=where, dtype=dtype)


def _packed_tokens(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    is_causal: bool,
    alignment: str,
    return_weights: bool,
) -> tuple[Any, Any, Any, Mask, Jagged]:
    """Nested jagged query, key and value (B, H, j, D) as packed tokens (1, H, total, D),
    the document rule of their sequences (causal within each if asked), and the layout of
    the result."""
    from qkv.attention._packed import jagged_parts, packed_rule

    for name, given in (("mask", mask), ("bias", bias)):
        if given is not None:
            raise ValueError(
                f"scaled_dot_product_attention: {name}= is an (Lq, Lk) array, which nested "
                "jagged inputs do not have. Hint: is_causal=True, a score_mod, or "
                "qkv.varlen_attention(..., window_size=...) on the packed tokens."
            )
    if return_weights:
        raise ValueError(
            "scaled_dot_product_attention: return_weights=True with nested jagged inputs: the "
            "weights of sequences of different lengths are no one tensor. Hint: run a "
            "sequence alone, as a dense (H, L, D) tensor, to see its weights."
        )
    q, starts_q = jagged_parts(query, "query")  # (total_q, H, D)
    k, starts_k = jagged_parts(key, "key")  # (total_k, Hkv, D)
    v, starts_v = jagged_parts(value, "value")  # (total_k, Hkv, Dv)
    if starts_k != starts_v or len(starts_q) != len(starts_k):
        raise ValueError(
            f"scaled_dot_product_attention: query, key and value must hold the same number "
            f"of sequences (key and value the same lengths), got {len(starts_q) - 1}, "
            f"{len(starts_k) - 1} and {len(starts_v) - 1}. Hint: one nested tensor per "
            "sequence batch, as torch's SDPA takes them."
        )
    rule = packed_rule(starts_q, starts_k, None, 0 if is_causal else None, alignment)
    packed = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, total, D)
    return (*packed, rule, Jagged(query.transpose(1, 2).offsets()))


def handed_back(context: Array, layout: tuple[int, ...] | Jagged | None) -> Array:
    """The result as the caller gets it: laid out in memory as the query was (as torch's
    SDPA does), or nested jagged (B, H, j, Dv) for nested inputs."""
    if isinstance(layout, Jagged):
        import torch

        tokens = context[0].transpose(0, 1)  # (total_q, H, Dv)
        return torch.nested.nested_tensor_from_jagged(tokens, layout.offsets).transpose(1, 2)
    return with_layout(context, layout)


def graph_seed(generator: Any) -> Array:
    """The dropout seed of a call that ``torch.compile`` traces: a one-element int64 tensor
    drawn inside the graph from torch's global generator (an int seed stays as given).

    Raises:
        TypeError: a generator object, which a compiled graph cannot draw from.
    """
    import torch

    if isinstance(generator, int) and not isinstance(generator, bool):
        return torch.tensor([generator & (2**62 - 1)], dtype=torch.int64)
    if generator is not None:
        raise TypeError(
            f"generator must be None or an int seed under torch.compile, got "
            f"{type(generator).__name__}. Hint: a compiled graph draws from torch's global "
            "generator (torch.manual_seed) or takes generator=<int>."
        )
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)
