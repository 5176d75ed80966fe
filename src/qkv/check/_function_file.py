"""A student's ``FILE.py:NAME`` on the probes of ``qkv check --function``, run sandboxed.

Loading a file runs its code, and a student's code is hostile by default: :func:`run_file`
runs it in :func:`~qkv.check._sandbox.run_sandboxed`'s child, where :func:`child_main` loads
the file, calls the function on the probes and writes what it returned as JSON to the result
file. Back here that file is read like any untrusted file (size, JSON, then every field's
type, length and shape, :func:`outcomes_from`), and a child that crashed, ran out of time or
hit a limit becomes one :class:`~qkv.check._function_run.FunctionError` line.
"""

from __future__ import annotations

import importlib.util
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
    raised,
    run_probes,
    student_text,
    takes_mask,
)
from qkv.check._probes import probes
from qkv.check._sandbox import Finished, Limits, run_sandboxed

__all__ = ["FileRun", "check_timeout", "child_main", "load_function", "run_file", "split_target"]

_OUTPUT_KEPT = 64 << 10  # bytes of each of the student's stdout and stderr kept in the files
_RESULT_LIMIT = 4 << 20
_ARRAY_LIMIT = 100_000  # numbers in one returned array (the probes' outputs have ≤ 108)
_HINT = "Hint: the checked code may have written to the result file; look for that in it"
_LIBRARIES = ("numpy", "torch", "numpy (1, 1, L, d)", "torch (1, 1, L, d)")


@dataclass(frozen=True)
class FileRun:
    """What checking ``FILE.py:NAME`` brought back: the file, the function's name, the array
    library it was probed with, whether it takes a mask, one outcome per probe, and the
    isolation it ran at."""

    path: Path
    name: str
    array: str
    with_mask: bool
    outcomes: list[Outcome]
    isolation: str


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


def load_function(path: Path, name: str) -> Callable[..., Any]:
    """Import ``path`` (this runs its code) and return its function ``name``.

    Raises:
        FunctionError: the file cannot be imported or has no callable ``name``.
    """
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location("_qkv_student_module", path)
    if spec is None or spec.loader is None:
        raise FunctionError(f"{path}: not a Python file. Hint: give a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are the file's too
        raise FunctionError(
            f"{path}: importing it raised {raised(exc)}. Hint: run 'python {path}' to see "
            "the whole error"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise FunctionError(
            f"{path}: no function named {name!r}. Hint: give FILE.py:NAME with the name of "
            "the function after the colon"
        )
    return fn  # type: ignore[no-any-return]


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
    path, name, kind, mask_means, array, batched = sys.argv[1:7]
    try:
        fn = load_function(Path(path), name)
        used, outcomes = run_probes(
            fn, kind, mask_means=mask_means, array=array, batched=batched == "batched"
        )
        data: dict[str, Any] = {
            "array": used,
            "with_mask": takes_mask(fn, kind),
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


_CHILD = "import sys; sys.path.insert(0, sys.argv[7]); import qkv.check._function_file as f; "
_CHILD += "f.child_main()"


def run_file(
    target: str,
    kind: str,
    *,
    mask_means: str,
    array: str,
    timeout: float,
    batched: bool = False,
    isolation: str = "auto",
) -> FileRun:
    """Run ``FILE.py:NAME`` on the probes of ``kind`` in the sandbox.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            hit a limit, or did not finish within ``timeout`` seconds.
        IsolationError: ``isolation`` is unknown or not available here.
    """
    timeout = check_timeout(timeout)
    path, name = split_target(target)
    shown = student_text(target)
    source = Path(__file__).resolve().parents[2]
    command = [
        "-c", _CHILD, str(path.resolve()), name, kind, mask_means, array,
        "batched" if batched else "single", str(source),
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
    used, with_mask, outcomes = outcomes_from(data, kind, batched, shown)
    return FileRun(path, name, used, with_mask, outcomes, done.isolation)


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
    if not isinstance(data, dict) or not (
        set(data) == {"error"} or set(data) == {"array", "with_mask", "outcomes"}
    ):
        raise FunctionError(f"{bad}: not an object with the runner's fields. {hint}")
    return data


def outcomes_from(
    data: dict[str, Any], kind: str, batched: bool, target: str
) -> tuple[str, bool, list[Outcome]]:
    """The array library, whether the function takes a mask, and one outcome per probe,
    from the child's result, every field checked.

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
    count = len(probes(kind, with_mask=with_mask, batched=batched))
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
    return used, with_mask, outcomes


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
