"""Calling an attention function on the probes of ``qkv check --function``, in this process.

:func:`run_probes` calls a function object on every probe; a student's ``FILE.py:NAME`` runs
it in a sandboxed process (:mod:`~qkv.check._function_file`). What comes back is one
:class:`Outcome` per probe; the diagnosis is :mod:`~qkv.check._function_diagnose`'s. The
student's exception texts reach messages through :func:`student_text` (escaped).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv._format import visible
from qkv.check._function_codes import slips_of
from qkv.check._probes import KINDS, MASK_MEANINGS, Probe, Spec, causal_allow, probes, probes_of

__all__ = [
    "ALIGNMENTS",
    "ARRAYS",
    "FunctionError",
    "Outcome",
    "raised",
    "run_module_probes",
    "run_probes",
    "student_text",
    "takes_mask",
    "validate",
]

Array = NDArray[np.float64]
ARRAYS: tuple[str, ...] = ("auto", "numpy", "torch")
"""The array library of the probes: ``auto`` tries NumPy, then torch tensors."""
ALIGNMENTS: tuple[str, ...] = ("top-left", "bottom-right")

# The judge's own references to the NumPy functions it compares with, bound when qkv is
# imported: a student's code that replaces np.allclose (say) in the process changes nothing.
_allclose = np.allclose
_isfinite = np.isfinite
_isposinf = np.isposinf
_asarray = np.asarray


class FunctionError(ValueError):
    """The function cannot be loaded or called: one line that says why (exit status 2)."""


@dataclass(frozen=True)
class Outcome:
    """What the function returned on one probe: its context and weights, or the error."""

    context: Array | None = None
    weights: Array | None = None
    error: str | None = None


def student_text(text: str, limit: int = 200) -> str:
    """Text the student's code chose (an exception's message or class name, its output) as
    one short line that cannot act on a terminal: whitespace runs become one space, control
    and bidirectional characters are written out (``\\x1b``), at most ``limit`` characters.

    Example:
        >>> print(student_text("bad\\n\\x1b]0;PWNED\\x07 value"))
        bad \\x1b]0;PWNED\\x07 value
    """
    one_line = " ".join(text.split())
    escaped = visible(one_line)
    return escaped if len(escaped) <= limit else escaped[: limit - 1] + "…"


def validate(kind: str, mask_means: str, array: str, alignment: str) -> None:
    for name, value, allowed in (
        ("kind", kind, KINDS),
        ("mask_means", mask_means, (*MASK_MEANINGS, "auto")),
        ("array", array, ARRAYS),
        ("alignment", alignment, ALIGNMENTS),
    ):
        if value not in allowed:
            raise ValueError(
                f"{name} must be one of {', '.join(allowed)}, got {value!r}. "
                f"Hint: {name}={allowed[0]!r}"
            )


def takes_mask(fn: Callable[..., Any], kind: str) -> bool:
    """Whether an ``attention`` function takes a fourth argument, the mask."""
    if kind != "attention":
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return len(positional) >= 4


def _arguments(probe: Probe, kind: str, with_mask: bool, mask_means: str) -> list[Any]:
    args: list[Any] = list(probe.arrays)
    if kind in ("multi-head", "gqa"):
        args.append(probe.num_heads)
        if kind == "gqa":
            args.append(probe.kv_heads)
    elif with_mask and probe.allow is not None:
        if mask_means == "allow":
            args.append(probe.allow.copy())
        elif mask_means == "allow01":
            args.append(probe.allow.astype(np.float64))
        elif mask_means == "ignore":
            args.append(~probe.allow)
        else:
            args.append(np.where(probe.allow, 0.0, -np.inf))
    return args


def _to_torch(args: list[Any]) -> list[Any]:
    from qkv._extras import require

    torch = require("torch", feature="qkv check --function with torch tensors")

    return [torch.from_numpy(np.array(a)) if isinstance(a, np.ndarray) else a for a in args]


def _as_array(value: Any, lead: bool = False) -> Array:
    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    out: Array = _asarray(value, dtype=np.float64)
    if out.ndim == 0:
        raise TypeError("a single number is not attention's output")
    if lead and out.ndim >= 3 and out.shape[:2] == (1, 1):
        out = out[0, 0]
    return out


def _call(fn: Callable[..., Any], args: list[Any], *, lead: bool = False) -> Outcome:
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            result = fn(*args)
    except Exception as exc:  # the student's code may raise anything: it is a finding
        return Outcome(error=raised(exc))
    try:
        if isinstance(result, (tuple, list)) and len(result) == 2:
            return Outcome(_as_array(result[0], lead), _as_array(result[1], lead))
        return Outcome(_as_array(result, lead))
    except (TypeError, ValueError):
        kind = student_text(type(result).__name__, 60)
        return Outcome(error=f"returned {kind}, not an array of numbers")


def raised(exc: BaseException) -> str:
    """``"TypeError: the message"`` for the student's exception, escaped and shortened."""
    try:
        text = str(exc)
    except Exception:  # a __str__ of the student's own that raises
        text = ""
    name = student_text(type(exc).__name__, 60)
    return f"{name}: {student_text(text)}" if text.strip() else name


def run_probes(
    fn: Callable[..., Any],
    kind: str,
    *,
    mask_means: str = "allow",
    array: str = "auto",
    batched: bool = False,
    num_kv_heads: int | None = None,
) -> tuple[str, list[Outcome]]:
    """Call ``fn`` on every probe of ``kind``: the array library used and the outcomes
    (``num_kv_heads``: multi-head probes with that many key/value heads).

    The probes are (L, d) arrays. A function that only takes batched (B, H, L, d) inputs is
    probed with B = H = 1 (two leading axes added, removed from what it returns): then the
    library is reported as ``"numpy (1, 1, L, d)"`` (or torch).

    Raises:
        FunctionError: the function fails on the first probe, with NumPy arrays and with
            torch tensors, as (L, d) and as (1, 1, L, d).
    """
    with_mask = takes_mask(fn, kind)
    all_probes = probes(kind, with_mask=with_mask, batched=batched, num_kv_heads=num_kv_heads)
    if mask_means == "auto":
        mask_means = _function_convention(fn, all_probes) if with_mask else "allow"
    first = _arguments(all_probes[0], kind, with_mask, mask_means)
    libraries = (
        ["torch"] if array == "torch" else ["numpy", "torch"] if array == "auto" else ["numpy"]
    )
    tries: list[tuple[str, bool, Outcome]] = []
    for lead in (False, True) if kind not in ("multi-head", "gqa") else (False,):
        for library in libraries:
            args = _leading(first) if lead else first
            try:
                got = _call(fn, _to_torch(args) if library == "torch" else args, lead=lead)
            except ImportError:  # qkv._extras.MissingExtraError: no torch to try
                continue
            tries.append((library, lead, got))
            if got.error is None:
                break
        if tries and tries[-1][2].error is None:
            break
    if not tries:  # torch asked for and not installed: its one-line error
        _to_torch(first)
    used, lead, outcome = tries[0] if tries[-1][2].error is not None else tries[-1]
    square = next((i for i, p in enumerate(all_probes) if p.name == _SQUARE_NAME), None)
    if outcome.error is not None and square is not None:
        # Q·K without the transpose fails on every probe but the one with Lk = d_k: the
        # first library (and axes) that runs there goes on, so that the diagnosis names it
        args = _arguments(all_probes[square], kind, with_mask, mask_means)
        for library, ld, failed in tries:
            given = _leading(args) if ld else args
            if _call(fn, _to_torch(given) if library == "torch" else given, lead=ld).error is None:
                return _finish(fn, all_probes, kind, with_mask, mask_means, library, ld, failed)
    if outcome.error is not None:
        others = "; ".join(
            f"{'(1, 1, L, d) ' if ld else ''}{lib}: {o.error}" for lib, ld, o in tries[1:]
        )
        raise FunctionError(
            f"on the first probe the function {_verb(outcome.error)}"
            + (f" (also tried {others})" if others else "")
            + f". Hint: kind {kind} expects {_SIGNATURES[kind]}"
        )
    return _finish(fn, all_probes, kind, with_mask, mask_means, used, lead, outcome)


def _finish(
    fn: Callable[..., Any],
    all_probes: tuple[Probe, ...],
    kind: str,
    with_mask: bool,
    mask_means: str,
    used: str,
    lead: bool,
    outcome: Outcome,
) -> tuple[str, list[Outcome]]:
    """Every probe after the first, with the library (and leading axes) the first took."""
    outcomes = [outcome]
    for probe in all_probes[1:]:
        args = _arguments(probe, kind, with_mask, mask_means)
        add = lead and probe.role != "batched"
        args = _leading(args) if add else args
        outcomes.append(_call(fn, _to_torch(args) if used == "torch" else args, lead=add))
    return (f"{used} (1, 1, L, d)" if lead else used), outcomes


_SQUARE_NAME = "Lq=Lk=d_k=16"

# How a mask can be given to an attention class: what it holds, then its shape
_FORMS: tuple[tuple[str, str, Callable[[NDArray[np.bool_]], Any]], ...] = (
    ("allow", "bool, True = may attend", lambda a: a.copy()),
    ("ignore", "bool, True = masked", lambda a: ~a),
    ("allow", "0/1, 1 = may attend", lambda a: a.astype(np.float64)),
    ("additive", "0 or −inf, added to the scores", lambda a: np.where(a, 0.0, -np.inf)),
)
_SHAPES: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("(Lq, Lk)", lambda m: m),
    ("(1, Lq, Lk)", lambda m: m[None]),
    ("(1, 1, Lq, Lk)", lambda m: m[None, None]),
)
_CONVENTION_BLIND = ("mask-ignored", "mask-not-applied", "mask-inverted")


def _module_allow(spec: Spec, probe: Probe) -> NDArray[np.bool_] | None:
    """The mask an attention class gets on a probe (True = may attend): the causal rule for
    a causal class that takes a mask, the probe's own mask otherwise (None: no mask)."""
    if not spec.with_mask:
        return None
    if spec.causal:
        lq = probe.arrays[0].shape[0]
        lk = lq if probe.memory is None else probe.memory.shape[0]
        return causal_allow(lq, lk, spec.alignment)
    return probe.allow


def _module_call(
    fn: Callable[..., Any], spec: Spec, probe: Probe, form: int, shape: int, always: bool = False
) -> Outcome:
    """``always``: a probe without a mask gets one that masks nothing (a forward that needs
    its mask)."""
    x, w_q, w_k, w_v, w_o = probe.arrays
    allow = _module_allow(spec, probe)
    if allow is None and always:
        lk = x.shape[0] if probe.memory is None else probe.memory.shape[0]
        allow = np.ones((x.shape[0], lk), dtype=bool)
    mask = None if allow is None else _SHAPES[shape][1](_FORMS[form][2](allow))
    kv_heads = probe.kv_heads if spec.kind == "gqa" else None
    heads = 1 if spec.kind == "head" else probe.num_heads
    return _call(fn, [x, w_q, w_k, w_v, w_o, heads, kv_heads, probe.memory, mask])


def _close(got: Outcome, want: tuple[Any, Any] | None) -> bool:
    if want is None or got.context is None or got.context.shape != want[0].shape:
        return False
    finite = _isfinite(want[0])
    spoilt = _isposinf(want[0])  # a slip's NaN rows (+inf filled): not numbers there either
    if _isfinite(got.context[spoilt]).any() or not _isfinite(got.context[finite]).all():
        return False
    return bool(_allclose(got.context[finite], want[0][finite], rtol=1e-4, atol=1e-6))


def _convention(
    fn: Callable[..., Any], spec: Spec, all_probes: tuple[Probe, ...], mask_means: str | None
) -> tuple[int, int]:
    """The mask convention an attention class reads, by probing: on the first masked probe,
    the first form and shape that gives attention's numbers, else one that gives a known
    slip that depends on the convention, else the first that runs."""
    masked = [p for p in all_probes if p.role == "main" and _module_allow(spec, p) is not None]
    masked = [p for p in masked if not _module_allow(spec, p).all()] or masked  # type: ignore[union-attr]
    if not masked:
        return 0, 0
    probe = masked[0]
    tried = slips_of(spec)
    wants = [(t.code, _slip_or_none(t.slip, probe)) for t in tried]
    best: tuple[int, int, int] | None = None
    for form, (means, _, _) in enumerate(_FORMS):
        if mask_means is not None and means != mask_means:
            continue
        for shape in range(len(_SHAPES)):
            got = _module_call(fn, spec, probe, form, shape)
            if _close(got, wants[0][1]):
                return form, shape
            if any(code not in _CONVENTION_BLIND and _close(got, want) for code, want in wants[1:]):
                score = 1
            elif got.error is None and got.context is not None:
                score = 2
            else:
                score = 3
            if best is None or score < best[0]:
                best = (score, form, shape)
    assert best is not None
    return best[1], best[2]


_FUNCTION_FORMS = ("allow", "ignore", "allow01", "additive")


def _function_convention(fn: Callable[..., Any], all_probes: tuple[Probe, ...]) -> str:
    """The mask convention of ``NAME(Q, K, V, mask)``, by probing (``mask_means="auto"``):
    on the probe with masked keys, the first form (bool True = may attend, bool True =
    masked, 0/1, additive) under which it computes attention, else one under which it makes
    a known slip that depends on the convention, else the first that runs."""
    probe = next(p for p in all_probes if p.allow is not None and not p.allow.all())
    tried = slips_of(Spec("attention", with_mask=True))
    wants = [(t.code, _slip_or_none(t.slip, probe)) for t in tried]
    best: tuple[int, str] | None = None
    for means in _FUNCTION_FORMS:
        args = _arguments(probe, "attention", True, means)
        got = _call(fn, args)
        if got.error is not None:
            with contextlib.suppress(ImportError):  # no torch to try
                got = _call(fn, _to_torch(args))
        if _close(got, wants[0][1]):
            return means
        if any(code not in _CONVENTION_BLIND and _close(got, want) for code, want in wants[1:]):
            score = 1
        else:
            score = 2 if got.error is None and got.context is not None else 3
        if best is None or score < best[0]:
            best = (score, means)
    assert best is not None
    return best[1]


def _slip_or_none(slip: Callable[[Probe], tuple[Any, Any]], probe: Probe) -> tuple[Any, Any] | None:
    try:
        return slip(probe)
    except ValueError:
        return None


def run_module_probes(
    fn: Callable[..., Any], spec: Spec, *, mask_means: str | None = None
) -> tuple[str, list[Outcome]]:
    """Call an attention class driven as a function (``fn`` of
    :func:`~qkv.check._module_adapt.adapt_class`: ``fn(X, W_q, W_k, W_v, W_o, num_heads,
    num_kv_heads, X_kv, mask)``, all positional, NumPy arrays and numbers) on every probe of
    ``spec``: how the mask was given (``""`` without one) and the outcomes.

    A class that takes a mask is given it in the first convention (what it holds, then its
    shape) under which it computes attention, or else a known slip (``mask_means``: only
    forms that mean that).

    Raises:
        FunctionError: the class raises on every probe.
    """
    all_probes = probes_of(spec)
    form, shape = (0, 0)
    if spec.with_mask:
        form, shape = _convention(fn, spec, all_probes, mask_means)
    outcomes = [_module_call(fn, spec, p, form, shape) for p in all_probes]
    needs = spec.with_mask and outcomes[0].error is not None
    if needs and _module_call(fn, spec, all_probes[0], form, shape, True).error is None:
        outcomes = [_module_call(fn, spec, p, form, shape, True) for p in all_probes]
    if all(o.error is not None for o in outcomes):
        raise FunctionError(f"forward raised {outcomes[0].error}")
    how = f"mask {_FORMS[form][1]}, {_SHAPES[shape][0]}" if spec.with_mask else ""
    return how, outcomes


def _leading(args: list[Any]) -> list[Any]:
    """Q, K and V with two leading axes of 1 (the mask, if any, broadcasts as it is)."""
    return [a[None, None] if isinstance(a, np.ndarray) and i < 3 else a for i, a in enumerate(args)]


def _verb(error: str) -> str:
    return error if error.startswith("returned ") else f"raised {error}"


_SIGNATURES = {
    "attention": "NAME(Q, K, V) or NAME(Q, K, V, mask) returning the context or (context, weights)",
    "causal": "NAME(Q, K, V), causal attention, returning the context or (context, weights)",
    "multi-head": "NAME(X, W_q, W_k, W_v, W_o, num_heads) returning the output or "
    "(output, weights)",
    "gqa": "NAME(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads) returning the output or "
    "(output, weights)",
}
