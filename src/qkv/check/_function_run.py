"""Calling an attention function on the probes of ``qkv check --function``.

In this process (:func:`run_probes`, for a function object) or, for a student's
``FILE.py:NAME``, in a separate Python process with a time limit (:func:`run_file`): loading
a file runs its code, so an infinite loop or a crash becomes a one-line
:class:`FunctionError`, not a hang. What comes back is one :class:`Outcome` per probe; the
diagnosis is :mod:`~qkv.check._function_diagnose`'s.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv.check._probes import KINDS, MASK_MEANINGS, Probe, probes
from qkv.check._student_file import StudentFileError, run_student_file

__all__ = [
    "ALIGNMENTS",
    "ARRAYS",
    "FileRun",
    "FunctionError",
    "Outcome",
    "load_function",
    "run_file",
    "run_probes",
    "split_target",
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
    if kind in ("multi-head", "gqa"):
        args.append(probe.num_heads)
        if kind == "gqa":
            args.append(probe.kv_heads)
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
        text = " ".join(str(exc).split())[:200]
        return Outcome(error=f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    try:
        if isinstance(result, (tuple, list)) and len(result) == 2:
            return Outcome(_as_array(result[0], lead), _as_array(result[1], lead))
        return Outcome(_as_array(result, lead))
    except (TypeError, ValueError):
        return Outcome(error=f"returned {type(result).__name__}, not an array of numbers")


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
    "gqa": "NAME(X, W_q, W_k, W_v, W_o, num_heads, num_kv_heads) returning the output or "
    "(output, weights)",
}


# ---------------------------------------------------------------- a student's file


def split_target(target: str) -> tuple[Path, str]:
    """``FILE.py:NAME`` as (path, name).

    Raises:
        FunctionError: no ``:NAME``, or no such file.
    """
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise FunctionError(
            f"--function must be FILE.py:NAME, got {target!r}. Hint: "
            "'qkv check --function student.py:attention --kind attention'"
        )
    if not Path(path).is_file():
        raise FunctionError(f"--function: no such file {path!r}. Hint: check the path")
    return Path(path), name


def load_function(path: Path, name: str) -> tuple[Callable[..., Any], str | None]:
    """Run ``path`` (this runs its code) and return its function (or class) ``name``, with the
    file's own errors as one line, or None (:func:`~qkv.check._student_file.run_student_file`:
    a top-level statement that fails is noted and the next one runs, as in a notebook
    exported to a file).

    Raises:
        FunctionError: the file cannot be run, or has no callable ``name``.
    """
    try:
        module, file_error = run_student_file(path)
    except StudentFileError as exc:
        raise FunctionError(str(exc)) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        ran = f"; running it: {file_error}" if file_error else ""
        raise FunctionError(
            f"{path}: no function named {name!r}{ran}. Hint: give FILE.py:NAME with the name of "
            f"the function after the colon, and run 'python {path}' to see the file's errors"
        )
    return fn, file_error


@dataclass(frozen=True)
class FileRun:
    """What the separate process found: where, what it probed, and the outcomes.

    Attributes:
        path: the file. name: the function or class in it.
        array: the array library of the probes (as :func:`run_probes` says it).
        with_mask: whether the function takes a mask.
        outcomes: one per probe.
        kind: the kind probed (a class is probed as ``multi-head`` or ``gqa``).
        causal: a class: whether it is checked as causal attention.
        about: a class: how it was driven (its forward and projections).
        file_error: the file's own errors, as one line, or None.
    """

    path: Path
    name: str
    array: str
    with_mask: bool
    outcomes: list[Outcome]
    kind: str
    causal: bool = False
    about: str = ""
    file_error: str | None = None


def _child_main() -> None:
    """The separate process: load the file, call the function (or drive the class, when
    ``adapt`` names one) on the probes, write JSON."""
    path, name, kind, mask_means, array, batched, kv_heads, adapt, out = sys.argv[1:10]
    try:
        fn, file_error = load_function(Path(path), name)
        extra: dict[str, Any] = {"kind": kind, "file_error": file_error}
        if adapt:
            from qkv.check._module_adapt import ModuleError, adapt_class

            causal = {"causal": True, "not-causal": False}.get(adapt.removeprefix("module-"))
            try:
                driven = adapt_class(fn, causal=causal)
            except ModuleError as exc:
                raise FunctionError(f"{path}:{name}: {exc}") from None
            fn, kind = driven.fn, driven.kind
            extra.update(kind=kind, causal=driven.causal, about=driven.about)
        used, outcomes = run_probes(
            fn,
            kind,
            mask_means=mask_means,
            array=array,
            batched=batched == "batched",
            num_kv_heads=int(kv_heads) or None,
        )
        data: dict[str, Any] = {
            "array": used,
            "with_mask": takes_mask(fn, kind),
            **extra,
            "outcomes": [
                {
                    "context": None if o.context is None else o.context.tolist(),
                    "weights": None if o.weights is None else o.weights.tolist(),
                    "error": o.error,
                }
                for o in outcomes
            ],
        }
    except FunctionError as exc:
        data = {"error": str(exc)}
    Path(out).write_text(json.dumps(data), encoding="utf-8")
    os._exit(0)  # the student's threads or atexit hooks must not keep the process alive


def run_file(
    target: str,
    kind: str,
    *,
    mask_means: str,
    array: str,
    timeout: float,
    batched: bool = False,
    num_kv_heads: int | None = None,
    adapt: str = "",
) -> FileRun:
    """Run ``FILE.py:NAME`` on the probes of ``kind`` in a separate process (the arguments of
    :func:`run_probes`). ``adapt`` = ``"module"`` (or ``"module-causal"``,
    ``"module-not-causal"``): NAME is an attention class, driven by
    :func:`~qkv.check._module_adapt.adapt_class` in that process.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            or it did not finish within ``timeout`` seconds.
    """
    path, name = split_target(target)
    with tempfile.TemporaryDirectory(prefix="qkv-function-") as tmp:
        out = Path(tmp) / "outcomes.json"
        command = [
            sys.executable,
            "-c",
            "from qkv.check._function_run import _child_main; _child_main()",
            str(path), name, kind, mask_means, array,
            "batched" if batched else "single", str(num_kv_heads or 0), adapt, str(out),
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise FunctionError(
                f"{target}: the function did not finish within {timeout:g} s (an infinite "
                "loop?). Hint: run it by hand on small inputs, or give a longer time limit"
            ) from None
        if not out.is_file():
            last = (done.stderr.strip().splitlines() or ["no message"])[-1][:200]
            raise FunctionError(
                f"{target}: the process running it ended with status {done.returncode} "
                f"before returning ({last}). Hint: run 'python {path}' to see the crash"
            )
        data = json.loads(out.read_text(encoding="utf-8"))
    if "error" in data:
        raise FunctionError(str(data["error"]))
    outcomes = [
        Outcome(
            None if o["context"] is None else np.asarray(o["context"], dtype=np.float64),
            None if o["weights"] is None else np.asarray(o["weights"], dtype=np.float64),
            o["error"],
        )
        for o in data["outcomes"]
    ]
    return FileRun(
        path=path,
        name=name,
        array=data["array"],
        with_mask=bool(data["with_mask"]),
        outcomes=outcomes,
        kind=str(data["kind"]),
        causal=bool(data.get("causal", False)),
        about=str(data.get("about", "")),
        file_error=data.get("file_error"),
    )
