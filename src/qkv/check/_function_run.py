"""Calling an attention function on the probes of ``qkv check --function``, in this process.

:func:`run_probes` calls a function object on every probe; a student's ``FILE.py:NAME`` runs
it in a sandboxed process (:mod:`~qkv.check._function_file`). What comes back is one
:class:`Outcome` per probe; the diagnosis is :mod:`~qkv.check._function_diagnose`'s. The
student's exception texts reach messages through :func:`student_text` (escaped).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv._format import visible
from qkv.check._probes import KINDS, MASK_MEANINGS, Probe, probes

__all__ = [
    "ALIGNMENTS",
    "ARRAYS",
    "FunctionError",
    "Outcome",
    "raised",
    "run_probes",
    "student_text",
    "takes_mask",
    "validate",
]

Array = NDArray[np.float64]
ARRAYS: tuple[str, ...] = ("auto", "numpy", "torch")
"""The array library of the probes: ``auto`` tries NumPy, then torch tensors."""
ALIGNMENTS: tuple[str, ...] = ("top-left", "bottom-right")


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
        ("mask_means", mask_means, MASK_MEANINGS),
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
    if kind == "multi-head":
        args.append(probe.num_heads)
    elif with_mask and probe.allow is not None:
        if mask_means == "allow":
            args.append(probe.allow.copy())
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
    out: Array = np.asarray(value, dtype=np.float64)
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
) -> tuple[str, list[Outcome]]:
    """Call ``fn`` on every probe of ``kind``: the array library used and the outcomes.

    The probes are (L, d) arrays. A function that only takes batched (B, H, L, d) inputs is
    probed with B = H = 1 (two leading axes added, removed from what it returns): then the
    library is reported as ``"numpy (1, 1, L, d)"`` (or torch).

    Raises:
        FunctionError: the function fails on the first probe, with NumPy arrays and with
            torch tensors, as (L, d) and as (1, 1, L, d).
    """
    with_mask = takes_mask(fn, kind)
    all_probes = probes(kind, with_mask=with_mask, batched=batched)
    first = _arguments(all_probes[0], kind, with_mask, mask_means)
    libraries = (
        ["torch"] if array == "torch" else ["numpy", "torch"] if array == "auto" else ["numpy"]
    )
    tries: list[tuple[str, bool, Outcome]] = []
    for lead in (False, True) if kind != "multi-head" else (False,):
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
    if outcome.error is not None:
        others = "; ".join(
            f"{'(1, 1, L, d) ' if ld else ''}{lib}: {o.error}" for lib, ld, o in tries[1:]
        )
        raise FunctionError(
            f"on the first probe the function {_verb(outcome.error)}"
            + (f" (also tried {others})" if others else "")
            + f". Hint: kind {kind} expects {_SIGNATURES[kind]}"
        )
    outcomes = [outcome]
    for probe in all_probes[1:]:
        args = _arguments(probe, kind, with_mask, mask_means)
        add = lead and probe.role != "batched"
        args = _leading(args) if add else args
        outcomes.append(_call(fn, _to_torch(args) if used == "torch" else args, lead=add))
    return (f"{used} (1, 1, L, d)" if lead else used), outcomes


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
}
