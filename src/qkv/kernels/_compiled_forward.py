"""Compiled FlexAttention's forward on CPU, trained with the tiled kernel's backward.

torch compiles FlexAttention's forward on CPU but gives no log-sum-exp there (and no
backward); the tiled backward needs each row's log-sum-exp ``lse``. It is recovered from one
more key, the *probe*: key Lk with a fixed score ``c`` (:data:`PROBE_SCORE`) and a value that
is 1 in one extra column and 0 elsewhere. With Z_i = Σ_j exp(S'_ij) the row's sum, that
column of the output is o_i = e^c / (Z_i + e^c), so

    lse_i = log Z_i = c + log(1 − o_i) − log(o_i)      out_i = out'_i / (1 − o_i)

where out' is the output over the Dv real columns. A row where o_i is too close to 0 or 1
for float32 to resolve (lse outside about (−17, 59), or no allowed key), or a non-finite
output (a NaN of a masked-out key), sends the call to the tiled forward instead. The probe
costs one more key block, of one key, per query block.

:data:`COMPILED` records what was compiled (per rule, score modifier, shapes and dtype), how
long each first call took, how often ``auto`` saw each, and whether compiling failed.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

from qkv.kernels._api import captured_tensors, prepare, with_sinks
from qkv.kernels._blockwise import Problem
from qkv.kernels._flex_masks import (
    BLOCK_MASKS,
    CACHE_SIZE,
    block_mask_of_kinds,
    block_size_for,
    compiled_flex,
    fingerprint,
    torch_mask_mod,
)
from qkv.kernels._forward import attention_forward
from qkv.kernels._tiled import _TiledAttention
from qkv.masks import EMPTY, FULL, PARTIAL, Mask, ScoreMod

__all__ = [
    "AUTO_COMPILE_VARIABLE",
    "COMPILED",
    "PROBE_SCORE",
    "REPEATS",
    "VERDICT_SAMPLES",
    "CompiledRuns",
    "auto_compile_enabled",
    "compiled_attention",
    "compiler_missing",
    "forward_with_lse",
]

_Result = TypeVar("_Result")

PROBE_SCORE = -10.0
"""The probe key's score c: o = e^c / (Z + e^c) stays a normal float32 for lse up to about
59, and 1 − o keeps three digits for lse down to about −17."""

_LOW, _HIGH = 1e-30, 1.0 - 1e-3  # o outside: float32 cannot resolve the row's lse

REPEATS = 3
"""``auto`` takes the compiled path on CPU from the REPEATS-th call with the same rule, score
modifier, shapes and dtype (a model's layers and steps), never for a single call."""

VERDICT_SAMPLES = 2
"""How many calls after the compiling one are timed against the tiled kernel before auto
decides between them for a rule and shape."""

AUTO_COMPILE_VARIABLE = "QKV_AUTO_COMPILE"
"""Set to ``0`` to keep ``auto`` off the compiled path on CPU (the test suite does, but for
the tests of this path)."""


def auto_compile_enabled() -> bool:
    """Whether ``auto`` may compile on CPU (:data:`AUTO_COMPILE_VARIABLE` is not ``0``)."""
    return os.environ.get(AUTO_COMPILE_VARIABLE, "1").strip() != "0"


@functools.cache
def _compiler() -> str | None:
    """The C++ compiler torch's inductor would call (``CXX``, else g++, c++ or clang++), if
    it is on this machine: looked up on the PATH, without importing the compiler's stack."""
    import shutil

    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def compiler_missing() -> str | None:
    """Why torch cannot compile on this CPU (no C++ compiler), or None."""
    if _compiler() is None:
        return "no C++ compiler for torch.compile (install g++ or clang++)"
    return None


class CompiledRuns:
    """What the compiled CPU path has done in this process (safe across threads).

    ``seconds[key]``: how long the first call of ``key`` took (its compilation, mostly);
    ``verdict[key]``: (compiled, tiled) seconds of a forward each, the best of the
    :data:`VERDICT_SAMPLES` calls after the compiling one, each timed beside one tiled
    forward (auto keeps off a key where the compiled one was slower); ``calls[key]``: how often
    ``auto`` was asked to run ``key``; ``failure``: why compiling failed (then auto stays on
    the tiled kernel, and said so once, as a warning).
    """

    def __init__(self) -> None:
        self.seconds: dict[Hashable, float] = {}
        self.verdict: dict[Hashable, tuple[float, float]] = {}
        self._samples: dict[Hashable, list[tuple[float, float]]] = {}
        self.calls: Counter[Hashable] = Counter()
        self.failure: str | None = None
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget everything (torch keeps its compiled kernels)."""
        with self._lock:
            self.seconds.clear()
            self.verdict.clear()
            self._samples.clear()
            self.calls.clear()
            self.failure = None

    def sample(self, key: Hashable, compiled: float, tiled: float) -> None:
        """One more (compiled, tiled) timing of a forward of ``key``; the verdict is the
        best of each once :data:`VERDICT_SAMPLES` are in (a single timing right after
        compiling is often slow: caches, page faults)."""
        with self._lock:
            samples = self._samples.setdefault(key, [])
            samples.append((compiled, tiled))
            if len(samples) >= VERDICT_SAMPLES:
                self.verdict[key] = (min(c for c, _ in samples), min(t for _, t in samples))
                del self._samples[key]

    def count(self, key: Hashable) -> int:
        """One more auto call of ``key``; returns how many there have been."""
        with self._lock:
            self.calls[key] += 1
            return self.calls[key]

    def fail(self, error: BaseException) -> None:
        """Compiling failed: record why, and warn (once per process)."""
        with self._lock:
            first = self.failure is None
            self.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if first:
            warnings.warn(
                f"qkv: torch.compile of FlexAttention failed on CPU ({self.failure}); "
                "the tiled kernel runs these calls instead.",
                RuntimeWarning,
                stacklevel=4,
            )


COMPILED = CompiledRuns()
"""The record of the compiled CPU path in this process."""


def run_key(
    rule: Mask | None,
    score_mod: ScoreMod | None,
    shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype,
    probe: bool,
) -> Hashable:
    """The key a compiled kernel is cached and counted under: (rule, score modifier, shapes,
    dtype, and whether the probe key is added: a gradient or sinks), rules by
    :func:`fingerprint` (equal rules made anew at each step share it; a rule object met
    again is not hashed again)."""
    return (_fingerprint_of(rule), _fingerprint_of(score_mod), shapes, str(dtype), probe)


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, Hashable] = weakref.WeakKeyDictionary()


def _fingerprint_of(rule: Mask | ScoreMod | None) -> Hashable:
    """:func:`fingerprint` of a rule, kept while the rule object lives (its tables do not
    change: a rule reused at every step is hashed once)."""
    if rule is None:
        return None
    found = _FINGERPRINTS.get(rule)
    if found is None:
        found = fingerprint(rule)
        _FINGERPRINTS[rule] = found
    return found


# -- the probe's block mask and score_mod ---------------------------------------------------


class _ProbeMasks:
    """Block masks and score_mods with the probe key, one per rule and shape (LRU): the same
    function objects again, so torch.compile reuses its kernel."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
        made = make()
        with self._lock:
            self._items[key] = made
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return made


_PROBES = _ProbeMasks()


def _probe_block_mask(
    rule: Mask | None, batch: int, heads: int, q_len: int, kv_len: int, block: int
) -> Any:
    """The rule's BlockMask of ``block``-blocks over Lk + 1 keys, the last (the probe)
    allowed for every query."""
    if rule is None:
        kinds = torch.full((1, 1, -(-q_len // block), -(-kv_len // block)), FULL)
    else:
        kinds = torch.tensor(rule.blocks(q_len, kv_len, block, block, batch=batch, heads=heads))
    if kv_len % block == 0:  # the probe opens a block of its own: allowed, nothing to mask
        kinds = torch.cat([kinds, torch.full((*kinds.shape[:-1], 1), FULL)], dim=-1)
    else:  # the probe joins the last block, which must then be visited
        last = kinds[..., -1]
        kinds[..., -1] = torch.where(last == EMPTY, torch.full_like(last, PARTIAL), last)
    inner = None if rule is None else torch_mask_mod(rule, q_len, kv_len)
    top = kv_len - 1

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        probe = kv_idx == kv_len
        if inner is None:
            return probe | (kv_idx < kv_len)
        return probe | inner(b, h, q_idx, torch.clamp(kv_idx, max=top))

    return block_mask_of_kinds(kinds, mask_mod, q_len, kv_len + 1, block=block)


def _probe_score_mod(inner: Callable[..., Any] | None, kv_len: int) -> Callable[..., Any]:
    """``inner`` (or no modifier) on the real keys, :data:`PROBE_SCORE` on the probe."""
    top = kv_len - 1

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        real = score if inner is None else inner(score, b, h, q_idx, torch.clamp(kv_idx, max=top))
        return torch.where(kv_idx == kv_len, torch.full_like(real, PROBE_SCORE), real)

    return score_mod


# -- the forward with its log-sum-exp -------------------------------------------------------


def forward_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rule: Mask | None,
    score_mod: ScoreMod | None,
    scale: float,
    engine: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) of attention on (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) by one call
    of FlexAttention with the probe key; None when a row's lse is out of float32's reach.

    ``engine``: the FlexAttention to call (default: torch's, compiled for static shapes;
    ``qkv.flex_attention``, the tiled kernel, runs the same path in float64).
    """
    batch, heads, q_len, d_k = (int(n) for n in q.shape)
    kv_heads, kv_len, d_v = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    rule_key = fingerprint(rule)
    block = block_size_for(q.device)
    block_mask = _PROBES.get(
        ("mask", rule_key, batch, heads, q_len, kv_len, block),
        lambda: _probe_block_mask(rule, batch, heads, q_len, kv_len, block),
    )
    inner = BLOCK_MASKS.score_mod(score_mod, q_len, kv_len, None, device=q.device, dtype=q.dtype)
    modifier = _PROBES.get(
        ("score", id(inner), fingerprint(score_mod), q_len, kv_len, str(q.dtype)),
        lambda: _probe_score_mod(inner, kv_len),
    )
    key = torch.cat([k, k.new_zeros(batch, kv_heads, 1, d_k)], dim=2)  # (B, Hkv, Lk + 1, D)
    value = v.new_zeros(batch, kv_heads, kv_len + 1, d_v + 1)  # (B, Hkv, Lk + 1, Dv + 1)
    value[:, :, :kv_len, :d_v] = v
    value[:, :, kv_len, d_v] = 1.0
    flex = compiled_flex(static=True) if engine is None else engine
    both = flex(
        q.detach(),  # torch's CPU FlexAttention refuses a query that requires grad
        key,
        value,
        score_mod=modifier,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )  # (B, H, Lq, Dv + 1)
    probe = both[..., d_v]  # (B, H, Lq): e^c / (Z + e^c)
    # One look at the values: a NaN or ±inf of a masked-out key reaches FlexAttention's
    # output (its zero weight times the value); the tiled forward keeps it out.
    if not bool(((probe > _LOW) & (probe < _HIGH)).all() & torch.isfinite(both.sum())):
        return None
    rest = 1.0 - probe
    lse = PROBE_SCORE + torch.log(rest) - torch.log(probe)
    out = both[..., :d_v] / rest[..., None]
    return out, lse


class _CompiledForward(_TiledAttention):
    """The tiled kernel's autograd function with compiled FlexAttention's forward: the
    backward (inherited) recomputes each block's weights from the output and lse."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        work: tuple[Problem, Callable[[], tuple[torch.Tensor, torch.Tensor] | None]],
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        problem, run = work
        result = run()
        if result is None:  # a row beyond float32's reach: the tiled forward
            out, lse, shift, inverse = attention_forward(q, k, v, bias, problem)
        else:  # the backward's weights exp(s − m) · (1/l) with m = lse (in the scores' units)
            out, lse = result
            shift, inverse = lse * problem.units, torch.ones_like(lse)
        ctx.save_for_backward(q, k, v, bias, out, shift, inverse)
        ctx.problem = problem
        ctx.captured = captured
        ctx.set_materialize_grads(False)
        return out, lse


def compiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rule: Mask | None,
    score_mod: ScoreMod | None,
    scale: float,
    sinks: torch.Tensor | None = None,
    engine: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention with compiled FlexAttention's forward and the tiled kernel's backward.

    Checked 4-D inputs (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) on CPU; half
    precision is computed in float32 (the lse needs it). Gradients reach query, key, value,
    ``sinks`` and the tensors ``score_mod`` captures, as with the tiled kernel.

    Returns:
        The context (B, H, Lq, Dv), in the dtype of query.
    """
    q, k, v, _, problem = prepare(
        query,
        key,
        value,
        rule=rule,
        dense_mask=None,
        bias=None,
        score_mod=score_mod,
        scale=scale,
        dropout_p=0.0,
        seed=None,
    )

    def run() -> tuple[torch.Tensor, torch.Tensor] | None:
        return forward_with_lse(q, k, v, rule=rule, score_mod=score_mod, scale=scale, engine=engine)

    captured: tuple[torch.Tensor, ...] = ()
    if score_mod is not None and torch.is_grad_enabled():
        captured = captured_tensors(score_mod, query, exclude=(query, key, value, sinks))
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *captured))
    if wants_grad:
        out, lse = _CompiledForward.apply(q, k, v, None, (problem, run), *captured)  # type: ignore[no-untyped-call]
    else:
        with torch.no_grad():
            result = run()
            if result is None:
                found, part, _, _ = attention_forward(q, k, v, None, problem)
                result = found, part
            out, lse = result
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks.to(q.dtype))
    converted: torch.Tensor = out.to(query.dtype)
    return converted


def timed(key: Hashable, thunk: Callable[[], _Result]) -> _Result:
    """Run ``thunk``; the first time for ``key``, record how long it took (its compile)."""
    if key in COMPILED.seconds:
        return thunk()
    start = time.perf_counter()
    result = thunk()
    COMPILED.seconds[key] = time.perf_counter() - start
    return result
