"""The student's process: it runs a student's file and calls what the judge asks, and holds
nothing of qkv.

qkv (the judge, :mod:`~qkv.check._function_file`) copies this file, ``_student_file.py``
and ``_module_adapt.py`` into a private read-only folder of the sandbox and starts
``python -I RUNNER/_student_main.py REQUESTS REPLIES``: two pipes, read and written here. This
file is never imported as part of qkv: it imports the standard library, NumPy, torch when
installed, and its two neighbours by their plain names; qkv's package is not importable in
this process (a test scans the three files). The judge holds the probes, the reference and
the verdict: what this process sends is only what the student's code returned, and the
judge checks it as it would check any return.

One message is one line of JSON (the header), then the raw bytes of the arrays it lists
(``"arrays": [{"shape": [...], "dtype": "float64"}, ...]``, little-endian, in order). A
value in ``args`` or ``kwargs`` is a JSON scalar, ``{"float": "nan"}`` for a number JSON
cannot write, or ``{"array": I, "library": "numpy" | "torch"}``.

- start: this process imports NumPy (and torch when ``argv[3]`` is ``torch``), then sends
  ``{"ready": true}``;
- ``{"op": "load", "path", "name", "adapt", "causal"}``: run the file statement by
  statement, take ``name`` (with ``adapt``, the class driven by ``_module_adapt``). Reply
  ``{"params": [...], "fields": {...}, "file_error": ...}`` or ``{"error": "file" |
  "missing" | "module", "message": ..., "file_error": ...}``;
- ``{"op": "call", "args", "kwargs"}``: call it. Reply ``{"items": null}`` and one array,
  ``{"items": N, "container": "tuple" | "list"}`` and N arrays, ``{"returned": TYPE}``,
  ``{"too_large": SHAPE}``, or ``{"raised": NAME, "message": TEXT}``;
- ``{"op": "flash", "causal"}`` with the arrays Q, K, V (float32, sent to torch) and dO:
  call a FlashAttention forward, ``NAME(Q, K, V, causal)`` or, for a
  ``torch.autograd.Function``, ``NAME.apply(Q, K, V, causal)`` with ``requires_grad``
  inputs, then ``backward(dO)`` when it has a backward of its own. Reply ``{"flash": true,
  "autograd", "lse": N, "grads": bool, "backward_raised": TEXT | null}`` and the arrays
  O, N candidates for L (the second item returned, or the saved tensors of shape Q's less
  its last axis) and dQ, dK, dV when ``grads``; or a reply of ``call``'s for what is no
  tensor, or an exception.

The student's ``torch.compile`` runs eagerly here (``TORCHDYNAMO_DISABLE=1``): compiling
changes speed, not results, and costs tens of seconds per shape on a CPU.

Every text sent is raw: the judge escapes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

ARRAY_LIMIT = 100_000
"""Numbers in one array sent back: the probes' outputs have fewer than 200."""
ITEMS_LIMIT = 8
"""Arrays in one tuple or list sent back."""
_OUTPUT_KEPT = 64 << 10  # bytes of each of the student's stdout and stderr kept in the files
_HEADER_LIMIT = 16 << 20  # bytes of a request's header line
_MESSAGE_LIMIT = 2000  # characters of an exception's message or a text sent back
_DTYPES = ("float64", "float32", "int64", "bool")
_ADAPTER_ERROR = ""  # why _module_adapt could not be imported, if it could not


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


class _Requests:
    """The judge's requests, read from a pipe: a header line, then exact byte counts."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""

    def _more(self) -> None:
        data = os.read(self._fd, 1 << 16)
        if not data:
            raise EOFError("the judge closed the channel")
        self._buffer += data

    def line(self) -> bytes:
        while b"\n" not in self._buffer:
            if len(self._buffer) > _HEADER_LIMIT:
                raise ValueError("a request's header is too long")
            self._more()
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            self._more()
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send(fd: int, header: dict[str, Any], arrays: Sequence[Any] = ()) -> None:
    import numpy as np

    payload = [np.ascontiguousarray(a, dtype="<f8") for a in arrays]
    specs = [{"shape": list(a.shape), "dtype": "float64"} for a in payload]
    line = json.dumps({**header, "arrays": specs}, allow_nan=False).encode() + b"\n"
    _write(fd, line + b"".join(a.tobytes() for a in payload))


def _receive(requests: _Requests) -> tuple[dict[str, Any], list[Any]]:
    import numpy as np

    header = json.loads(requests.line())
    arrays = []
    for spec in header.get("arrays", []):
        if spec["dtype"] not in _DTYPES:
            raise ValueError(f"a request's array has dtype {spec['dtype']!r}")
        dtype = np.dtype(spec["dtype"]).newbyteorder("<")
        shape = tuple(int(n) for n in spec["shape"])
        data = requests.exactly(math.prod(shape) * dtype.itemsize)
        array = np.frombuffer(data, dtype=dtype).reshape(shape)
        arrays.append(array.astype(dtype.newbyteorder("="), copy=True))
    return header, arrays


def _text(value: object) -> str:
    try:
        text = str(value)
    except Exception:  # a __str__ of the student's own that raises
        text = ""
    return text[:_MESSAGE_LIMIT]


def _type_name(value: object) -> str:
    return _text(getattr(type(value), "__name__", "object"))[:200]


def _decode(value: Any, arrays: list[Any]) -> Any:
    if isinstance(value, dict):
        if "float" in value:
            return float(value["float"])
        array = arrays[int(value["array"])]
        if value.get("library") == "torch":
            import torch

            return torch.from_numpy(array)
        return array
    return value


def _parameters(fn: Any) -> list[dict[str, Any]] | None:
    """The parameters of ``fn`` (name, kind, default when a JSON scalar), or None when
    ``inspect.signature`` cannot say."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except Exception:  # a signature of the student's own that raises
        return None
    found = []
    for p in parameters:
        entry: dict[str, Any] = {"name": str(p.name), "kind": p.kind.name}
        if p.default is not p.empty:
            entry["has_default"] = True
            if _scalar(p.default):
                entry["default"] = p.default
        found.append(entry)
    return found


def _scalar(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, bool, int))


def _fields(driven: Any) -> dict[str, Any]:
    """Every field of the adapter's result but its function, when a JSON scalar."""
    if dataclasses.is_dataclass(driven):
        items = {f.name: getattr(driven, f.name) for f in dataclasses.fields(driven)}
    else:
        items = dict(vars(driven))
    fields: dict[str, Any] = {}
    for name, value in items.items():
        if name != "fn" and _scalar(value):
            fields[name] = value[:_MESSAGE_LIMIT] if isinstance(value, str) else value
    return fields


def _load(request: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The callable the request names (None on an error), and the reply."""
    _student_file = sys.modules["_student_file"]
    path, name = str(request["path"]), str(request["name"])
    try:
        module, file_error = _student_file.run_student_file(_path(path))
    except _student_file.StudentFileError as exc:
        return None, {"error": "file", "message": _text(exc), "file_error": None}
    try:
        fn = getattr(module, name, None)
        found = callable(fn)
    except BaseException:  # a module __getattr__ of the student's own
        fn, found = None, False
    if not found:
        return None, {"error": "missing", "message": "", "file_error": file_error}
    fields: dict[str, Any] = {}
    if request.get("adapt"):
        _module_adapt = sys.modules.get("_module_adapt")
        if _module_adapt is None:
            message = f"the class adapter could not be loaded ({_ADAPTER_ERROR})"
            return None, {"error": "module", "message": message, "file_error": file_error}
        try:
            driven = _module_adapt.adapt_class(fn, causal=request.get("causal"))
        except _module_adapt.ModuleError as exc:
            return None, {"error": "module", "message": _text(exc), "file_error": file_error}
        except BaseException as exc:  # the student's class may raise anything
            message = f"driving the class raised {_student_file.raised(exc)}"
            return None, {"error": "module", "message": message, "file_error": file_error}
        fn, fields = driven.fn, _fields(driven)
    reply = {"params": _parameters(fn), "fields": fields, "file_error": file_error}
    return fn, reply


def _path(text: str) -> Any:
    from pathlib import Path

    return Path(text)


def _as_array(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    out = np.asarray(value, dtype=np.float64)
    if out.ndim == 0:
        raise TypeError("a single number is not attention's output")
    return out


def _result(value: Any) -> tuple[dict[str, Any], list[Any]]:
    """The reply for what the student's function returned."""
    arrays: list[Any] | None = None
    header: dict[str, Any] = {"items": None}
    if isinstance(value, (tuple, list)) and 0 < len(value) <= ITEMS_LIMIT:
        try:
            arrays = [_as_array(item) for item in value]
        except BaseException:  # the student's objects may raise anything
            arrays = None
        else:
            header = {"items": len(arrays), "container": type(value).__name__}
            if header["container"] not in ("tuple", "list"):
                header["container"] = "list" if isinstance(value, list) else "tuple"
    if arrays is None:
        try:
            arrays = [_as_array(value)]
        except BaseException:
            return {"returned": _type_name(value)}, []
        header = {"items": None}
    for array in arrays:
        if array.size > ARRAY_LIMIT:
            return {"too_large": list(array.shape)}, []
    return header, arrays


def _call(fn: Any, request: dict[str, Any], arrays: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    import numpy as np

    args = [_decode(v, arrays) for v in request.get("args", [])]
    kwargs = {str(k): _decode(v, arrays) for k, v in request.get("kwargs", {}).items()}
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            value = fn(*args, **kwargs)
    except BaseException as exc:  # the student's code may raise anything: it is a finding
        return {"raised": _type_name(exc), "message": _text(exc)}, []
    try:
        return _result(value)
    except BaseException:
        return {"returned": _type_name(value)}, []


_LSE_CANDIDATES = 4  # saved tensors sent back as candidates for L


def _flash(fn: Any, request: dict[str, Any], arrays: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Run a FlashAttention forward (and backward) on Q, K, V and dO: the reply."""
    import numpy as np
    import torch

    q, k, v = (torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in arrays[:3])
    d_out = torch.from_numpy(np.asarray(arrays[3], dtype=np.float32)) if len(arrays) > 3 else None
    causal = bool(request.get("causal"))
    autograd = isinstance(fn, type) and issubclass(fn, torch.autograd.Function)
    inputs = [x.requires_grad_(autograd) for x in (q, k, v)]
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            value = fn.apply(*inputs, causal) if autograd else fn(*inputs, causal)
    except BaseException as exc:  # the student's code may raise anything: it is a finding
        return {"raised": _type_name(exc), "message": _text(exc)}, []
    try:
        pair = isinstance(value, (tuple, list)) and len(value) > 0
        out = value[0] if pair else value
        if not isinstance(out, torch.Tensor) or out.ndim == 0:
            return {"returned": _type_name(value)}, []
        found: list[Any] = []
        if autograd:
            saved = getattr(getattr(out, "grad_fn", None), "saved_tensors", ()) or ()
            found = [t for t in saved if isinstance(t, torch.Tensor)]
        elif pair and len(value) > 1 and isinstance(value[1], torch.Tensor):
            found = [value[1]]
        lse = [t for t in found if tuple(t.shape) == tuple(q.shape[:-1])][:_LSE_CANDIDATES]
        sent = [_as_array(out), *(_as_array(t) for t in lse)]
    except BaseException:  # the student's objects may raise anything
        return {"returned": _type_name(value)}, []
    header: dict[str, Any] = {
        "flash": True,
        "autograd": autograd,
        "lse": len(lse),
        "grads": False,
        "backward_raised": None,
    }
    own = getattr(fn, "backward", None)
    if autograd and d_out is not None and own is not torch.autograd.Function.backward:
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                out.backward(d_out)  # type: ignore[no-untyped-call]
            grads = [x.grad for x in inputs]
            if all(isinstance(g, torch.Tensor) for g in grads):
                sent += [_as_array(g) for g in grads]
                header["grads"] = True
        except NotImplementedError:
            pass  # no backward yet (CS336's part (a))
        except BaseException as exc:  # the student's backward may raise anything
            header["backward_raised"] = f"{_type_name(exc)}: {_text(exc)}"
    for array in sent:
        if array.size > ARRAY_LIMIT:
            return {"too_large": list(array.shape)}, []
    return header, sent


def main(argv: list[str]) -> None:
    """Serve the judge on the pipes ``argv[1]`` (requests) and ``argv[2]`` (replies), then
    end at once (the student's threads and exit hooks must not keep the process alive);
    ``argv[3]`` = ``torch``: import torch before saying ready."""
    requests_fd, replies_fd = int(argv[1]), int(argv[2])
    for fd in (requests_fd, replies_fd):
        os.set_inheritable(fd, False)  # nothing the student's code starts inherits them
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # the student's torch.compile runs eagerly: compiling changes speed, not results
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import numpy  # noqa: F401  (imported before 'ready': the time counts the student's code only)

    if argv[3:4] == ["torch"]:  # the student's code will want it: its import is not theirs
        with contextlib.suppress(Exception):  # not installed, or broken: the student hears so
            import torch  # noqa: F401
    # the neighbours, by their plain names, before the student's folder goes on the path
    _student_file = importlib.import_module("_student_file")

    global _ADAPTER_ERROR
    try:
        importlib.import_module("_module_adapt")
    except Exception as exc:
        _ADAPTER_ERROR = _student_file.raised(exc)
    sys.stdout, sys.stderr = _Kept(1, _OUTPUT_KEPT), _Kept(2, _OUTPUT_KEPT)
    requests = _Requests(requests_fd)
    _send(replies_fd, {"ready": True})
    fn: Any = None
    try:
        while True:
            request, arrays = _receive(requests)
            if request.get("op") == "load":
                fn, reply = _load(request)
                _send(replies_fd, reply)
            elif request.get("op") == "call" and fn is not None:
                header, out = _call(fn, request, arrays)
                _send(replies_fd, header, out)
            elif request.get("op") == "flash" and fn is not None and len(arrays) >= 3:
                header, out = _flash(fn, request, arrays)
                _send(replies_fd, header, out)
            else:
                return
    except (EOFError, OSError, ValueError):
        return
    finally:
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
