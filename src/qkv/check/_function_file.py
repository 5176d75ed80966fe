"""A student's ``FILE.py:NAME`` on the probes of ``qkv check --function`` (or, for
``--module``, an attention class driven as a function), run sandboxed, judged here.

Loading a file runs its code, and a student's code is hostile by default. :func:`run_file`
starts the student's process (:func:`~qkv.check._sandbox.start`), which holds nothing of
qkv: the runner :mod:`~qkv.check._student_main` runs the file there (statement by statement,
as a notebook exported to a file: :mod:`~qkv.check._student_file`), builds the class when
``--module`` asked for one (:mod:`~qkv.check._module_adapt`), and calls it on what this
process sends. This process is the judge: a **proxy** of the student's function (its
signature from the runner; calling it sends the arguments over the channel,
:mod:`~qkv.check._channel`, and returns the arrays that come back, or raises the student's
exception by name) goes through :func:`~qkv.check._function_run.run_probes` here, and the
diagnosis runs on what it returned. Nothing the student's code does in its process can write
a verdict, reach the probes' reference or import qkv.

The time limit counts the student's code only: the file's loading and every call, measured
here from each request to its reply; the process's start (Python, NumPy, torch) has its own
bound (:data:`~qkv.check._sandbox.STARTUP_SECONDS`). A process that crashed, ran out of time,
hit a limit or sent something the runner does not send becomes one
:class:`~qkv.check._function_run.FunctionError` line.
"""

from __future__ import annotations

import inspect
import math
import os
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv._read import size_text
from qkv.check._channel import Channel, ChannelError, Clock
from qkv.check._function_run import (
    FunctionError,
    Outcome,
    run_probes,
    student_text,
    takes_mask,
)
from qkv.check._function_run import (
    raised as raised_text,
)
from qkv.check._sandbox import STARTUP_SECONDS, Finished, Limits, Sandbox, cpu_seconds, start
from qkv.check._student_file import MAX_SOURCE_BYTES

__all__ = [
    "MAX_TIMEOUT",
    "FileRun",
    "ModuleProbes",
    "Scalar",
    "check_timeout",
    "run_file",
    "split_target",
]

MAX_TIMEOUT = 24 * 3600.0
"""The longest time limit accepted, seconds (a day)."""
_TEXT_LIMIT = 300  # characters of 'about', 'file_error' and the adapter's texts kept
_ADAPT = {"": None, "module": None, "module-causal": True, "module-not-causal": False}
"""What ``run_file``'s ``adapt`` may be: '' for a function, else a class and whether to
check it as causal (None: as the class says)."""

Scalar = str | bool | int | float | None
ModuleProbes = Callable[[Callable[..., Any], dict[str, Scalar]], tuple[str, list[Outcome]]]
"""Probes a driven class (its proxy, the adapter's fields): the library's words and the
outcomes."""


@dataclass(frozen=True)
class FlashReply:
    """What a FlashAttention forward (and backward) returned in the student's process.

    Attributes:
        out: O. lse: the candidates for L (the second item returned, or the saved tensors
            of the right shape). grads: dQ, dK, dV, when its backward ran.
        backward_raised: the backward's exception, escaped, or None.
        autograd: whether it is a ``torch.autograd.Function``.
    """

    out: NDArray[np.float64]
    lse: tuple[NDArray[np.float64], ...]
    grads: tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]] | None
    backward_raised: str | None
    autograd: bool


class FlashCallError(Exception):
    """The student's FlashAttention raised, or returned no tensor (the words, escaped)."""


FlashCall = Callable[[list[NDArray[Any]], bool], FlashReply]
"""Calls the student's FlashAttention on Q, K, V, dO (float32) and is_causal."""

FlashProbes = Callable[[FlashCall], Any]
"""Probes a FlashAttention entry point through its :data:`FlashCall`; what it returns is
:attr:`FileRun.flash`."""


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
        adapter: a class: every field of the adapter's result but its function (JSON
            scalars; texts escaped and cut to 300 characters).
        flash: with ``flash_probes``, what they returned.
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
    adapter: dict[str, Scalar] = field(default_factory=dict)
    flash: Any = None


def check_timeout(timeout: object) -> float:
    """``timeout`` as seconds, after checking that it is a positive finite number of at most
    a day.

    Raises:
        ValueError: zero, negative, infinite, NaN, more than a day, or not a number.

    Example:
        >>> check_timeout(20)
        20.0
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
    if timeout > MAX_TIMEOUT:
        raise ValueError(
            f"timeout must be a positive finite number of seconds of at most {MAX_TIMEOUT:g} "
            f"(a day), got {timeout!r}. Hint: timeout=20"
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


class _Stop(BaseException):
    """Ends the probing at once, as no slip of the function: the student's time is up, its
    process ended, or it sent what the runner does not send. A BaseException, so that
    :func:`~qkv.check._function_run.run_probes`' ``except Exception`` around each call lets
    it through."""

    def __init__(self, error: ChannelError) -> None:
        super().__init__(error.why)
        self.error = error


class _Unsendable(BaseException):
    """An argument of a type the channel does not carry: qkv's own bug, never the
    student's (a BaseException, so that no probe turns it into the function's error)."""


class _Unknown:
    """A parameter's default that is no JSON scalar (the runner sends only those)."""

    def __repr__(self) -> str:
        return "…"


_UNKNOWN = _Unknown()
_CLASS_KINDS = ("multi-head", "gqa", "head")
"""The kinds the class adapter may answer."""
_PARAMETER_KINDS = {kind.name: kind for kind in inspect._ParameterKind}
_SENT_DTYPES = {"float64", "float32", "int64", "bool"}


class _Judge:
    """The judge's side of one run: the channel and the student's clock."""

    def __init__(self, box: Sandbox, timeout: float, loading: str) -> None:
        self.channel = Channel(box.requests, box.replies, box.ended)
        self.clock = Clock(timeout)
        self.loading = loading  # what the load request times, in words

    def ready(self) -> None:
        header, arrays = self.channel.receive(time.monotonic() + STARTUP_SECONDS)
        if header != {"ready": True, "arrays": []} or arrays:
            raise ChannelError("garbage", "not the runner's first message")

    def ask(
        self, header: dict[str, Any], arrays: list[NDArray[Any]]
    ) -> tuple[dict[str, Any], list[NDArray[np.float64]]]:
        """Send a request and read its reply: the time between is the student's."""
        began = time.monotonic()
        deadline = began + self.clock.left()
        try:
            self.channel.send(header, arrays, deadline)
            return self.channel.receive(deadline)
        finally:
            self.clock.used += time.monotonic() - began


def _encode(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], list[NDArray[Any]]]:
    """A call's request: its arguments as JSON scalars or arrays tagged with their library."""
    arrays: list[NDArray[Any]] = []

    def one(value: Any) -> Any:
        if value is None or isinstance(value, (bool, str, np.bool_)):
            return value if not isinstance(value, np.bool_) else bool(value)
        if isinstance(value, (int, np.integer)):
            return int(value)
        if isinstance(value, (float, np.floating)):
            number = float(value)
            return number if math.isfinite(number) else {"float": repr(number)}
        if isinstance(value, np.ndarray):
            library, array = "numpy", value
        elif hasattr(value, "detach") and type(value).__module__.startswith("torch"):
            library, array = "torch", value.detach().cpu().numpy()
        else:
            raise _Unsendable(
                f"qkv cannot send {type(value).__name__} to the student's process (a bug of "
                "qkv's: the channel carries None, bool, int, float, str and arrays)"
            )
        if array.dtype.name not in _SENT_DTYPES:
            kind = array.dtype.kind
            array = array.astype(np.int64 if kind in "iu" else np.float64)
        arrays.append(np.ascontiguousarray(array))
        return {"array": len(arrays) - 1, "library": library}

    header = {
        "op": "call",
        "args": [one(a) for a in args],
        "kwargs": {str(k): one(v) for k, v in kwargs.items()},
    }
    return header, arrays


def _garbage(detail: str) -> _Stop:
    return _Stop(ChannelError("garbage", detail))


def _returned(reply: dict[str, Any], arrays: list[NDArray[np.float64]]) -> Any:
    """What the student's function returned, from the runner's reply; its exception raised."""
    keys = set(reply) - {"arrays"}
    if keys in ({"items"}, {"items", "container"}):
        items = reply["items"]
        if items is None and keys == {"items"} and len(arrays) == 1:
            return arrays[0]
        container = reply.get("container")
        if isinstance(items, int) and items == len(arrays) >= 1 and container in ("tuple", "list"):
            return tuple(arrays) if container == "tuple" else list(arrays)
        raise _garbage("a return whose arrays do not match its header")
    if arrays:
        raise _garbage("arrays with a reply that holds none")
    if keys == {"returned"} and isinstance(reply["returned"], str):
        return _opaque(reply["returned"])
    if keys == {"too_large"} and isinstance(reply["too_large"], list):
        shape = reply["too_large"]
        if len(shape) <= 32 and all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            # named so that run_probes says "returned an array of shape (...): larger ..."
            name = f"returned an array of shape {tuple(shape)}"
            raise type(name, (Exception,), {})("larger than any probe's output")
    if keys == {"raised", "message"} and isinstance(reply["message"], str):
        name = reply["raised"]
        if not (isinstance(name, str) and name.isidentifier()):
            name = "Exception"
        raise type(name, (Exception,), {"__module__": "student"})(reply["message"][:2000])
    raise _garbage("a reply the runner does not send")


def _opaque(name: str) -> object:
    """An object of a class named ``name``: not an array, as what the student returned."""
    try:
        return type(name[:200] or "object", (), {})()
    except (TypeError, ValueError):  # a name with a NUL character
        return object()


def _signature(params: object) -> inspect.Signature | None:
    """The student's function's signature from the runner's ``params`` (None: unknown)."""
    if params is None:
        return None
    if not isinstance(params, list) or len(params) > 64:
        raise _garbage("parameters that are not a short list")
    parameters = []
    for entry in params:
        if not isinstance(entry, dict) or entry.get("kind") not in _PARAMETER_KINDS:
            raise _garbage("a parameter that is not a name and a kind")
        name = entry.get("name")
        default = entry.get("default", _UNKNOWN) if entry.get("has_default") else inspect._empty
        if isinstance(default, (list, dict)):
            raise _garbage("a parameter's default that is not a JSON scalar")
        try:
            parameters.append(
                inspect.Parameter(str(name), _PARAMETER_KINDS[entry["kind"]], default=default)
            )
        except (TypeError, ValueError):
            raise _garbage("a parameter that Python does not allow") from None
    try:
        return inspect.Signature(parameters)
    except (TypeError, ValueError):
        raise _garbage("parameters in an order Python does not allow") from None


def _proxy(judge: _Judge, signature: inspect.Signature | None, name: str) -> Callable[..., Any]:
    """The student's function as seen here: each call goes to the student's process."""

    def proxy(*args: Any, **kwargs: Any) -> Any:
        header, arrays = _encode(args, kwargs)
        judge.clock.calls += 1
        try:
            reply, got = judge.ask(header, arrays)
        except ChannelError as exc:
            raise _Stop(exc) from None
        return _returned(reply, got)

    # inspect.signature reads __signature__; one that is no Signature makes it raise, as for
    # a function whose signature Python cannot tell
    proxy.__signature__ = "unknown" if signature is None else signature  # type: ignore[attr-defined]
    proxy.__name__ = proxy.__qualname__ = name
    return proxy


def _flash_call(judge: _Judge) -> FlashCall:
    """The student's FlashAttention as seen here: each call goes to the student's process,
    and what comes back is checked as any reply (sizes by the channel, the rest here)."""

    def call(arrays: list[NDArray[Any]], causal: bool) -> FlashReply:
        sent = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
        judge.clock.calls += 1
        try:
            reply, got = judge.ask({"op": "flash", "causal": bool(causal)}, sent)
        except ChannelError as exc:
            raise _Stop(exc) from None
        keys = set(reply) - {"arrays"}
        if keys == {"flash", "autograd", "lse", "grads", "backward_raised"}:
            count, grads, raised = reply["lse"], reply["grads"], reply["backward_raised"]
            if not (
                isinstance(count, int)
                and not isinstance(count, bool)
                and 0 <= count <= 4
                and isinstance(grads, bool)
                and isinstance(reply["autograd"], bool)
                and (raised is None or isinstance(raised, str))
                and len(got) == 1 + count + 3 * grads
            ):
                raise _garbage("a FlashAttention reply whose arrays do not match its header")
            three = (got[-3], got[-2], got[-1]) if grads else None
            return FlashReply(
                out=got[0],
                lse=tuple(got[1 : 1 + count]),
                grads=three,
                backward_raised=None if raised is None else student_text(raised),
                autograd=reply["autograd"],
            )
        try:
            value = _returned(reply, got)
        except _Stop:
            raise
        except Exception as exc:  # the student's exception, as the runner named it
            text = raised_text(exc)
            said = text if text.startswith("returned ") else f"raised {text}"
            raise FlashCallError(said) from None
        name = student_text(type(value).__name__, 60)
        raise FlashCallError(f"returned {name}, not a tensor")

    return call


def _scalars(fields: object) -> dict[str, Scalar]:
    """The adapter's fields: each a JSON scalar, its text escaped and cut."""
    if not isinstance(fields, dict) or len(fields) > 64:
        raise _garbage("the adapter's fields are not a short object")
    checked: dict[str, Scalar] = {}
    for key, value in fields.items():
        if not (value is None or isinstance(value, (str, bool, int, float))):
            raise _garbage("an adapter's field that is not a JSON scalar")
        if isinstance(value, float) and not math.isfinite(value):
            raise _garbage("an adapter's field that is not a finite number")
        checked[student_text(str(key), 60)] = (
            student_text(value, _TEXT_LIMIT) if isinstance(value, str) else value
        )
    return checked


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
    module_probes: ModuleProbes | None = None,
    flash_probes: FlashProbes | None = None,
) -> FileRun:
    """Run ``FILE.py:NAME`` on the probes of ``kind`` (the arguments of
    :func:`~qkv.check._function_run.run_probes`): the file and the function in the student's
    sandboxed process, the probes and the verdict here. ``adapt`` = ``"module"`` (or
    ``"module-causal"``, ``"module-not-causal"``): NAME is an attention class, driven by
    :func:`~qkv.check._module_adapt.adapt_class` in the student's process; then
    ``module_probes(fn, fields)``, when given, probes it here instead of ``run_probes``
    (``fields``: the adapter's scalar fields, as :attr:`FileRun.adapter`; what it returns
    first becomes :attr:`FileRun.array`). ``flash_probes(call)``, when given, probes a
    FlashAttention entry point instead (``--kind flash``; what it returns is
    :attr:`FileRun.flash`). ``timeout`` counts the student's code: the file's
    loading and every call.

    Raises:
        FunctionError: the file or function cannot be loaded or called, the process crashed,
            hit a limit, sent what the runner does not send, or the student's code did not
            finish within ``timeout`` seconds.
        IsolationError: ``isolation`` is unknown or not available here.
    """
    timeout = check_timeout(timeout)
    if adapt not in _ADAPT:
        raise ValueError(f"adapt must be one of {', '.join(map(repr, _ADAPT))}, got {adapt!r}")
    path, name = split_target(target)
    shown = student_text(target)
    limits = Limits()
    folder = path.resolve().parent
    torch = bool(adapt) or flash_probes is not None or array == "torch" or _mentions_torch(path)
    with start(
        timeout=timeout, isolation=isolation, readable=[folder], limits=limits, torch=torch
    ) as box:
        loading = "loading the file" + (" and driving the class" if adapt else "")
        judge = _Judge(box, timeout, loading)
        try:
            try:
                judge.ready()
            except ChannelError as exc:
                if exc.why == "timeout":
                    raise FunctionError(
                        f"{shown}: the sandbox did not start within {STARTUP_SECONDS:g} s: "
                        "the machine may be overloaded. Hint: grade again when it is less "
                        "busy, or with fewer jobs at once"
                    ) from None
                raise _Stop(exc) from None
            return _judge(judge, box, path, name, shown, kind, adapt, mask_means, array,
                          batched, num_kv_heads, module_probes, flash_probes)  # fmt: skip
        except _Stop as stop:
            raise FunctionError(_stopped(stop.error, box, judge, shown, path, limits)) from None
        except _Unsendable as bug:
            raise RuntimeError(str(bug)) from None


def _mentions_torch(path: Path) -> bool:
    """Whether the student's file names torch (its process then imports torch before the
    student's time starts; a NumPy file is spared 1.5 s of start-up)."""
    try:  # non-blocking: a FIFO in the file's place must not hold the judge
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return True  # the load will say what is wrong with the file
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True  # no regular file: the load refuses it
        return b"torch" in file.read(MAX_SOURCE_BYTES + 1)  # the rest is refused


def _judge(
    judge: _Judge,
    box: Sandbox,
    path: Path,
    name: str,
    shown: str,
    kind: str,
    adapt: str,
    mask_means: str,
    array: str,
    batched: bool,
    num_kv_heads: int | None,
    module_probes: ModuleProbes | None,
    flash_probes: FlashProbes | None = None,
) -> FileRun:
    what = "class" if adapt else "function"
    request: dict[str, Any] = {"op": "load", "path": str(path.resolve()), "name": name}
    request.update({"adapt": bool(adapt), "causal": _ADAPT[adapt]})
    try:
        reply, arrays = judge.ask(request, [])
    except ChannelError as exc:
        raise _Stop(exc) from None
    file_error = reply.get("file_error")
    if arrays or not (file_error is None or isinstance(file_error, str)):
        raise _garbage("a load reply with arrays, or a file's error that is not text")
    escaped = None if file_error is None else student_text(file_error, _TEXT_LIMIT)
    if "error" in reply:
        _refuse(reply, shown, path, name, what, escaped)
    if set(reply) != {"params", "fields", "file_error", "arrays"}:
        raise _garbage("a load reply without the runner's fields")
    fields = _scalars(reply["fields"])
    proxy = _proxy(judge, _signature(reply["params"]), name)
    causal, about = False, ""
    if adapt:
        got_kind, got_causal = fields.get("kind"), fields.get("causal")
        got_about = fields.get("about", "")
        if got_kind not in _CLASS_KINDS or not isinstance(got_causal, bool):
            raise _garbage("the class's kind or causality is not one of the adapter's")
        if not isinstance(got_about, str):
            raise _garbage("the class's description is not text")
        kind, causal, about = str(got_kind), got_causal, got_about
    elif fields:
        raise _garbage("a function's load reply with the adapter's fields")
    if flash_probes is not None:
        return FileRun(
            path=path,
            name=name,
            array="torch",
            with_mask=False,
            outcomes=[],
            isolation=box.isolation,
            kind=str(kind),
            file_error=escaped,
            flash=flash_probes(_flash_call(judge)),
        )
    if adapt and module_probes is not None:
        used, outcomes = module_probes(proxy, dict(fields))
    else:
        used, outcomes = run_probes(
            proxy,
            str(kind),
            mask_means=mask_means,
            array=array,
            batched=batched,
            num_kv_heads=num_kv_heads,
        )
    return FileRun(
        path=path,
        name=name,
        array=used,
        with_mask=takes_mask(proxy, str(kind)),
        outcomes=outcomes,
        isolation=box.isolation,
        kind=str(kind),
        causal=bool(causal),
        about=str(about),
        file_error=escaped,
        adapter=fields,
    )


def _refuse(
    reply: dict[str, Any], shown: str, path: Path, name: str, what: str, file_error: str | None
) -> None:
    """The one line for a file that could not be loaded, or a class not driven."""
    error, message = reply.get("error"), reply.get("message")
    if not isinstance(message, str):
        raise _garbage("an error that is not text")
    if error == "file":
        raise FunctionError(student_text(message, 1000))
    if error == "module":
        raise FunctionError(f"{shown}: {student_text(message, 1000)}")
    if error == "missing":
        file = student_text(str(path))
        ran = f"; running it: {file_error}" if file_error else ""
        raise FunctionError(
            f"{file}: no {what} named {name!r}{ran}. Hint: give FILE.py:NAME with the name of "
            f"the {what} after the colon, and run 'python {file}' to see the file's errors"
        )
    raise _garbage("an error the runner does not send")


def _stopped(
    error: ChannelError, box: Sandbox, judge: _Judge, shown: str, path: Path, limits: Limits
) -> str:
    """The one line for a run that stopped: out of time, ended, or garbage."""
    timeout = judge.clock.budget
    if error.why == "timeout":
        return _timed_out(shown, judge)
    if error.why == "garbage":
        return (
            f"{shown}: the student's process sent what qkv's runner does not send "
            f"({error.detail}). Hint: the checked code may write to the runner's channel; "
            "look for writes to file descriptors in it"
        )
    done = box.finish()
    if done.timed_out:
        return _timed_out(shown, judge)
    return _ended(shown, path, done, limits, timeout)


def _timed_out(shown: str, judge: _Judge) -> str:
    calls = judge.clock.calls
    timed = judge.loading + (
        f" and the {calls} call{'s' if calls != 1 else ''} so far" if calls else ""
    )
    return (
        f"{shown}: the student's code ({timed}) did not finish within "
        f"{judge.clock.budget:g} s (an infinite loop?). Hint: run it by hand on small inputs, "
        "or give a longer time limit"
    )


def _ended(shown: str, path: Path, done: Finished, limits: Limits, timeout: float) -> str:
    """The line for a process that ended before replying."""
    if done.status == 128 + signal.SIGXFSZ:
        return (
            f"{shown}: the process running it was stopped for writing more than "
            f"{size_text(limits.file_size)} to one file (its output or a file of its own). "
            "Hint: remove the large prints or writes"
        )
    if done.status == 128 + signal.SIGXCPU:
        return (
            f"{shown}: the process running it used more than {cpu_seconds(timeout)} s of "
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
