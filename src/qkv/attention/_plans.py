"""The plan of an attention call: which backend runs it, and how. Made once per call from the
checked :class:`~qkv.attention._options.Call`, and kept for plain calls.

:func:`make_plan` lets every backend with an ``on_auto`` see an auto call, then asks the
registry (:func:`choose`: the backend requested, or auto's choice) and lets the chosen backend
``prepare`` what it works out once. The plan's route says how it runs:

- ``"direct"``: the backend runs the call;
- ``"rows"``: a trace is recorded and the backend does not form the steps: it computes the
  context, and the reference only the trace's selected heads and query rows
  (:func:`~qkv.attention._long_trace.record_partial`);
- ``"graph"``: ``torch.compile`` traces the call: the first backend whose ``in_graph`` form
  takes it runs in the graph, else the call runs eagerly outside it (``_compiled.py``).

A *plain* call has PyTorch tensors (no subclass) and only options that are no array,
function or random draw: no mask, bias, score modifier, sinks, dropout, weights, trace or
tracing block, outside ``torch.compile``. Every check of such a call and auto's choice depend
on its signature alone (:class:`PlanKey`), so when the backend that ran it ``plans``, its
plan is kept under that signature, with the checked call less its tensors: the next call of
that signature skips the checks and the choice (:meth:`Plan.again`). Only what reads values
(the look at torch's output for a NaN or ±inf) runs again.

Why: after a large fused kernel the processor's caches hold its data, and the Python of a
full check and plan then costs several hundred microseconds, 3-5 % of a forward at N = 1024
on a 2-core CPU (docs/benchmarks.md, "auto's cost").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

from qkv._array import Array, compiling, like_layout
from qkv.attention._backend import refusal_error
from qkv.attention._backends import BACKENDS, stepwise
from qkv.attention._options import Call
from qkv.attention._recorder import Recorder
from qkv.trace import blocks_open

__all__ = ["PLANS", "Plan", "PlanKey", "choose", "make_plan", "plain_signature", "run_call"]

PLAN_LIMIT = 256
"""Signatures kept at most (a model has a few: one per layer shape); beyond, the oldest go."""

Route = Literal["direct", "rows", "graph"]


@dataclass(frozen=True)
class Plan:
    """How one checked call runs.

    Attributes:
        backend: the name of the backend that runs it (under ``torch.compile``: the one
            requested, ``"auto"`` included).
        route: ``"direct"``, ``"rows"`` or ``"graph"`` (the module docstring).
        prepared: what the backend's ``prepare`` worked out, handed to it as
            ``call.prepared``.
        template: a kept plan's checked call without its tensors, which :meth:`again`
            fills in; None for a plan that is not kept.
    """

    backend: str
    route: Route = "direct"
    prepared: Any = None
    template: Call | None = None

    def run(self, call: Call) -> tuple[Array, Array | None]:
        """Compute the call as planned: (context, weights or None), in the call's layout."""
        if self.route == "graph":
            from qkv.attention._compiled import run_in_graph

            return run_in_graph(call, self.backend, run_call)
        backend = BACKENDS[self.backend]
        if self.route == "direct":
            return backend.run(
                call if self.prepared is None else replace(call, prepared=self.prepared)
            )
        from qkv.attention._long_trace import record_partial

        context, _ = backend.run(replace(call, recorder=Recorder(), prepared=self.prepared))
        record_partial(call, call.recorder.trace, context, backend=self.backend)  # type: ignore[arg-type]
        return context, None

    def again(self, query: Any, key: Any, value: Any) -> Any:
        """The kept plan on a new call of its signature: the context, laid out as the query."""
        t = self.template
        assert t is not None, "only a kept plan runs again"
        call = Call(
            t.library,
            t.xp,
            query,
            key,
            value,
            t.lead,
            t.options,
            t.return_weights,
            t.recorder,
            t.torch,
            t.cuda,
            t.grad,
            t.layout,
            t.prepared,
        )  # dataclasses.replace costs several microseconds more
        context, _ = BACKENDS[self.backend].run(call)
        return like_layout(context, query)


def make_plan(
    call: Call,
    requested: str = "auto",
    *,
    rows_only: bool = False,
    signature: PlanKey | None = None,
) -> Plan:
    """The plan of a checked call on the backend ``requested`` (or auto's choice); the plan
    of a plain call (its ``signature`` given) is kept when its backend ``plans``.

    ``rows_only=True`` (a model's traced layer) makes ``"auto"`` prefer the ``"rows"``
    route whenever the trace selects fewer heads or query rows than the call has and no
    weights are asked for: the fast backend that would run the call untraced computes the
    context, and the reference only the selected rows, in O(rows · Lk) memory instead of
    O(H · Lq · Lk).

    Raises:
        ValueError: an unknown backend, or one that cannot run the call (its reason).
        MemoryError: auto, weights asked for, and the reference's matrices would not fit.
    """
    if call.torch and compiling():
        return Plan(requested, "graph")
    auto = requested == "auto"
    if auto:
        for backend in BACKENDS.values():
            if backend.on_auto is not None:
                backend.on_auto(call)
    name = None
    if rows_only and auto and _selects_part(call):
        fast = choose(replace(call, recorder=Recorder()), "auto")
        name = None if BACKENDS[fast].records_steps else fast
    if name is None:
        name = choose(call, requested)
    chosen = BACKENDS[name]
    route: Route = "direct"
    if call.recorder.trace is not None and not chosen.records_steps:
        route = "rows"
    plan = Plan(name, route, None if chosen.prepare is None else chosen.prepare(call))
    if signature is not None and route == "direct" and chosen.plans:
        PLANS.keep(signature, replace(call, query=None, key=None, value=None), plan)
    return plan


def run_call(
    call: Call, backend: str = "auto", *, rows_only: bool = False
) -> tuple[Array, Array | None]:
    """Plan a checked call and run it: (context, weights or None), in the call's layout
    (:func:`make_plan`'s arguments)."""
    return make_plan(call, backend, rows_only=rows_only).run(call)


# -- choosing a backend --------------------------------------------------------------------


class Refusals(dict[str, str | None]):
    """Each backend's refusal of a call, asked only when needed (auto looks no further than
    its first choice)."""

    def __init__(self, call: Call, auto: bool) -> None:
        super().__init__()
        self.call, self.auto = call, auto

    def __missing__(self, name: str) -> str | None:
        why = BACKENDS[name].refusal(self.call, self.auto)
        self[name] = why
        return why


def choose(call: Call, requested: str) -> str:
    """The backend that runs ``call``: the one requested (if it can), or auto's choice."""
    if requested == "auto":
        return auto_choice(call, Refusals(call, auto=True))[0]
    if requested not in BACKENDS:
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {requested!r}. "
            "Hint: 'auto' picks the fastest one that can run the call."
        )
    why = BACKENDS[requested].refusal(call, False)
    if why is not None:
        raise refusal_error(requested, why)
    return requested


def auto_choice(call: Call, refusals: Refusals) -> tuple[str, str]:
    """Auto's backend for the call, and why: the reference for NumPy, weights and a trace
    that fits; else the first fast backend that takes it (:func:`fast_order`)."""
    steps = stepwise()  # the reference: it forms every step
    if not call.torch:
        return steps, "NumPy inputs: the reference runs them"
    if call.return_weights:
        if refusals[steps] is not None:
            raise MemoryError(
                f"return_weights=True: the weights {refusals[steps]}. Hint: record a "
                "few heads and query rows instead with qkv.tracing(heads=..., queries=...)."
            )
        return steps, "the weights are asked for: only the reference forms them"
    if call.recorder.trace is not None and refusals[steps] is None:
        return steps, "a trace is recorded: the reference forms every step"
    for name in fast_order(call):
        if refusals[name] is None:
            return name, BACKENDS[name].why(call)
    if refusals[steps] is None or BACKENDS[steps].refusal(call, False) is None:
        return steps, "the fast backends refuse this call"
    raise ValueError(
        "no backend can run this call: "
        + "; ".join(f"{n}: {refusals[n]}" for n in BACKENDS if refusals[n])
    )


def fast_order(call: Call) -> tuple[str, ...]:
    """The fast backends in the order auto tries them: the registry's order, with those
    whose ``first(call)`` holds moved to the front (on CUDA, flex for a qkv mask rule or a
    score modifier)."""
    fast = [name for name, b in BACKENDS.items() if b.fast]
    ahead = [n for n in fast if BACKENDS[n].first is not None and BACKENDS[n].first(call)]  # type: ignore[misc]
    return (*ahead, *(n for n in fast if n not in ahead))


def _selects_part(call: Call) -> bool:
    """Whether the call's trace records fewer (head, query row) pairs than the call has and
    no weights are asked for (then the reference need not run on every row)."""
    trace = call.recorder.trace
    if trace is None or call.return_weights or not call.torch:
        return False
    heads_total = int(call.query.shape[-3]) if "head" in call.lead else 1
    q_len = int(call.query.shape[-2])
    heads = trace.selection("head", heads_total) if "head" in call.lead else None
    queries = trace.selection("query", q_len)
    kept = (heads_total if heads is None else len(heads)) * (
        q_len if queries is None else len(queries)
    )
    return kept < heads_total * q_len


# -- the plans of plain calls --------------------------------------------------------------


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


class Plans(dict[PlanKey, Plan]):
    """Plans by signature, at most :data:`PLAN_LIMIT` (the oldest dropped first)."""

    def keep(self, signature: PlanKey, template: Call, plan: Plan) -> None:
        """Keep the plan of a plain call with its checked call less the tensors."""
        if len(self) >= PLAN_LIMIT:
            del self[next(iter(self))]
        self[signature] = replace(plan, template=replace(template, prepared=plan.prepared))


PLANS = Plans()


def plain_signature(query: Any, key: Any, value: Any, arguments: dict[str, Any]) -> PlanKey | None:
    """The signature of a plain call (module docstring), or None for any other call.

    ``arguments``: the keyword arguments of :func:`qkv.scaled_dot_product_attention`.
    """
    torch = sys.modules.get("torch")
    if torch is None:
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
    if blocks_open():
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
