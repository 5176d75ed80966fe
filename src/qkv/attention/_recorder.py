"""Where one attention call's steps go: the :class:`Recorder` every backend that forms the
steps writes through, and the facts of a call that a trace keeps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from qkv._array import Array
from qkv.masks import Mask
from qkv.steps import WORDS
from qkv.trace import Trace

__all__ = ["NO_FORMULAS", "Positions", "Recorder", "call_facts", "shapes_of", "sink_logits"]


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


NO_FORMULAS: Mapping[str, str] = MappingProxyType({})


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
    formulas: Mapping[str, str] = field(default_factory=lambda: NO_FORMULAS)
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
        options: Any,
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
    query: Array, key: Array, value: Array, lead: tuple[str, ...], options: Any
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
