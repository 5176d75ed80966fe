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
from types import MappingProxyType
from typing import Any

from qkv._array import Array, as_array, compiling
from qkv.attention import _checks
from qkv.masks import Alignment, Mask, ScoreMod, draw_seed, with_causal
from qkv.masks._scores import as_score_mod
from qkv.steps import WORDS
from qkv.trace import Trace, resolve

__all__ = ["Call", "Options", "Positions", "Recorder", "default_lead", "make_call"]


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
    def masked(self) -> bool:
        """Whether some key may be masked out (a mask or causality)."""
        return self.mask is not None or self.is_causal

    def scale_for(self, d_k: int) -> float:
        """The number the scores are multiplied by: ``scale``, or 1/√d_k."""
        return 1.0 / math.sqrt(d_k) if self.scale is None else float(self.scale)


@dataclass(frozen=True)
class Positions:
    """Where the rows of a call sit in a larger one (a trace of selected rows).

    Attributes:
        heads: the original index of each query head (None: no head axis).
        queries: the original index of each query row.
        q_len: the original Lq (the causal alignment depends on it).
    """

    heads: list[int] | None
    queries: list[int]
    q_len: int


_NO_FORMULAS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class Recorder:
    """Where one call's steps go, and how they are named; records nothing without a trace.

    Attributes:
        trace: the :class:`qkv.Trace` to record into, or None.
        formulas: formulas that replace the Q, K, V steps' own ("Q = X·W_q" when the caller
            projected them).
        squeeze_heads: drop a single head axis from what is recorded.
        positions: the rows this call holds of a larger one (a partial trace), or None.
        backend: the backend that computes what is recorded (the call record's
            ``backend``).
    """

    trace: Trace | None = None
    formulas: Mapping[str, str] = field(default_factory=lambda: _NO_FORMULAS)
    squeeze_heads: bool = False
    positions: Positions | None = None
    backend: str = "reference"

    def begin(self, query: Array, key: Array, value: Array) -> None:
        """Open the trace's record of this call (its backend and the shapes of its inputs)."""
        if self.trace is not None:
            self.trace.begin_call(backend=self.backend, shapes=shapes_of(query, key, value))

    def step(
        self,
        name: str,
        value: Array,
        lead: tuple[str, ...],
        axes: tuple[str, ...],
        *,
        formula: str | None = None,
        kv: bool = False,
    ) -> None:
        """Record step ``name`` with axes (…lead, …axes); ``kv`` names the head axis
        ``kv_head`` (keys and values under GQA)."""
        if self.trace is None:
            return
        lead = tuple("kv_head" if kv and a == "head" else a for a in lead)
        if self.squeeze_heads and lead and lead[-1] in ("head", "kv_head"):
            value = value[..., 0, :, :]
            lead = lead[:-1]
        words = WORDS[name]
        self.trace.record(
            name,
            value,
            formula=self.formulas.get(name) or formula or words.formula,
            description=words.description,
            axes=(*lead, *axes),
        )

    def sink(self, share: Array, lead: tuple[str, ...], sinks: Array) -> None:
        """Record the share of attention each row gives to the sink, (…lead, Lq), and the
        sink logits, into the call's meta as ``sink`` (see :meth:`qkv.Trace.note_sink`)."""
        if self.trace is None:
            return
        axes = (*lead, "query")
        if self.squeeze_heads and lead and lead[-1] == "head":
            share = share[..., 0, :]
            axes = (*lead[:-1], "query")
        self.trace.note_sink(share, axes, sink_logits(sinks))

    def facts(
        self,
        query: Array,
        key: Array,
        value: Array,
        lead: tuple[str, ...],
        options: Options,
    ) -> None:
        """Close the trace's record of this call with its facts (heads, d_k, scale,
        causality, mask), which also go into the trace's meta."""
        if self.trace is None:
            return
        if options.sinks is None:
            self.trace.meta.pop("sink", None)  # a sink of an earlier call
        self.trace.end_call(**call_facts(query, key, value, lead, options))


def shapes_of(query: Array, key: Array, value: Array) -> dict[str, list[int]]:
    """The shapes of a call's inputs, for its trace record."""
    named = {"query": query, "key": key, "value": value}
    return {name: [int(n) for n in x.shape] for name, x in named.items()}


def call_facts(
    query: Array, key: Array, value: Array, lead: tuple[str, ...], options: Options
) -> dict[str, Any]:
    """What a trace records about a call: heads, d_k, d_v, scale, causality, mask."""
    scale = options.scale
    d_k = int(query.shape[-1])
    mask = options.mask
    facts: dict[str, Any] = {
        "num_heads": int(query.shape[-3]) if "head" in lead else 1,
        "num_kv_heads": int(key.shape[-3]) if "head" in lead else 1,
        "d_k": d_k,
        "d_v": int(value.shape[-1]),
        "scale": options.scale_for(d_k),
        "scale_mode": "sqrt_dk" if scale is None else ("none" if scale == 1.0 else "custom"),
        "causal": bool(options.is_causal),
        "causal_alignment": options.causal_alignment,
        "mask": None if mask is None else _describe_mask(mask),
    }
    if options.score_mod is not None:
        facts["score_mod"] = repr(options.score_mod)
    return facts


def sink_logits(sinks: Array) -> list[float]:
    """The sink logits as plain floats (for a trace's meta)."""
    values = sinks.detach() if hasattr(sinks, "detach") else sinks
    if hasattr(values, "cpu"):
        values = values.cpu()
    return [float(x) for x in values.tolist()]


def _describe_mask(mask: Array | Mask) -> str:
    return repr(mask) if isinstance(mask, Mask) else f"boolean array {tuple(mask.shape)}"


@dataclass(frozen=True)
class Call:
    """One attention call, checked: what every backend receives.

    Attributes:
        library: the inputs' library, ``"numpy"`` or ``"torch"`` (looked up once).
        xp: the array namespace of the inputs.
        query: (…lead, Lq, D). key: (…lead, Lk, D) with Hkv heads. value: (…lead, Lk, Dv).
        lead: the names of the axes before (L, D), e.g. ``("batch", "head")``.
        options: the call's :class:`Options`.
        return_weights: the weights are asked for.
        recorder: where the steps go (:class:`Recorder`).
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

    @property
    def trace(self) -> Trace | None:
        return self.recorder.trace

    @property
    def torch(self) -> bool:
        return self.library == "torch"

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

    ``lead``, ``formulas`` and ``squeeze_heads`` come from callers that made query, key and
    value themselves (:func:`qkv.multi_head_attention`): the names of the axes before
    (L, D) (default: PyTorch's layout, :func:`default_lead`) and the recorder's settings.
    """
    kind, xp, query, key, value = _checks.qkv_arrays(query, key, value, enable_gqa=enable_gqa)
    _checks.check_options(scale, dropout_p, causal_alignment)
    scores_shape = (*query.shape[:-2], query.shape[-2], key.shape[-2])
    _checks.check_mask(mask, query, kind, scores_shape)
    bias = None if bias is None else as_array(bias, "bias")
    _checks.check_bias(bias, query, kind, scores_shape)
    if lead is None:
        lead = default_lead(query.ndim, enable_gqa=enable_gqa)
    if isinstance(mask, Mask):  # one length per batch element, on every backend
        mask.check_batch(int(query.shape[lead.index("batch")]) if "batch" in lead else 1)
    heads = int(query.shape[-3]) if "head" in lead else 1
    compiled = kind == "torch" and compiling()
    if sinks is not None:
        sinks = _checks.check_sinks(sinks, query, kind, heads)
        if not compiled:  # compiled: the tiled kernel's operator checks them when it runs
            _checks.check_sink_values(xp, sinks)
    seed: int | Array | None = None
    if dropout_p > 0 and compiled:
        seed = graph_seed(generator)
    elif dropout_p > 0:
        seed = draw_seed(generator, torch_inputs=kind == "torch")
    options = Options(
        mask=mask,
        bias=bias,
        score_mod=as_score_mod(score_mod),
        is_causal=bool(is_causal),
        causal_alignment="bottom-right" if causal_alignment == "bottom-right" else "top-left",
        scale=scale,
        enable_gqa=bool(enable_gqa),
        dropout_p=float(dropout_p),
        seed=seed,
        sinks=sinks,
    )
    recorder = Recorder(resolve(trace), formulas or _NO_FORMULAS, squeeze_heads)
    return Call(kind, xp, query, key, value, lead, options, bool(return_weights), recorder)


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
