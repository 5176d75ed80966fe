"""The backends of attention, one signature for all: each takes a checked
:class:`~qkv.attention._options.Call`, says what it refuses (and why), and runs it.

    reference   the readable reference (``_reference.py``), NumPy or PyTorch; forms every step
    sdpa        torch.nn.functional.scaled_dot_product_attention (fused, no (Lq, Lk) matrix
                unless a mask or bias has to be passed as one)
    flex        torch's FlexAttention under torch.compile: qkv's mask rules as cached block
                masks, score modifiers as its score_mod; on CPU, where torch has no
                backward, trained with the tiled kernel's backward (auto: on CUDA for mask
                rules, on CPU for mask rules called again with one shape)
    tiled       qkv.kernels.tiled_attention (O(L) memory, masks skip empty blocks)

:data:`BACKENDS` is the one list: the names a call accepts, the reports of
``explain_dispatch`` and the order auto tries them in come from it (and the tests'
parametrisations, ``tests/support/backends.py``). Adding a backend is one entry there.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from qkv._array import Array, library
from qkv.attention._options import Call
from qkv.attention._reference import attend
from qkv.masks import Mask

__all__ = [
    "BACKENDS",
    "DENSE_MASK_LIMIT",
    "MEMORY_FRACTION",
    "RULE_BLOCK",
    "RULE_MASK_LIMIT",
    "RULE_SKIPPED_SHARE",
    "Backend",
    "BackendName",
    "Call",
    "Notes",
    "count_auto_call",
    "cpu_run_key",
    "four",
    "four_mask",
    "half_name",
    "name_width",
    "needs_grad",
    "on_cuda",
    "planned",
    "refusal_error",
    "sdpa_checked",
    "sdpa_output",
    "sdpa_static_refusal",
    "sdpa_trusted",
    "stepwise",
    "structured",
    "three",
    "tiled_refusal",
]

BackendName = str
"""``"auto"`` or the name of a backend in :data:`BACKENDS` (checked when a call is made: the
registry is the one list of names, so the type does not repeat it)."""

DENSE_MASK_LIMIT = 1 << 22
"""Auto avoids SDPA when it would need a mask array of more elements than this (4 Mi: a
2048 × 2048 matrix); the tiled kernel evaluates such masks block by block instead."""

RULE_MASK_LIMIT = 1 << 19
"""On CPU, auto avoids SDPA for a mask rule (:mod:`qkv.masks`) over more (query, key) pairs
per head than this (512 Ki: about 724 × 724) that rules out at least a quarter of its
blocks: torch would need the rule as a dense array and compute every pair, where the tiled
kernel (or the compiled path) skips those blocks. Measured on 2 cores: at N = 1024 a
sliding window or documents run 0.6–0.84× SDPA's time on the tiled kernel, forward and
forward + backward; at N = 512 SDPA is faster."""

RULE_BLOCK, RULE_SKIPPED_SHARE = 128, 0.25
"""The blocks and the share of them a mask rule must rule out for auto to avoid SDPA."""

MEMORY_FRACTION = 0.25
"""The share of the free memory a backend may fill with (Lq, Lk) matrices (the reference's
steps, a full trace) before auto looks elsewhere."""

_REFERENCE_COPIES = 5  # scores, scaled, masked, weights, and softmax's temporaries


@dataclass(frozen=True)
class Notes:
    """What a dispatch report adds when a backend runs a call: its lines, and on CUDA the
    kernel torch picks for it (``Dispatch.sdpa_kernel``)."""

    lines: tuple[str, ...] = ()
    kernel: str | None = None


@dataclass(frozen=True)
class Backend:
    """A backend: its name, a one-line description, what it refuses, how it runs, and the
    facts that dispatch, its reports, the tests and the docs read (never its name).

    ``refusal(call, auto)`` returns None when the backend can run the call, else the reason
    in a few words; ``auto`` is True when the choice is the dispatcher's (a backend may
    then refuse calls it could run, but slowly). ``run(call)`` returns (context, weights or
    None).

    Auto's part: ``fast`` backends are tried in the registry's order (the reference is not
    one: auto takes it for NumPy, weights and traces); one whose ``first(call)`` holds is
    tried before the others, and ``why(call)`` is auto's reason when it runs.

    Its facts:

    - ``records_steps``: it forms every step of the call through the call's recorder (the
      weights, a trace): auto's choice for NumPy inputs, weights and traces, and the one
      that records the selected rows of a call another backend ran;
    - ``checks_output(call)``: its output of this call is looked at for a NaN or ±inf of a
      masked-out key, and the call redone on the tiled kernel if one got through;
    - ``compiles``: its first call of each (rule, shape, dtype) compiles (seconds), so the
      tests run it on a few shapes rather than on every drawn case;
    - ``half_in``: the dtype it computes float16 and bfloat16 inputs in, the result rounded
      back (within half a unit of the half type); None: it hands them to its kernel as they
      are (within a few units), and ``notes`` say how;
    - ``plans``: a plain torch call it runs is kept as a plan (``_plans.py``) and the next
      call of that signature goes straight to it;
    - ``runs``: the libraries, devices and dtypes it takes, in words (the kernels page's
      table);
    - ``notes(call)``: what a report adds when it runs the call (:class:`Notes`);
    - ``in_graph(call, auto)``: its form inside a ``torch.compile`` graph (reading no
      value): the result, or why it cannot run the call there; None: it runs outside the
      graph (``_compiled.py``).
    """

    name: str
    description: str
    refusal: Callable[[Call, bool], str | None]
    run: Callable[[Call], tuple[Array, Array | None]]
    why: Callable[[Call], str] = lambda call: "runs this call"
    first: Callable[[Call], bool] = lambda call: False
    fast: bool = True
    records_steps: bool = False
    checks_output: Callable[[Call], bool] = lambda call: False
    compiles: bool = False
    half_in: str | None = "float32"
    plans: bool = False
    runs: str = "PyTorch"
    notes: Callable[[Call], Notes] = lambda call: Notes()
    in_graph: Callable[[Call, bool], tuple[Array, Array | None] | str] | None = None


def stepwise() -> str:
    """The name of the backend that forms every step (the first that ``records_steps``)."""
    return next(name for name, b in BACKENDS.items() if b.records_steps)


def planned() -> str:
    """The name of the backend whose plain calls are kept as plans (``plans``)."""
    return next(name for name, b in BACKENDS.items() if b.plans)


def name_width() -> int:
    """The width of the name column of a dispatch report: the registry's longest name."""
    return max(len(name) for name in BACKENDS)


# -- the backends --------------------------------------------------------------------------


def _reference_refusal(call: Call, auto: bool) -> str | None:
    need = call.scores_elements() * _itemsize(call) * _REFERENCE_COPIES
    free = available_memory(call.query)
    if free is not None and need > free * MEMORY_FRACTION:
        return f"would form (Lq, Lk) matrices of {_size(need)}, too much for {_size(free)} free"
    if auto and call.torch and not call.return_weights and call.trace is None:
        return "slower than the fused kernels when neither weights nor a trace are asked for"
    return None


def _run_reference(call: Call) -> tuple[Array, Array | None]:
    return attend(
        call.xp,
        call.query,
        call.key,
        call.value,
        call.options,
        lead=call.lead,
        recorder=call.recorder,
    )


def _common_refusal(call: Call, what: str) -> str | None:
    if not call.torch:
        return "needs PyTorch tensors; these are NumPy arrays"
    if call.return_weights:
        return f"weights asked for: {what} never forms them"
    if len(call.lead) > 2:
        return f"{len(call.lead) + 2} dimensions: it takes at most (B, H, L, D)"
    return None


def _sdpa_refusal(call: Call, auto: bool) -> str | None:
    why = sdpa_static_refusal(call, auto)
    if why is None and _huge_bias_with_grad(call):
        return (
            "a bias beyond ±65536 (such as finfo.min for blocked keys) and a gradient: "
            "torch's backward is wrong on rows whose keys are all blocked"
        )
    return why


def sdpa_static_refusal(call: Call, auto: bool) -> str | None:
    """Why sdpa refuses ``call``, from its shapes, dtypes and options alone (no value is
    read): what ``torch.compile`` decides on. The one refusal that reads values, a huge
    bias with a gradient, is :func:`sdpa_trusted`'s to catch there."""
    common = _common_refusal(call, "torch's fused kernel")
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

    q4, k4 = four(call.query, call.lead), four(call.key, call.lead)
    elements = dense_mask_elements(
        tuple(q4.shape),
        tuple(k4.shape),
        mask=four_mask(options.mask, call),
        bias=four_mask(bias, call),
        is_causal=options.is_causal,
        causal_alignment=options.causal_alignment,
    )
    if elements > DENSE_MASK_LIMIT:
        kind = "mask and bias" if bias is not None else "mask"
        return f"would need a dense {kind} array of {elements:,} elements"
    rule = options.mask
    if isinstance(rule, Mask) and not on_cuda(call) and not _torch_causal(call, q4, k4):
        skipped = _skipped_share(rule, q4, k4)
        if skipped >= RULE_SKIPPED_SHARE:
            return (
                f"a mask rule that rules out {skipped:.0%} of its {RULE_BLOCK}-blocks: torch "
                "would compute every pair of its dense array, the tiled kernel skips them"
            )
    return None


def _torch_causal(call: Call, q4: Any, k4: Any) -> bool:
    """Whether torch runs the call's mask rule as its own ``is_causal`` (the rule is exactly
    a causal rule that torch's top-left alignment expresses), with no mask array."""
    from qkv.kernels._torch_sdpa import as_causal_flag, causal_kind

    options = call.options
    mask, is_causal, alignment = as_causal_flag(
        options.mask, options.is_causal, options.causal_alignment
    )
    q_len, kv_len = int(q4.shape[-2]), int(k4.shape[-2])
    return mask is None and causal_kind(is_causal, alignment, q_len, kv_len) != "rule"


def _skipped_share(rule: Mask, q4: Any, k4: Any) -> float:
    """The share of (query, key) blocks of :data:`RULE_BLOCK` that ``rule`` rules out
    wholly, for a call of more than :data:`RULE_MASK_LIMIT` pairs per head (0 below)."""
    from qkv.masks import EMPTY

    q_len, kv_len = int(q4.shape[-2]), int(k4.shape[-2])
    if q_len * kv_len <= RULE_MASK_LIMIT:
        return 0.0
    kinds = rule.blocks(q_len, kv_len, RULE_BLOCK, RULE_BLOCK, batch=int(q4.shape[0]))
    return float((kinds == EMPTY).mean())


def _huge_bias_with_grad(call: Call) -> bool:
    """A bias beyond ±65536 while a gradient is wanted (reads the bias: one reduction)."""
    bias = call.options.bias
    if bias is None or not needs_grad(call):
        return False
    from qkv.kernels import huge_bias

    return bool(huge_bias(bias))


def needs_grad(call: Call) -> bool:
    """Whether autograd records and query, key or value requires a gradient."""
    import torch

    return torch.is_grad_enabled() and any(
        getattr(x, "requires_grad", False) for x in (call.query, call.key, call.value)
    )


def sdpa_output(call: Call) -> Array:
    """torch's fused kernel on the call, (B, H, Lq, Dv), unchecked: what a compiled graph
    runs (``_compiled.py``)."""
    return _sdpa_forward(call)[0]


def _sdpa_forward(call: Call) -> tuple[Array, bool]:
    """torch's fused kernel on the call, (B, H, Lq, Dv), and whether its output is known to
    be the call's result (:func:`qkv.kernels._torch_sdpa.sdpa_forward`): else
    :func:`_run_sdpa` checks it."""
    from qkv.kernels._torch_sdpa import sdpa_forward

    options = call.options
    found: tuple[Array, bool] = sdpa_forward(
        four(call.query, call.lead),
        four(call.key, call.lead),
        four(call.value, call.lead),
        mask=four_mask(options.mask, call),
        bias=four_mask(options.bias, call),
        is_causal=options.is_causal,
        causal_alignment=options.causal_alignment,
        scale=options.scale,
        nan_rows=not sdpa_checked(call),  # else the check redoes any call with a NaN
    )
    return found


def sdpa_checked(call: Call) -> bool:
    """Whether sdpa's output needs :func:`sdpa_trusted`'s look (a mask or a bias: torch lets
    a NaN or ±inf of a masked-out key reach the output)."""
    return call.options.masked or call.options.bias is not None


def sdpa_trusted(out: Array, call: Call, *, grad: bool) -> bool:
    """Whether sdpa's output ``out`` is the call's result, else the tiled kernel must redo
    the call (:func:`qkv.kernels._torch_sdpa.sdpa_trusted`: a NaN or ±inf of a masked-out
    key, a huge bias with a gradient, ``grad``)."""
    from qkv.kernels._torch_sdpa import sdpa_trusted as trusted

    return trusted(out, call.query, call.key, call.options.bias, grad=grad)


def _run_sdpa(call: Call) -> tuple[Array, Array | None]:
    out, clean = _sdpa_forward(call)
    # torch lets a NaN or ±inf of a masked-out key reach every output (and its gradient), and
    # gives zeros to a row whose scores are all NaN; the tiled kernel keeps masked NaN out and
    # lets live NaN through. (A huge bias with a gradient was refused before: grad=False.)
    if not clean and sdpa_checked(call) and not sdpa_trusted(out, call, grad=False):
        return _run_tiled(call)
    return three(out, call.lead), None


def _sdpa_in_graph(call: Call, auto: bool) -> tuple[Array, Array | None] | str:
    """sdpa in a compiled graph: torch's kernel; with a mask or a bias its output is the
    *candidate* of the tiled kernel's operator, kept when the eager sdpa backend would keep
    it, else redone (with a gradient, SDPA sees NaN and ±inf replaced by 0, so that its
    backward stays finite on a redone call)."""
    why = sdpa_static_refusal(call, auto)
    if why is not None:
        return why
    if not sdpa_checked(call):
        return three(sdpa_output(call), call.lead), None
    from qkv.kernels._tiled_ops import finite

    source = call
    if needs_grad(call):  # torch's backward must not see a NaN of a redone call
        source = replace(
            call, query=finite(call.query), key=finite(call.key), value=finite(call.value)
        )
    candidate = sdpa_output(source)  # (B, H, Lq, Dv)
    return three(tiled_operator(call, candidate=candidate), call.lead), None


def _tiled_in_graph(call: Call, auto: bool) -> tuple[Array, Array | None] | str:
    """The tiled kernel in a compiled graph: its custom operator (an eager island)."""
    why = tiled_refusal(call)
    if why is not None:
        return why
    return three(tiled_operator(call, candidate=None), call.lead), None


def tiled_operator(call: Call, *, candidate: Any) -> Any:
    """The call on the tiled kernel's operator (keeping sdpa's ``candidate`` when it can):
    the context (B, H, Lq, Dv)."""
    import torch

    from qkv.kernels._tiled_ops import tiled_in_graph

    options = call.options
    seed = options.seed
    return tiled_in_graph(
        four(call.query, call.lead),
        four(call.key, call.lead),
        four(call.value, call.lead),
        mask=four_mask(options.dense_mask, call),
        bias=four_mask(options.bias, call),
        sinks=options.sinks,
        seed=seed if isinstance(seed, torch.Tensor) else None,
        candidate=candidate,
        is_causal=options.is_causal,
        causal_alignment=options.causal_alignment,
        scale=options.scale_for(int(call.query.shape[-1])),
        dropout_p=options.dropout_p,
        grad=needs_grad(call),
    )


def _tiled_refusal(call: Call, auto: bool) -> str | None:
    return tiled_refusal(call)


def tiled_refusal(call: Call) -> str | None:
    """Why the tiled kernel refuses ``call`` (from its layout and options alone), or None."""
    return _common_refusal(call, "the tiled kernel")


def refusal_error(requested: str, why: str) -> ValueError:
    """The error of asking for a backend that cannot run the call."""
    return ValueError(
        f"backend={requested!r} cannot run this call: {why}. Hint: backend='auto' "
        "picks one that can; qkv.explain_dispatch(...) shows why each is refused."
    )


def _run_tiled(call: Call) -> tuple[Array, Array | None]:
    from qkv.kernels._api import run_tiled

    options = call.options
    dense = options.dense_mask
    bias = options.bias
    out = run_tiled(
        four(call.query, call.lead),
        four(call.key, call.lead),
        four(call.value, call.lead),
        rule=options.rule,
        dense_mask=None if dense is None else four_mask(dense, call),
        bias=None if bias is None else four_mask(bias, call),
        score_mod=options.score_mod,
        scale=options.scale_for(int(call.query.shape[-1])),
        dropout_p=options.dropout_p,
        seed=options.seed,
        sinks=options.sinks,
    )
    return three(out, call.lead), None


def on_cuda(call: Call) -> bool:
    """Whether the call's tensors live on a CUDA device (where auto considers ``flex``)."""
    return call.torch and call.query.device.type == "cuda"


_FLEX_CPU_DTYPES = ("float32", "float16", "bfloat16")


def _flex_refusal(call: Call, auto: bool) -> str | None:
    common = _common_refusal(call, "compiled FlexAttention")
    if common is not None:
        return common
    options = call.options
    cuda = on_cuda(call)
    if options.dropout_p > 0:
        return "dropout: FlexAttention has no dropout"
    if options.dense_mask is not None:
        return (
            "a boolean mask array: FlexAttention takes mask rules (qkv.masks); sdpa takes "
            "arrays as they are"
        )
    bias = options.bias
    if bias is not None and getattr(bias, "requires_grad", False):
        return "a bias that needs a gradient"
    dtype = str(call.query.dtype).removeprefix("torch.")
    if not cuda:
        if dtype not in _FLEX_CPU_DTYPES:
            return (
                f"{dtype} on CPU: compiled FlexAttention there takes float32, float16, "
                "bfloat16 (the tiled kernel takes float64)"
            )
        if bias is not None and (needs_grad(call) or _sinks_need_grad(call)):
            return "a bias array and a gradient on CPU: the tiled kernel takes them"
        if bias is not None and options.sinks is not None:
            return "a bias array and sinks on CPU: the tiled kernel takes them"
        missing = _cpu_compile_refusal()  # a look at the PATH (cached) and a flag
        if missing is not None:
            return missing
    if auto:
        if dtype == "float64":
            return "float64: auto keeps it on the tiled kernel, which accumulates in float64"
        if int(call.query.shape[-1]) < 16 or int(call.value.shape[-1]) < 16:
            return "head dimension below 16: FlexAttention's kernels need D ≥ 16"
        if call.scores_elements() == 0:
            return "an empty call: nothing to compile"
        if bias is not None:
            return "a bias array: sdpa or the tiled kernel take it without a compiled closure"
        if not cuda:
            return _cpu_auto_refusal(call)
        if options.score_mod is not None and torch_grad_enabled() and _learnable(call):
            return (
                "a score modifier with tensors that need a gradient: FlexAttention's gradient "
                "of captured tensors is atomic (not deterministic) and has known failures; "
                "the tiled kernel computes it block by block (backend='flex' to use it)"
            )
    return None


def _cpu_compile_refusal() -> str | None:
    """Why the CPU cannot compile (no C++ compiler, or an earlier compile failed), or None."""
    from qkv.kernels._compiled_forward import COMPILED, compiler_missing

    missing = compiler_missing()
    if missing is not None:
        return missing
    if COMPILED.failure is not None:
        return f"torch.compile failed here before ({COMPILED.failure})"
    return None


def _cpu_auto_refusal(call: Call) -> str | None:
    """Auto's CPU rule: the compiled path for a mask rule or a score modifier called again
    and again with one shape (the compile is paid once), never for a single call."""
    from qkv.kernels._compiled_forward import (
        AUTO_COMPILE_VARIABLE,
        COMPILED,
        REPEATS,
        auto_compile_enabled,
    )

    if not structured(call):
        return "no mask rule or score modifier: nothing for compiled FlexAttention to skip"
    key = cpu_run_key(call)
    if key in COMPILED.seconds:
        verdict = COMPILED.verdict.get(key)
        if verdict is not None and verdict[0] > verdict[1]:
            flex_ms, tiled_ms = (1e3 * t for t in verdict)
            return (
                f"measured slower here: {flex_ms:.1f} ms a forward against the tiled "
                f"kernel's {tiled_ms:.1f} ms (the best of 2 each, after compiling)"
            )
        return None if auto_compile_enabled() else f"{AUTO_COMPILE_VARIABLE}=0"
    seen = COMPILED.calls.get(key, 0)
    if seen < REPEATS:
        return (
            f"it compiles per rule and shape (seconds): auto takes it once a rule and shape "
            f"have run {REPEATS} times; these have run {seen}"
        )
    if not auto_compile_enabled():
        return f"{AUTO_COMPILE_VARIABLE}=0: auto does not compile on CPU"
    return None


def cpu_run_key(call: Call) -> Any:
    """The key under which the compiled CPU path counts and caches this call (the last
    call's key is kept: auto's count, its refusal and the run ask for the same one)."""
    from qkv.kernels._compiled_forward import run_key

    options = call.options
    shapes = tuple(tuple(int(n) for n in x.shape) for x in (call.query, call.key, call.value))
    probe = needs_grad(call) or options.sinks is not None
    last = _LAST_KEY.get("call")
    if last is not None and last[0]() is options and last[1] == (shapes, probe):
        return last[2]
    key = run_key(options.rule, options.score_mod, shapes, call.query.dtype, probe)
    _LAST_KEY["call"] = (weakref.ref(options), (shapes, probe), key)
    return key


_LAST_KEY: dict[str, tuple[weakref.ref[Any], Any, Any]] = {}


def count_auto_call(call: Call) -> None:
    """Count an auto call that the compiled CPU path could take (a mask rule or a score
    modifier on CPU tensors): auto compiles only for repeated ones."""
    if not call.torch or on_cuda(call) or not structured(call):
        return
    from qkv.kernels._compiled_forward import COMPILED, auto_compile_enabled

    if auto_compile_enabled():
        COMPILED.count(cpu_run_key(call))


def torch_grad_enabled() -> bool:
    """Whether autograd records (``torch.is_grad_enabled()``)."""
    import torch

    return bool(torch.is_grad_enabled())


def _sinks_need_grad(call: Call) -> bool:
    sinks = call.options.sinks
    return torch_grad_enabled() and bool(getattr(sinks, "requires_grad", False))


def _learnable(call: Call) -> bool:
    """Whether the call's score modifier captures tensors that require grad: found by
    running it on one position, or held where its code can reach them."""
    from qkv.kernels._api import captured_tensors, closes_over_learnable

    modifier = call.options.score_mod
    if modifier is None:
        return False
    exclude = (call.query, call.key, call.value, call.options.bias, call.options.sinks)
    return closes_over_learnable(modifier, exclude=exclude) or bool(
        captured_tensors(modifier, call.query, exclude=exclude)
    )


def _run_flex(call: Call) -> tuple[Array, Array | None]:
    if on_cuda(call):
        return _run_flex_eager_result(call)
    if needs_grad(call) or call.options.sinks is not None:
        return _on_cpu(call, lambda: _run_compiled_cpu(call))
    return _on_cpu(call, lambda: _run_flex_eager_result(call))


def _on_cpu(
    call: Call, run: Callable[[], tuple[Array, Array | None]]
) -> tuple[Array, Array | None]:
    """The compiled path on CPU: its first call per key compiles (timed apart); the next
    :data:`~qkv.kernels._compiled_forward.VERDICT_SAMPLES` are each timed against one
    forward of the tiled kernel (auto's verdict: the faster of each's best); a failure falls
    back."""
    import time

    from qkv.kernels._compiled_forward import COMPILED, timed

    key = cpu_run_key(call)
    try:
        if key not in COMPILED.seconds:
            return timed(key, run)
        if key in COMPILED.verdict:
            return run()
        start = time.perf_counter()
        result = run()
        flex_seconds = time.perf_counter() - start
    except Exception as error:
        return _after_failure(call, error)
    COMPILED.sample(key, flex_seconds, _tiled_forward_seconds(call))
    return result


def _tiled_forward_seconds(call: Call) -> float:
    """One forward of the tiled kernel on the call (no gradient), in seconds."""
    import time

    import torch

    with torch.no_grad():
        start = time.perf_counter()
        _run_tiled(call)
        return time.perf_counter() - start


def _run_compiled_cpu(call: Call) -> tuple[Array, Array | None]:
    """Compiled FlexAttention's forward with the tiled kernel's backward (CPU, gradients or
    sinks: :mod:`qkv.kernels._compiled_forward`)."""
    from qkv.kernels._compiled_forward import compiled_attention

    options = call.options
    q4, k4, v4 = (four(x, call.lead) for x in (call.query, call.key, call.value))
    out = compiled_attention(
        q4,
        k4,
        v4,
        rule=options.rule,
        score_mod=options.score_mod,
        scale=options.scale_for(int(q4.shape[-1])),
        sinks=options.sinks,
    )
    return three(out, call.lead), None


def _after_failure(call: Call, error: Exception) -> tuple[Array, Array | None]:
    """The compiled path raised: the tiled kernel runs the call. If it runs, compiling was
    at fault (recorded, and said once); if it raises too, the call itself was (its error)."""
    from qkv.kernels._compiled_forward import COMPILED

    result = _run_tiled(call)
    COMPILED.fail(error)
    return result


def _run_flex_eager_result(call: Call) -> tuple[Array, Array | None]:
    """torch's compiled FlexAttention, forward only (on CUDA, autograd gives its backward)."""
    import torch

    from qkv.kernels._api import with_sinks
    from qkv.kernels._flex_masks import BLOCK_MASKS, run_flex

    options = call.options
    q4, k4, v4 = (four(x, call.lead) for x in (call.query, call.key, call.value))
    if not on_cuda(call):  # no gradient here: torch's CPU flex refuses tensors that want one
        q4, k4, v4 = (x.detach() for x in (q4, k4, v4))
    batch, heads, q_len, d_k = (int(n) for n in q4.shape)
    kv_len = int(k4.shape[2])
    rule = options.rule
    block_mask = None
    if rule is not None:
        block_mask = BLOCK_MASKS.block_mask(
            rule,
            batch=batch,
            heads=heads,
            q_len=q_len,
            kv_len=kv_len,
            device=q4.device,
        )
    bias = four_mask(options.bias, call)
    score_mod = BLOCK_MASKS.score_mod(
        options.score_mod, q_len, kv_len, bias, device=q4.device, dtype=q4.dtype
    )
    sinks = options.sinks
    result = run_flex(
        q4,
        k4,
        v4,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=options.scale_for(d_k),
        enable_gqa=heads != int(k4.shape[1]),
        return_lse=sinks is not None,
    )
    if sinks is None:
        out = result
    else:
        out, lse = result  # lse: float32 for half inputs
        compute = torch.promote_types(q4.dtype, torch.float32)
        out = with_sinks(out.to(compute), lse.to(compute), sinks.to(compute))[0].to(q4.dtype)
    if options.masked or options.score_mod is not None or sinks is not None:
        # As for sdpa: a NaN or ±inf of a masked-out key must not reach the output (flex
        # multiplies its zero weight by the value). On CPU (no gradient here) a look at the
        # output's rows first; else, and when that look fails, one reduction per tensor.
        from qkv.kernels._torch_sdpa import cpu_forward_only, rows_alive

        if not (cpu_forward_only(out) and rows_alive(out)):
            sums = (out.sum(), q4.sum(), k4.sum())
            if not bool(torch.isfinite(torch.stack(sums)).all()):
                return _run_tiled(call)
    return three(out, call.lead), None


def structured(call: Call) -> bool:
    """A qkv Mask rule or a score modifier: what compiled FlexAttention is for."""
    options = call.options
    return isinstance(options.mask, Mask) or options.score_mod is not None


def _why_flex(call: Call) -> str:
    if not on_cuda(call):
        return (
            "a mask rule or score modifier called again with this shape: compiled "
            "FlexAttention's forward (compiled once), the tiled kernel's backward"
        )
    if structured(call):
        return (
            "a mask rule or score modifier on CUDA: compiled FlexAttention skips the empty blocks"
        )
    return "compiled FlexAttention on CUDA runs this call"


def _why_tiled(call: Call) -> str:
    mask = call.options.mask
    if isinstance(mask, Mask) and mask.knows_blocks:
        return "structured mask: empty blocks are skipped, no (Lq, Lk) array"
    return "runs in O(L) memory, evaluating masks block by block"


# -- what the reports add -----------------------------------------------------------------


def half_name(call: Call) -> str | None:
    """ "float16" or "bfloat16" for half-precision inputs, else None."""
    name = str(call.query.dtype).removeprefix("torch.")
    return name if name in ("float16", "bfloat16") else None


def _wider() -> str:
    """The backends that compute half inputs in a wider dtype, for a note: "backend='…' or
    '…' compute in float32"."""
    kept = [(n, b.half_in) for n, b in BACKENDS.items() if b.half_in is not None]
    names = [repr(n) for n, _ in kept]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    dtypes = sorted({str(d) for _, d in kept})
    return f"backend={listed} compute in {' or '.join(dtypes)}"


def _sdpa_choice(call: Call) -> Any:
    """The kernel torch's SDPA runs for the call on CUDA (:mod:`qkv.kernels._sdpa_choice`),
    given what qkv's sdpa adapter would pass torch."""
    from qkv.kernels._sdpa_choice import sdpa_kernel_choice, torch_mask_stand_in

    options = call.options
    q4, k4, v4 = (four(x, call.lead) for x in (call.query, call.key, call.value))
    attn_mask, is_causal = torch_mask_stand_in(
        q4,
        k4,
        mask=four_mask(options.mask, call),
        bias=four_mask(options.bias, call),
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


def _sdpa_notes(call: Call) -> Notes:
    notes, kernel = [], None
    if on_cuda(call):
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
            f"rounds the weights to {half}); {_wider()}"
        )
    return Notes(tuple(notes), kernel)


def _flex_notes(call: Call) -> Notes:
    """What a flex run does besides the kernel: the block mask, compilation, half inputs."""
    from qkv.kernels._flex_masks import block_size_for

    options = call.options
    block = block_size_for(call.query.device)
    notes = []
    rule = options.rule
    if rule is not None:
        how = (
            "from the rule's block structure"
            if rule.knows_blocks
            else "every block partial (the rule has no block hint)"
        )
        notes.append(
            f"flex: block mask of {block} × {block} blocks {how}, cached per "
            "(rule, B, H, Lq, Lk, device)"
        )
    if on_cuda(call):
        notes.append("flex: torch.compile compiles on the first call of each shape and rule")
    else:
        notes.extend(_cpu_compile_notes(call))
    if options.sinks is not None:
        notes.append("flex: sinks applied from its log-sum-exp, out · σ(lse − sink)")
    half = half_name(call)
    if half is not None:
        notes.append(
            f"{half}: given to compiled FlexAttention as {half} (scores and softmax in "
            f"float32, the weights rounded to {half} for the product with V)"
        )
    return Notes(tuple(notes))


def _cpu_compile_notes(call: Call) -> list[str]:
    """What the compiled CPU path does for this call, and its compile time (apart)."""
    from qkv.kernels._compiled_forward import COMPILED

    notes = [
        "flex on CPU: torch's compiled forward; a gradient or sinks come from the tiled "
        "kernel's backward, from the forward's log-sum-exp (read through one more key)"
    ]
    seconds = COMPILED.seconds.get(cpu_run_key(call))
    if seconds is None:
        notes.append(
            "flex: not compiled yet for this rule, shapes and dtype: the first call compiles "
            "(seconds; explain_dispatch compiles nothing)"
        )
    else:
        notes.append(
            f"flex: compiled for this rule, shapes and dtype by a first call of {seconds:.1f} s"
        )
    verdict = COMPILED.verdict.get(cpu_run_key(call))
    if verdict is not None:
        flex_ms, tiled_ms = (1e3 * t for t in verdict)
        notes.append(
            f"flex: a forward timed after compiling (the best of 2): {flex_ms:.1f} ms; the "
            f"tiled kernel's: {tiled_ms:.1f} ms (auto takes the faster)"
        )
    return notes


def _flex_checked(call: Call) -> bool:
    options = call.options
    return options.masked or options.score_mod is not None or options.sinks is not None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "reference",
            "the readable reference; forms every step",
            _reference_refusal,
            _run_reference,
            fast=False,
            records_steps=True,
            runs="NumPy and PyTorch",
        ),
        Backend(
            "sdpa",
            "torch's fused scaled_dot_product_attention",
            _sdpa_refusal,
            _run_sdpa,
            why=lambda call: "fused kernel; runs this call without a large dense mask",
            checks_output=sdpa_checked,
            half_in=None,
            plans=True,
            notes=_sdpa_notes,
            in_graph=_sdpa_in_graph,
        ),
        Backend(
            "flex",
            "torch's compiled FlexAttention",
            _flex_refusal,
            _run_flex,
            why=_why_flex,
            first=lambda call: on_cuda(call) and structured(call),
            checks_output=_flex_checked,
            compiles=True,
            half_in=None,
            runs="PyTorch, float32 and half on CPU",
            notes=_flex_notes,
        ),
        Backend(
            "tiled",
            "qkv's tiled O(L)-memory kernel",
            _tiled_refusal,
            _run_tiled,
            why=_why_tiled,
            in_graph=_tiled_in_graph,
        ),
    )
}
"""The registered backends: the names a call accepts, the rows of a dispatch report, and
the order auto tries the fast ones in (a backend whose ``first(call)`` holds goes first)."""


# -- memory --------------------------------------------------------------------------------


def available_memory(like: Array) -> int | None:
    """Free memory in bytes where ``like`` lives (None when unknown)."""
    if library(like) == "torch" and like.device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(like.device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _itemsize(call: Call) -> int:
    size = getattr(call.query, "itemsize", None)
    if size is None:
        size = call.query.element_size()
    return max(int(size), 4)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- layouts -------------------------------------------------------------------------------


def four(x: Any, lead: tuple[str, ...]) -> Any:
    """(…lead, L, D) → (B, H, L, D), as a view."""
    if lead == ():
        return x[None, None]
    if lead == ("batch",):
        return x[:, None]
    if lead == ("head",):
        return x[None]
    return x


def three(x: Any, lead: tuple[str, ...]) -> Any:
    """(B, H, L, D) → the caller's layout (the inverse of :func:`four`)."""
    if lead == ():
        return x[0, 0]
    if lead == ("batch",):
        return x[:, 0]
    if lead == ("head",):
        return x[0]
    return x


def four_mask(x: Any, call: Call) -> Any:
    """A mask or bias array broadcastable to (…lead, Lq, Lk) → to (B, H, Lq, Lk)."""
    if x is None or isinstance(x, Mask):
        return x
    ndim = len(call.lead) + 2
    x = x.reshape((1,) * (ndim - x.ndim) + tuple(x.shape))
    return four(x, call.lead)
