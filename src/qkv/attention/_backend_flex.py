"""The ``flex`` backend: torch's FlexAttention under ``torch.compile``, qkv's mask rules as
cached block masks and score modifiers as its score_mod (:mod:`qkv.kernels._flex_masks`).

On CUDA auto takes it first for a mask rule or a score modifier. On CPU, where torch has no
backward, it runs the compiled forward with the tiled kernel's backward
(:mod:`qkv.kernels._compiled_forward`); auto takes it there once a rule and shape have run a
few times (``on_auto`` counts them) and the compiled forward was measured the faster.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from qkv._array import Array
from qkv.attention._backend import Backend, Notes, common_refusal, four, four_mask, half_name, three
from qkv.attention._backend_tiled import run_tiled_call
from qkv.attention._options import Call

__all__ = ["FLEX", "cpu_run_key"]


_FLEX_CPU_DTYPES = ("float32", "float16", "bfloat16")


def _flex_refusal(call: Call, auto: bool) -> str | None:
    common = common_refusal(call, "compiled FlexAttention")
    if common is not None:
        return common
    options = call.options
    cuda = call.cuda
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
        if bias is not None and (call.grad or _sinks_need_grad(call)):
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
        if 0 in (*call.query.shape[:-1], call.key.shape[-2]):
            return "an empty call: nothing to compile"
        if bias is not None:
            return "a bias array: sdpa or the tiled kernel take it without a compiled closure"
        if not cuda:
            return _cpu_auto_refusal(call)
        if options.score_mod is not None and _grad_enabled() and _learnable(call):
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

    if not call.options.structured:
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
    probe = call.grad or options.sinks is not None
    last = _LAST_KEY.get("call")
    if last is not None and last[0]() is options and last[1] == (shapes, probe):
        return last[2]
    key = run_key(options.rule, options.score_mod, shapes, call.query.dtype, probe)
    _LAST_KEY["call"] = (weakref.ref(options), (shapes, probe), key)
    return key


_LAST_KEY: dict[str, tuple[weakref.ref[Any], Any, Any]] = {}


def _count(call: Call) -> None:
    """Count an auto call that the compiled CPU path could take (a mask rule or a score
    modifier on CPU tensors): auto compiles only for repeated ones."""
    if not call.torch or call.cuda or not call.options.structured:
        return
    from qkv.kernels._compiled_forward import COMPILED, auto_compile_enabled

    if auto_compile_enabled():
        COMPILED.count(cpu_run_key(call))


def _grad_enabled() -> bool:
    """Whether autograd records (``torch.is_grad_enabled()``)."""
    import torch

    return bool(torch.is_grad_enabled())


def _sinks_need_grad(call: Call) -> bool:
    sinks = call.options.sinks
    return _grad_enabled() and bool(getattr(sinks, "requires_grad", False))


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


def _run(call: Call) -> tuple[Array, Array | None]:
    if call.cuda:
        return _run_flex_eager_result(call)
    if call.grad or call.options.sinks is not None:
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
        run_tiled_call(call)
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

    result = run_tiled_call(call)
    COMPILED.fail(error)
    return result


def _run_flex_eager_result(call: Call) -> tuple[Array, Array | None]:
    """torch's compiled FlexAttention, forward only (on CUDA, autograd gives its backward)."""
    import torch

    from qkv.kernels._api import with_sinks
    from qkv.kernels._flex_masks import BLOCK_MASKS, run_flex

    options = call.options
    q4, k4, v4 = (four(x, call.lead) for x in (call.query, call.key, call.value))
    if not call.cuda:  # no gradient here: torch's CPU flex refuses tensors that want one
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
    bias = four_mask(options.bias, call.lead)
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
                return run_tiled_call(call)
    return three(out, call.lead), None


def _why(call: Call) -> str:
    if not call.cuda:
        return (
            "a mask rule or score modifier called again with this shape: compiled "
            "FlexAttention's forward (compiled once), the tiled kernel's backward"
        )
    if call.options.structured:
        return (
            "a mask rule or score modifier on CUDA: compiled FlexAttention skips the empty blocks"
        )
    return "compiled FlexAttention on CUDA runs this call"


def _notes(call: Call) -> Notes:
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
    if call.cuda:
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


def _checked(call: Call) -> bool:
    options = call.options
    return options.masked or options.score_mod is not None or options.sinks is not None


FLEX = Backend(
    "flex",
    "torch's compiled FlexAttention",
    _flex_refusal,
    _run,
    why=_why,
    first=lambda call: call.cuda and call.options.structured,
    on_auto=_count,
    checks_output=_checked,
    compiles=True,
    half_in=None,
    runs="PyTorch, float32 and half on CPU",
    notes=_notes,
)
