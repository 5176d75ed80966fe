"""The public ``scaled_dot_product_attention``: check the inputs, pick a backend, say why.

The backends (``_backends.py``) share one signature and sit in a registry,
:data:`~qkv.attention._backends.BACKENDS`. ``backend="auto"`` takes the first that fits: the
reference for NumPy, for weights and for a trace that fits in memory; SDPA when it runs the
call without a large dense mask; else the tiled kernel. On CUDA, qkv's mask rules and score
modifiers go to compiled FlexAttention (``flex``) first, and the report names the kernel
torch's SDPA would run; on CPU, ``flex`` (compiled forward, tiled backward) takes them once a
rule and shape have run a few times and the compiled forward was measured the faster.
:func:`explain_dispatch` returns the choice with the reason of every refusal.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qkv._array import Array
from qkv.attention._backend import BackendName, half_name
from qkv.attention._backends import BACKENDS, name_width, stepwise
from qkv.attention._long_trace import record_partial
from qkv.attention._options import Call, handed_back, make_call
from qkv.attention._plans import (
    PLANS,
    Refusals,
    auto_choice,
    choose,
    fast_order,
    make_plan,
    plain_signature,
    run_call,
)
from qkv.masks import Alignment, Mask, ScoreMod
from qkv.trace import Trace

__all__ = [
    "BACKENDS",
    "Dispatch",
    "decide",
    "dispatch_of_trace",
    "explain_dispatch",
    "make_call",
    "run_call",
    "scaled_dot_product_attention",
    "weight_rows",
]


@dataclass(frozen=True)
class Dispatch:
    """The backend chosen for a call and why: what :func:`explain_dispatch` returns.

    Attributes:
        backend: the backend that runs; ``"none"`` when the requested one cannot.
        requested: what was asked (``"auto"`` or a backend's name).
        reasons: (backend, why it runs or why not), one per registered backend.
        notes: other facts of the run (a partial trace, the NaN check of SDPA, ...).
        refusal: why the requested backend cannot run the call (the call would raise
            ValueError), or None.
        sdpa_kernel: on CUDA, when sdpa runs: the kernel torch picks (``"flash"``,
            ``"memory-efficient"``, ``"cuDNN"``, ``"math"``); else None.
    """

    backend: str
    requested: str
    reasons: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = field(default=())
    refusal: str | None = None
    sdpa_kernel: str | None = None

    def __str__(self) -> str:
        """A short report that fits 80 columns."""
        lines = [f"backend: {self.backend} (asked: {self.requested})"]
        width = max([name_width(), *(len(name) for name, _ in self.reasons)])
        for name, why in self.reasons:
            mark = "→" if name == self.backend else " "
            lines += textwrap.wrap(
                why,
                78,
                initial_indent=f" {mark} {name:<{width}} ",
                subsequent_indent=" " * (width + 4),
            )
        for note in self.notes:
            lines += textwrap.wrap(note, 78, initial_indent="   note: ", subsequent_indent=" " * 9)
        return "\n".join(lines)


# -- the report ----------------------------------------------------------------------------


def decide(call: Call, requested: str) -> Dispatch:
    """The backend for ``call``, as the plan picks it, with every backend's reason.

    A requested backend that cannot run the call gives a Dispatch with backend ``"none"``
    and the reason in ``refusal`` (running the call raises ValueError).
    """
    listed = tuple(BACKENDS)
    if requested != "auto" and requested in BACKENDS:
        refused = BACKENDS[requested].refusal(call, False)
        if refused is not None:
            reasons_of = {n: _refused_or_not(BACKENDS[n].refusal(call, False)) for n in listed}
            return Dispatch(
                "none",
                requested,
                tuple(reasons_of.items()),
                (
                    f"backend={requested!r} would raise ValueError; backend='auto' picks one "
                    "that can run the call",
                ),
                refused,
            )
    chosen = choose(call, requested)
    reasons: dict[str, str] = {}
    if requested != "auto":
        for name in listed:
            why = BACKENDS[name].refusal(call, False)
            reasons[name] = "asked for" if name == chosen else _refused_or_not(why)
    else:
        refusals = Refusals(call, auto=True)
        why_chosen = auto_choice(call, refusals)[1]
        for name in listed:
            if name == chosen:
                reasons[name] = why_chosen
            elif refusals[name] is not None:
                reasons[name] = f"refused: {refusals[name]}"
            else:
                reasons[name] = "could run; " + _passed_over(call, name, chosen)
    notes = []
    options = call.options
    backend = BACKENDS[chosen]
    if not backend.records_steps and call.trace is not None:
        notes.append(_trace_note(call))
    own = backend.notes(call)
    notes.extend(own.lines)
    if backend.checks_output(call):
        notes.append(
            f"{chosen}'s output is checked for NaN/inf; if any, the tiled kernel redoes it"
        )
    if options.is_causal and options.mask is not None:
        notes.append(
            "is_causal=True and mask= are combined: a key is attended only where both allow "
            "it (torch's SDPA raises instead)"
        )
    half = half_name(call)
    if half is not None and backend.half_in is not None:
        notes.append(f"{half}: computed in {backend.half_in} and the result rounded to {half}")
    elif half is not None:
        notes.append(f"{half}: {_wider()}")
    ordered = tuple((name, reasons[name]) for name in listed)
    return Dispatch(chosen, requested, ordered, tuple(notes), sdpa_kernel=own.kernel)


def _wider() -> str:
    """The backends that compute half inputs in a wider dtype: "backend='…' or '…' compute
    in float32"."""
    kept = [(n, b.half_in) for n, b in BACKENDS.items() if b.half_in is not None]
    names = [repr(n) for n, _ in kept]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    dtypes = sorted({str(d) for _, d in kept})
    return f"backend={listed} compute in {' or '.join(dtypes)}"


def _passed_over(call: Call, name: str, chosen: str) -> str:
    order = [stepwise(), *fast_order(call)]
    if BACKENDS[name].records_steps:
        return "but forms every (Lq, Lk) step"
    if name not in order or chosen not in order:
        return "not needed"
    return f"{chosen} comes first" if order.index(name) > order.index(chosen) else "not needed"


def _refused_or_not(why: str | None) -> str:
    return "could run" if why is None else f"refused: {why}"


def _trace_note(call: Call) -> str:
    return (
        "trace: Q, K, V and context are recorded whole; the (Lq, Lk) steps only for the "
        "selected heads and query rows, by the reference"
    )


# -- the public function -------------------------------------------------------------------


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | Mask | None = None,
    bias: Array | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    is_causal: bool = False,
    causal_alignment: Alignment = "top-left",
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    generator: Any = None,
    sinks: Array | None = None,
    return_weights: bool = False,
    trace: Trace | None = None,
    backend: BackendName = "auto",
) -> Any:
    """Attention(Q, K, V) = softmax(Q·Kᵀ · scale + bias, masked) · V.

    Every backend computes the same function as the readable reference
    (:func:`qkv.attention.reference_attention`, tested in float64 against each of them).
    NumPy arrays give NumPy results, PyTorch tensors give tensors on the same device and
    dtype. float16 and bfloat16 are computed in float32 by the reference and the tiled
    kernel; the sdpa backend hands them to torch's fused kernel as they are (its weights are
    rounded to the half type; ``explain_dispatch`` notes which applies). Inputs of more than
    four dimensions run on the reference; a batch of size 0 gives an empty result.

    Args:
        query: (..., H, Lq, D), or (Lq, D) for a single head; or nested jagged tensors
            (B, H, j, D) for query, key and value (``torch.nested``, ``layout=torch.jagged``,
            ragged along the sequence): each sequence attends only to itself, the result
            is jagged too.
        key: (..., Hkv, Lk, D).
        value: (..., Hkv, Lk, Dv).
        mask: boolean, **True = may attend**, broadcastable to (..., H, Lq, Lk); or a
            :class:`qkv.masks.Mask`. A query with no allowed key gets zero weights and a zero
            context vector.
        bias: added to the scaled scores, broadcastable to (..., H, Lq, Lk) (e.g. ALiBi).
        score_mod: a :class:`qkv.masks.ScoreMod` (``masks.alibi(H)``, ``masks.softcap(c)``)
            or a function ``(score, b, h, q_idx, kv_idx) -> score``, applied after the bias
            and before the mask.
        is_causal: query i attends only keys j ≤ i (combined with ``mask`` if both are given).
        causal_alignment: ``"top-left"`` or ``"bottom-right"`` (for Lq < Lk, as in decoding
            with a KV cache; the last query sees every key).
        scale: multiplies the scores; default 1/√D. ``scale=1.0`` means no scaling.
        enable_gqa: allow H > Hkv (grouped-query attention): query head h uses key/value
            head h // (H / Hkv).
        dropout_p: probability of dropping an attention weight (training only).
        generator: random source for dropout: a ``numpy.random.Generator``, a
            ``torch.Generator`` or an int seed. One seed is drawn per call and the dropped
            weights follow :func:`qkv.masks.dropout_keep`, the same on every backend.
        sinks: per-head attention-sink logits, shape (H,) (often a learnable parameter):
            A_ij = exp(S'_ij) / (Σ_j exp(S'_ij) + exp(sink_h)), so each row sums to less
            than 1; a fully masked row then gives all its attention to the sink (zeros), a
            −inf sink is no sink. Gradients reach the sinks on the reference and tiled
            backends.
        return_weights: also return the attention weights (before dropout).
        trace: record every step into this :class:`qkv.Trace` (default: the enclosing
            :func:`qkv.tracing` block, if any). When the (Lq, Lk) steps would not fit in
            memory, only the trace's selected heads and query rows are recorded (a
            warning says which).
        backend: ``"auto"`` (default) or the name of a backend in the registry
            :data:`qkv.attention.BACKENDS` (each with its ``description``; the kernels page
            of the docs tells them apart); see :func:`qkv.explain_dispatch`.

    Returns:
        context (..., H, Lq, Dv), a tensor laid out in memory as the query is (as torch's
        SDPA does, on every backend); with ``return_weights``, ``(context, weights)`` with
        weights (..., H, Lq, Lk).

    Raises:
        ValueError, TypeError: on shapes, dtypes or options that do not fit, naming the
            argument, what was expected and what came; a backend that cannot run the call.

    Example:
        >>> import numpy as np
        >>> q = np.array([[0.0, 2 ** 0.5]])              # one query, d_k = 2
        >>> k = np.array([[0.0, 0.0], [0.0, 1.0]])       # two keys: q·k = 0 and √2
        >>> v = np.array([[1.0, 0.0], [0.0, 1.0]])
        >>> context, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
        >>> weights                                       # [1, e] / (1 + e)
        array([[0.26894142, 0.73105858]])
        >>> context
        array([[0.26894142, 0.73105858]])
    """
    arguments = {
        "mask": mask,
        "bias": bias,
        "score_mod": score_mod,
        "is_causal": is_causal,
        "causal_alignment": causal_alignment,
        "scale": scale,
        "enable_gqa": enable_gqa,
        "dropout_p": dropout_p,
        "generator": generator,
        "sinks": sinks,
        "return_weights": return_weights,
        "trace": trace,
    }
    signature = plain_signature(query, key, value, {**arguments, "backend": backend})
    kept = None if signature is None else PLANS.get(signature)
    if kept is not None:  # a plain call of a signature seen before
        return kept.again(query, key, value)
    call = make_call(query, key, value, **arguments)  # 1. check once
    plan = make_plan(call, backend, signature=signature)  # 2. plan once (kept if plain)
    context, weights = plan.run(call)  # 3. compute
    context = handed_back(context, call.layout)
    return (context, weights) if return_weights else context


def dispatch_of_trace(trace: Trace) -> Dispatch:
    """The backend choice for the attention call a trace recorded (its Q, K, V steps and
    options), as :func:`explain_dispatch` reports it.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
        >>> dispatch_of_trace(t).backend
        'reference'
    """
    q, k, v = (trace[name].value for name in ("Q", "K", "V"))
    gqa = q.ndim >= 3 and q.shape[-3] != k.shape[-3]
    return explain_dispatch(
        q,
        k,
        v,
        is_causal=bool(trace.meta.get("causal")),
        causal_alignment=trace.meta.get("causal_alignment", "top-left"),
        enable_gqa=gqa,
        trace=trace,
    )


def explain_dispatch(
    query: Array,
    key: Array,
    value: Array,
    *,
    backend: BackendName = "auto",
    **options: Any,
) -> Dispatch:
    """Which backend :func:`scaled_dot_product_attention` would run for these arguments, and
    why each of the others was refused or passed over. Nothing is computed.

    Takes the arguments of :func:`scaled_dot_product_attention`; print the result for a
    short report.

    Example (``print(report)`` lists every backend of the registry, one line each):
        >>> import numpy as np
        >>> q = np.ones((4, 8))
        >>> report = explain_dispatch(q, q, q)
        >>> report.backend, report.reasons[0]
        ('reference', ('reference', 'NumPy inputs: the reference runs them'))
        >>> dict(report.reasons)["tiled"]
        'refused: needs PyTorch tensors; these are NumPy arrays'
    """
    generator = options.pop("generator", None)
    dropout = options.get("dropout_p", 0.0)
    call = make_call(query, key, value, generator=0 if dropout else generator, **options)
    return decide(call, backend)


def weight_rows(
    query: Array, key: Array, value: Array, heads: list[int], rows: list[int], **options: Any
) -> Array:
    """The exact attention weights of some query heads and rows, on the reference.

    Only those rows are computed, in O(len(heads) · len(rows) · Lk) memory: what an
    intervention or a head statistic needs without forming the whole (Lq, Lk) pattern.
    ``options`` are those of :func:`scaled_dot_product_attention` (mask, bias, score_mod,
    is_causal, scale, sinks, ...); the rows of a call with sinks sum to less than 1.

    Returns:
        (…, len(heads), len(rows), Lk) weights, a NumPy array (float64 for float64 inputs).

    Example:
        >>> import numpy as np
        >>> q = k = v = np.ones((1, 2, 3, 4))                 # (B, H, L, D)
        >>> weight_rows(q, k, v, [1], [2], is_causal=True).round(3)
        array([[[[0.333, 0.333, 0.333]]]])
    """
    trace = Trace(heads=tuple(heads), queries=tuple(rows), record_steps=("weights",))
    call = make_call(query, key, value, trace=trace, **options)
    record_partial(call, trace, call.query, backend=stepwise())
    return trace["weights"].value
