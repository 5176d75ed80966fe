"""The inputs the page needs to recompute a call when the learner edits it ("edit and watch").

The page's script (``assets/lab.js``) recomputes attention from these inputs in float64:
``Q = X·W_q``, ``K = X·W_k``, ``V = X·W_v`` split into heads, ``S = Q·Kᵀ``, ``S' = S·scale``,
the causal mask, the softmax with its row maximum subtracted, ``C = A·V``, the heads side by
side and ``·W_o``. A call gets inputs only when the page can reproduce it exactly: a plain
self-attention call of a worked example (embeddings and W_q, W_k, W_v recorded), or Q, K and
V given directly; no padding mask, window, score_mod, sinks, GQA or dropout. This module
checks that by recomputing the call with qkv's core from the inputs it hands over.

The page also needs the words of every step for each choice the learner can make (heads,
scaling, causal): they come from :func:`qkv.render.narrate` on the same call over its first
two tokens, so the titles, formulas and meanings are the ones ``qkv explain`` writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from qkv.attention import multi_head_attention, scaled_dot_product_attention
from qkv.render._narrative import trace_calls
from qkv.trace import Trace, TraceCall, tracing

__all__ = ["LAB_CALLS_MAX", "LAB_NUMBERS_MAX", "lab_data"]

LAB_NUMBERS_MAX = 200_000
"""The most input numbers a call may hand to the page for editing."""

LAB_CALLS_MAX = 16
"""The page's first 16 attention calls can be edited; later ones are shown as recorded."""

_PROJECTIONS = ("embeddings", "W_q", "W_k", "W_v")
_DIRECT = ("Q", "K", "V")
_HEADS_MAX = 8  # head counts offered
_TOKEN_AXES = ("token", "query", "key")

Describe = Callable[[Trace, TraceCall], tuple[dict[str, Any], list[list[str]]]]
"""What the page shows of one call (its data and its label lists), as ``_html`` builds it."""


def lab_data(
    trace: Trace,
    call: TraceCall,
    shown: dict[str, Any],
    label_id: Callable[[list[str]], int],
    describe: Describe,
    keep: set[str] | None,
) -> dict[str, Any] | None:
    """The call's inputs, options and the words of each variant, or None when the page
    cannot recompute it (see the module docstring).

    Args:
        trace: the whole trace (its tokens and facts).
        call: the call with every step it recorded (before ``steps=`` keeps some).
        shown: the call's page data as built (its label ids name the token axes).
        label_id: stores a label list in the page's labels and returns its position.
        describe: builds the page data of a call of another trace.
        keep: the step names the page keeps (``steps=``), or None for all.
    """
    meta = call.meta
    names = {step.name for step in call}
    kind = "projections" if set(_PROJECTIONS) <= names else "qkv"
    if not set(_DIRECT) <= names or "weights" not in names or "context" not in names:
        return None
    plain = (
        meta.get("mask") is None
        and meta.get("score_mod") is None
        and meta.get("sinks") is None
        and meta.get("rows") is None
        and meta.get("num_kv_heads", meta.get("num_heads")) == meta.get("num_heads")
        and (not meta.get("causal") or meta.get("causal_alignment") == "top-left")
        and not ({"dropout", "bias", "sinks"} & names)
        and isinstance(meta.get("scale"), int | float)
    )
    if not plain:
        return None
    heads = int(meta.get("num_heads") or 1)
    inputs = _inputs(call, kind, heads)
    if inputs is None or sum(np.size(a) for a in inputs.values() if a is not None) > (
        LAB_NUMBERS_MAX
    ):
        return None
    causal = bool(meta.get("causal"))
    factor = float(meta["scale"])
    d_k = _d_k(inputs, kind, heads)
    scale = _scale_name(factor, d_k)
    if not _reproduces(call, inputs, kind, heads, causal, factor):
        return None
    options = _head_options(inputs, kind, heads)
    scales = ["sqrt_dk", "none", "d_k"] + (["given"] if scale == "given" else [])
    axis_labels = _axis_labels(shown)
    words: _Words = _Words()
    variants = {}
    for count in options:
        for name in scales:
            for masked in (False, True):
                key = f"{count}|{name}|{int(masked)}"
                variants[key] = _variant(
                    inputs, kind, count, _factor(name, factor, inputs, kind, count), masked,
                    trace, describe, label_id, axis_labels, keep, words,
                )  # fmt: skip
    return {
        "kind": kind,
        "inputs": {k: None if v is None else v.tolist() for k, v in inputs.items()},
        "heads": heads,
        "headOptions": options,
        "scale": scale,
        "scales": scales,
        "factor": factor,
        "causal": causal,
        "steps": words.steps,
        "variants": variants,
    }


class _Words:
    """The words of the steps (title, formula, meaning, labels), each stored once: most are
    the same in every variant, which then lists positions in :attr:`steps`."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._index: dict[str, int] = {}

    def id(self, step: dict[str, Any]) -> int:
        key = json.dumps(step, sort_keys=True)
        if key not in self._index:
            self._index[key] = len(self.steps)
            self.steps.append(step)
        return self._index[key]


def _inputs(call: TraceCall, kind: str, heads: int) -> dict[str, np.ndarray | None] | None:
    def batch0(name: str) -> np.ndarray:
        step = call[name]
        index = tuple(
            slice(None) if axis in ("head", "kv_head", "query", "key", "token", "model",
                                    "dim", "feature") else 0
            for axis in step.axes
        )  # fmt: skip
        return np.array(step.value[index], dtype=np.float64)

    if kind == "projections":
        found: dict[str, np.ndarray | None] = {name: batch0(name) for name in _PROJECTIONS}
        found["W_o"] = batch0("W_o") if "W_o" in call else None
        if any(a is not None and a.ndim != 2 for a in found.values()):
            return None
        return found
    direct = {name: batch0(name) for name in _DIRECT}
    for name, a in direct.items():
        if a.ndim == 2:
            direct[name] = a[None]
        if direct[name].ndim != 3 or direct[name].shape[0] != heads:
            return None
    return dict(direct)


def _d_k(inputs: dict[str, np.ndarray | None], kind: str, heads: int) -> int:
    if kind == "projections":
        w_q = inputs["W_q"]
        assert w_q is not None
        return int(w_q.shape[1]) // heads
    q = inputs["Q"]
    assert q is not None
    return int(q.shape[-1])


def _scale_name(factor: float, d_k: int) -> str:
    if math.isclose(factor, 1 / math.sqrt(d_k), rel_tol=1e-12):
        return "sqrt_dk"
    if factor == 1.0:
        return "none"
    if math.isclose(factor, 1 / d_k, rel_tol=1e-12):
        return "d_k"
    return "given"


def _factor(
    name: str, given: float, inputs: dict[str, np.ndarray | None], kind: str, heads: int
) -> float:
    d_k = _d_k(inputs, kind, heads)
    return {"sqrt_dk": 1 / math.sqrt(d_k), "none": 1.0, "d_k": 1 / d_k}.get(name, given)


def _head_options(inputs: dict[str, np.ndarray | None], kind: str, heads: int) -> list[int]:
    if kind != "projections":
        return [heads]
    w_q, w_v = inputs["W_q"], inputs["W_v"]
    assert w_q is not None and w_v is not None
    width = math.gcd(int(w_q.shape[1]), int(w_v.shape[1]))
    options = [h for h in range(1, width + 1) if width % h == 0][:_HEADS_MAX]
    return sorted(set(options) | {heads})


def _run(
    inputs: dict[str, np.ndarray | None],
    kind: str,
    heads: int,
    causal: bool,
    factor: float,
    length: int | None = None,
) -> Trace:
    """The call recomputed by qkv's core (float64, the reference), over the first
    ``length`` tokens when given."""
    cut = slice(None, length)
    with tracing() as trace:
        if kind == "projections":
            x, w_q, w_k, w_v = (inputs[name] for name in _PROJECTIONS)
            assert x is not None and w_q is not None and w_k is not None and w_v is not None
            multi_head_attention(
                x[cut], w_q, w_k, w_v, inputs["W_o"], num_heads=heads, is_causal=causal,
                scale=factor, backend="reference",
            )  # fmt: skip
        else:
            q, k, v = (inputs[name] for name in _DIRECT)
            assert q is not None and k is not None and v is not None
            # (H, L, D): one head as (L, D), several as (1, H, L, D), a batch of one
            q, k, v = (a[0] if heads == 1 else a[None] for a in (q[:, cut], k[:, cut], v[:, cut]))
            scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=factor, backend="reference"
            )
    return trace


def _reproduces(
    call: TraceCall,
    inputs: dict[str, np.ndarray | None],
    kind: str,
    heads: int,
    causal: bool,
    factor: float,
) -> bool:
    try:
        again = _run(inputs, kind, heads, causal, factor)
    except (ValueError, TypeError):
        return False
    (mine,) = trace_calls(again)
    for name in ("weights", "context", "output"):
        if name not in call:
            continue
        if name not in mine:
            return False
        theirs = call[name]
        for head in range(heads if "head" in theirs.axes else 1):
            a = np.asarray(theirs.select(head=head), dtype=np.float64)
            b = mine[name].select(head=head)
            if a.shape != b.shape or not np.allclose(a, b, rtol=1e-6, atol=1e-9):
                return False
    return True


def _axis_labels(shown: dict[str, Any]) -> dict[str, int]:
    """The label id of each token axis on the page: query, key, token."""
    found: dict[str, int] = {}
    for section in shown["sections"]:
        for step in section["steps"]:
            for axis, ids in ((step.get("rowAxis"), "rows"), (step.get("colAxis"), "cols")):
                if axis in _TOKEN_AXES and ids in step:
                    found.setdefault(axis, step[ids])
    if "token" not in found and "key" in found:
        found["token"] = found["key"]
    if "key" not in found and "token" in found:
        found["key"] = found["token"]
    if "query" not in found and "token" in found:
        found["query"] = found["token"]
    return found


def _variant(
    inputs: dict[str, np.ndarray | None],
    kind: str,
    heads: int,
    factor: float,
    causal: bool,
    trace: Trace,
    describe: Describe,
    label_id: Callable[[list[str]], int],
    axis_labels: dict[str, int],
    keep: set[str] | None,
    words: _Words,
) -> dict[str, Any]:
    """The words of every step for one choice of heads, scale and causal: the call run over
    its first two tokens, described as the page describes a call, without numbers. Each
    section lists its steps as positions in ``words.steps``."""
    small = _run(inputs, kind, heads, causal, factor, length=2)
    small.tokens = list(trace.tokens[:2]) if trace.tokens else None
    small.meta["name"] = trace.meta.get("name")
    (call,) = trace_calls(small)
    data, lists = describe(small, call)
    sections = []
    for section in data["sections"]:
        steps = []
        for step in section["steps"]:
            if keep is not None and step["name"] not in keep:
                continue
            out = {k: v for k, v in step.items() if k not in ("data", "shape", "equations")}
            out["equations"], out["notes"] = [], []
            for axis, ids in ((step.get("rowAxis"), "rows"), (step.get("colAxis"), "cols")):
                if ids not in step:
                    continue
                if axis in _TOKEN_AXES and axis in axis_labels:
                    out[ids] = axis_labels[axis]
                else:
                    out[ids] = label_id(lists[step[ids]])
            steps.append(words.id(out))
        if steps:
            sections.append({"title": section["title"], "head": section["head"], "steps": steps})
    facts = [fact for fact in data["facts"] if fact[0] not in ("tokens", "queries")]
    return {"heads": data["heads"], "facts": facts, "sections": sections}
