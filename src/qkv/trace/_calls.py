"""Call records: the steps of a trace grouped by the attention call that recorded them.

A trace keeps one :class:`CallInfo` per attention call while it records (its layer and
facts) and marks each step with the position of its call (:attr:`Step.call`).
:func:`group_calls` turns the flat steps back into :class:`TraceCall` records. Steps that
carry no call (added by hand, or read from a version-1 file) are grouped as qkv always did:
a new call starts where a step name comes again or the layer changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qkv.trace._step import Step, Steps

__all__ = ["CALL_FACTS", "CallInfo", "TraceCall", "group_calls"]

CALL_FACTS = (
    "num_heads",
    "num_kv_heads",
    "d_k",
    "d_v",
    "scale",
    "scale_mode",
    "causal",
    "causal_alignment",
    "mask",
    "score_mod",
    "partial",
)
"""The facts of one call that a version-1 file kept only in the trace's ``meta`` (those of
the last call); they become the meta of the last call read from such a file."""


@dataclass
class CallInfo:
    """What a trace keeps of one call besides its steps: the layer and the facts."""

    layer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceCall(Steps):
    """One attention call of a trace: where it ran, its facts and its steps.

    Attributes:
        index: its position among the trace's calls (0-based).
        layer: the module that ran it (``"blocks.3.attn"``), or None outside a model.
        position: its position among the calls of the same layer (0-based): a layer called
            once per generated token has calls 0, 1, 2, ...
        meta: the call's facts: ``scale``, ``scale_mode`` (``"sqrt_dk"``, ``"none"``,
            ``"custom"``), ``causal``, ``causal_alignment``, ``mask`` (a description),
            ``score_mod``, ``num_heads``, ``num_kv_heads``, ``d_k``, ``d_v``, ``shapes``
            (query, key, value), ``backend`` (the backend that computed the context) and,
            for a trace of selected rows computed beside a fast backend, ``rows`` (the
            heads and query rows it holds, and the full ``q_len``); a module adds its own
            (``head_dim``, ``positional``, ...). A call read from a version-1 file has only
            what that file kept.
        steps: its steps, in the order they ran (a multi-head call's projections included).
    """

    index: int
    layer: str | None
    position: int
    meta: Mapping[str, Any]
    steps: tuple[Step, ...]

    def _where(self) -> str:
        return f"call {self.index}"


def group_calls(
    steps: Sequence[Step], infos: Sequence[CallInfo], meta: Mapping[str, Any]
) -> list[TraceCall]:
    """The call records of a trace's steps (see the module docstring).

    ``infos`` are the trace's call infos (indexed by :attr:`Step.call`); ``meta`` is the
    trace's own, which gives the facts of calls read from a version-1 file.
    """
    groups: list[tuple[int | None, list[Step]]] = []
    for step in steps:
        call = step.call if step.call is not None and 0 <= step.call < len(infos) else None
        current = groups[-1] if groups else None
        if (current is not None and call is not None and current[0] == call) or (
            current is not None
            and call is None
            and current[0] is None
            and step.layer == current[1][0].layer
            and all(s.name != step.name for s in current[1])
        ):
            current[1].append(step)
        else:
            groups.append((call, [step]))
    given = meta.get("layers")
    layers: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    records: list[TraceCall] = []
    seen: dict[str | None, int] = {}
    for index, (call, members) in enumerate(groups):
        if call is not None:
            layer, facts = infos[call].layer, dict(infos[call].meta)
        else:  # no record: the facts a version-1 trace kept
            layer = members[0].layer
            facts = dict(layers.get(layer, {})) if layer is not None else {}
            if index == len(groups) - 1:
                facts.update({k: meta[k] for k in CALL_FACTS if k in meta})
        position = seen.get(layer, 0)
        seen[layer] = position + 1
        records.append(TraceCall(index, layer, position, facts, tuple(members)))
    return records
