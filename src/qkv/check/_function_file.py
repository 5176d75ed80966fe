"""A student's ``FILE.py:NAME`` on the probes of ``qkv check --function`` (or, for
``--module``, an attention class driven as a function), run sandboxed.

Loading a file runs its code, and a student's code is hostile by default: :func:`run_file`
runs it in :func:`~qkv.check._sandbox.run_sandboxed`'s child, where :func:`child_main` runs
the file (statement by statement, as a notebook exported to a file:
:mod:`~qkv.check._student_file`), builds the class when ``--module`` asked for one
(:mod:`~qkv.check._module_adapt`), calls the function on the probes (the repeated probe of
``dropout-at-inference`` included) and writes what it returned as JSON to the result
file. Back here that file is read like any untrusted file (size, JSON, then every field's
type, length and shape, :func:`outcomes_from`), and a child that crashed, ran out of time or
hit a limit becomes one :class:`~qkv.check._function_run.FunctionError` line.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qkv._read import FileLimitError, json_value, size_text
from qkv.check._function_run import (
    FunctionError,
    Outcome,
    run_probes,
    student_text,
    takes_mask,
)
from qkv.check._probes import probes
from qkv.check._sandbox import Finished, Limits, run_sandboxed
from qkv.check._student_file import StudentFileError, run_student_file

__all__ = [
    "ChildResult",
    "FileRun",
    "check_timeout",
    "child_main",
    "load_function",
    "outcomes_from",
    "run_file",
    "split_target",
]

_OUTPUT_KEPT = 64 << 10  # bytes of each of the student's stdout and stderr kept in the files
_RESULT_LIMIT = 4 << 20
_ARRAY_LIMIT = 100_000  # numbers in one returned array (the probes' outputs have ≤ 108)
_HINT = "Hint: the checked code may have written to the result file; look for that in it"
_LIBRARIES = ("numpy", "torch", "numpy (1, 1, L, d)", "torch (1, 1, L, d)")


_ADAPT = {"": None, "module": None, "module-causal": True, "module-not-causal": False}
"""What ``run_file``'s ``adapt`` may be: '' for a function, else a class and whether to
check it as causal (None: as the class says)."""


@dataclass(frozen=True)
class FileRun:
    """What checking ``FILE.py:NAME`` brought back.

    Attributes:
        path: the file. name: the function or class in it.
        array: the array library of the probes (as :func:`run_probes` says it).
        with_mask: whether the function takes a mask.
        outcomes: one per probe.
        isolation: the level of isolation it ran at.
        kind: the kind probed (a class is probed as ``multi-head`` or ``gqa``).
        causal: a class: whether it is checked as causal attention.
        about: a class: how it was driven (its forward and projections), escaped.
        file_error: the file's own errors, as one escaped line, or None.
    """

    path: Path
    name: str
    array: str
    with_mask: bool
    outcomes: list[Outcome]
    isolation: str
    kind: str
    causal: bool = False
    about: str = ""
    file_error: str | None = None


def check_timeout(timeout: object) -> float:
    """``timeout`` as seconds, after checking that it is a positive finite number.

    Raises:
        ValueError: zero, negative, infinite, NaN or not a number.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(
            f"timeout must be a number of seconds, got {type(timeout).__name__}. Hint: timeout=20"
        )
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"timeout must be a positive finite number of seconds, got {timeout!r}. Hint: "
            "timeout=20 (a student's code that hangs is stopped after it)"
        )
    return float(timeout)


def split_target(target: str) -> tuple[Path, str]:
    """``FILE.py:NAME`` as (path, name).

    Raises:
        FunctionError: no ``:NAME``, or no such file.
    """
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise FunctionError(
            f"--function must be FILE.py:NAME, got {student_text(target)!r}. Hint: "
            "'qkv check --function student.py:attention --kind attention'"
        )
    if not Path(path).is_file():
        raise FunctionError(
            f"--function: no such file {student_text(path)!r}. Hint: check the path"
        )
    return Path(path), name


def load_function(
    path: Path, name: str, what: str = "function"
) -> tuple[Callable[..., Any], str | None]:
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
        shown = student_text(str(path))
        ran = f"; running it: {file_error}" if file_error else ""
        raise FunctionError(
            f"{shown}: no {what} named {name!r}{ran}. Hint: give FILE.py:NAME with the name of "
            f"the {what} after the colon, and run 'python {shown}' to see the file's errors"
        )
    return fn, file_error


class _Kept(io.TextIOBase):
    """A text stream that writes the first ``budget`` bytes to ``fd`` and drops the rest, so
    that printing a lot neither fails nor fills the disk."""

    def __init__(self, fd: int, budget: int) -> None:
        self._fd = fd
        self._left = budget

    def write(self, text: str) -> int:
        data = text.encode("utf-8", errors="replace")[: self._left]
        self._left -= len(data)
        while data:
            data = data[os.write(self._fd, data) :]
        return len(text)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd


def child_main() -> None:
    """The sandboxed child: load the file, call the function on the probes, write the JSON
    result to the file descriptor ``QKV_RESULT_FD``, and end at once (the student's threads
    and exit hooks must not keep the process alive)."""
    result = int(os.environ["QKV_RESULT_FD"])
    os.set_inheritable(result, False)  # nothing the student's code starts inherits it
    sys.stdout, sys.stderr = _Kept(1, _OUTPUT_KEPT), _Kept(2, _OUTPUT_KEPT)
    path, name, kind, mask_means, array, batched, kv_heads, adapt, shown = sys.argv[1:10]
    try:
        fn, file_error = load_function(Path(path), name, "class" if adapt else "function")
        causal, about = False, ""
        if adapt:
            from qkv.check._module_adapt import ModuleError, adapt_class

            try:
                driven = adapt_class(fn, causal=_ADAPT[adapt])
            except ModuleError as exc:
                raise FunctionError(f"{shown}: {exc}") from None
            fn, kind, causal, about = driven.fn, driven.kind, driven.causal, driven.about
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
            "kind": kind,
            "causal": causal,
            "about": about,
            "file_error": file_error,
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
    encoded = json.dumps(data).encode()
    while encoded:
        encoded = encoded[os.write(result, encoded) :]
    os._exit(0)


_CHILD = "import sys; sys.path.insert(0, sys.argv[10]); import qkv.check._function_file as f; "
_CHILD += "f.child_main()"


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
    isolation: str = "auto",
) -> FileRun:
    """Run ``FILE.py:NAME`` on the probes of ``kind`` in the sandbox (the arguments of
    :func:`~qkv.check._function_run.run_probes`). ``adapt`` = ``"module"`` (or
    ``"module-causal"``, ``"module-not-causal"``): NAME is an attention class, driven by
    :func:`~qkv.check._module_adapt.adapt_class` in the sandbox.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            hit a limit, or did not finish within ``timeout`` seconds.
        IsolationError: ``isolation`` is unknown or not available here.
    """
    timeout = check_timeout(timeout)
    if adapt not in _ADAPT:
        raise ValueError(f"adapt must be one of {', '.join(map(repr, _ADAPT))}, got {adapt!r}")
    path, name = split_target(target)
    shown = student_text(target)
    source = Path(__file__).resolve().parents[2]
    command = [
        "-c", _CHILD, str(path.resolve()), name, kind, mask_means, array,
        "batched" if batched else "single", str(num_kv_heads or 0), adapt, shown, str(source),
    ]  # fmt: skip
    limits = Limits()
    done = run_sandboxed(
        command,
        timeout=timeout,
        isolation=isolation,
        readable=[path.resolve().parent],
        limits=limits,
        result_limit=_RESULT_LIMIT,
    )
    if done.timed_out:
        raise FunctionError(
            f"{shown}: the function did not finish within {timeout:g} s (an infinite "
            "loop?). Hint: run it by hand on small inputs, or give a longer time limit"
        )
    if not done.result and not done.result_too_large:
        raise FunctionError(_ended(shown, path, done, limits, timeout))
    data = _result_data(shown, done)
    if "error" in data:
        raise FunctionError(student_text(str(data["error"]), 1000))
    got = outcomes_from(data, kind, batched, shown, num_kv_heads=num_kv_heads, module=bool(adapt))
    return FileRun(
        path=path,
        name=name,
        array=got.array,
        with_mask=got.with_mask,
        outcomes=got.outcomes,
        isolation=done.isolation,
        kind=got.kind,
        causal=got.causal,
        about=got.about,
        file_error=got.file_error,
    )


def _ended(shown: str, path: Path, done: Finished, limits: Limits, timeout: float) -> str:
    """The line for a child that ended without a result."""
    if done.status == 128 + signal.SIGXFSZ:
        return (
            f"{shown}: the process running it was stopped for writing more than "
            f"{size_text(limits.file_size)} to one file (its output or a file of its own). "
            "Hint: remove the large prints or writes"
        )
    if done.status == 128 + signal.SIGXCPU:
        return (
            f"{shown}: the process running it used more than {math.ceil(timeout) + 1} s of "
            "CPU time. Hint: run it by hand on small inputs, or give a longer time limit"
        )
    why = f"status {done.status}"
    if done.status > 128 and done.status - 128 in signal.valid_signals():
        why += f", signal {signal.Signals(done.status - 128).name}"
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return (
        f"{shown}: the process running it ended with {why} before returning "
        f"({student_text(last)}). Hint: run 'python {student_text(str(path))}' to see the crash"
    )


def _result_data(shown: str, done: Finished) -> dict[str, Any]:
    """The result file as JSON: an object, or a one-line error."""
    bad = f"{shown}: the result of the run is not what qkv's runner writes"
    hint = _HINT
    if done.result_too_large:
        raise FunctionError(f"{bad}: it is larger than {size_text(_RESULT_LIMIT)}. {hint}")
    try:
        data = json_value(done.result.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, FileLimitError) as exc:
        raise FunctionError(f"{bad}: not JSON ({student_text(str(exc), 80)}). {hint}") from None
    if not isinstance(data, dict) or not (set(data) == {"error"} or set(data) == _FIELDS):
        raise FunctionError(f"{bad}: not an object with the runner's fields. {hint}")
    return data


_FIELDS = {"array", "with_mask", "kind", "causal", "about", "file_error", "outcomes"}
_ABOUT_LIMIT = 300  # characters of 'about' and 'file_error' kept


@dataclass(frozen=True)
class ChildResult:
    """The child's result, every field checked (the fields of :class:`FileRun` it gives)."""

    array: str
    with_mask: bool
    outcomes: list[Outcome]
    kind: str
    causal: bool
    about: str
    file_error: str | None


def outcomes_from(
    data: dict[str, Any],
    kind: str,
    batched: bool,
    target: str,
    *,
    num_kv_heads: int | None = None,
    module: bool = False,
) -> ChildResult:
    """What the child's result says, every field checked: the array library, whether the
    function takes a mask, one outcome per probe, the kind probed (``module``: a class is
    probed as ``multi-head`` or ``gqa``), and the escaped texts.

    Raises:
        FunctionError: a field of the wrong type, the wrong number of outcomes, an array
            that is not numbers or too large.
    """

    def bad(what: str) -> FunctionError:
        return FunctionError(
            f"{target}: the result of the run is not what qkv's runner writes: {what}. {_HINT}"
        )

    used, with_mask, rows = data["array"], data["with_mask"], data["outcomes"]
    if used not in _LIBRARIES or not isinstance(with_mask, bool):
        raise bad("'array' or 'with_mask' is not one of the runner's values")
    kinds = ("multi-head", "gqa") if module else (kind,)
    got_kind, causal = data["kind"], data["causal"]
    if got_kind not in kinds or not isinstance(causal, bool) or (causal and not module):
        raise bad("'kind' or 'causal' is not what was asked for")
    about, file_error = data["about"], data["file_error"]
    if not isinstance(about, str) or not (file_error is None or isinstance(file_error, str)):
        raise bad("'about' or 'file_error' is not text")
    count = len(probes(got_kind, with_mask=with_mask, batched=batched, num_kv_heads=num_kv_heads))
    if not isinstance(rows, list) or len(rows) != count:
        raise bad(f"'outcomes' is not a list of {count} entries, one per probe")
    outcomes = []
    for row in rows:
        if not isinstance(row, dict) or set(row) != {"context", "weights", "error"}:
            raise bad("an outcome is not an object with context, weights and error")
        error = row["error"]
        if error is not None and not isinstance(error, str):
            raise bad("an outcome's error is not text")
        outcomes.append(
            Outcome(
                _array(row["context"], bad),
                _array(row["weights"], bad),
                None if error is None else student_text(error, 300),
            )
        )
    return ChildResult(
        array=used,
        with_mask=with_mask,
        outcomes=outcomes,
        kind=got_kind,
        causal=causal,
        about=student_text(about, _ABOUT_LIMIT),
        file_error=None if file_error is None else student_text(file_error, _ABOUT_LIMIT),
    )


def _array(value: object, bad: Callable[[str], FunctionError]) -> np.ndarray[Any, Any] | None:
    if value is None:
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise bad("an outcome holds something that is not an array of numbers") from None
    if array.ndim not in (1, 2, 3, 4) or array.size > _ARRAY_LIMIT:
        raise bad(f"an outcome holds an array of shape {array.shape}, not the probes' size")
    return array
