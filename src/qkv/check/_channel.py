"""The judge's end of the channel to the student's process (:mod:`~qkv.check._student_main`
is the other end; the message format is written there).

:class:`Channel` writes a request to one pipe and reads the reply from the other, each with
a deadline (``select`` on the pipe and on the sandbox's process), and checks every size
before it reads or allocates: a header line of at most :data:`HEADER_LIMIT` bytes that is a
JSON object, at most :data:`ITEMS_LIMIT` arrays, each of float64 with at most
:data:`ARRAY_LIMIT` numbers and :data:`NDIM_LIMIT` axes. Anything else is a
:class:`ChannelError` (``garbage``): the student's code shares the runner's process and may
write to the pipe, so a reply is only ever numbers, checked like any return.
"""

from __future__ import annotations

import errno
import json
import math
import os
import select
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ARRAY_LIMIT",
    "HEADER_LIMIT",
    "ITEMS_LIMIT",
    "NDIM_LIMIT",
    "Channel",
    "ChannelError",
    "Clock",
]

HEADER_LIMIT = 64 << 10
"""Bytes of a reply's header line."""
ARRAY_LIMIT = 100_000
"""Numbers in one array of a reply (the probes' outputs have fewer than 200)."""
ITEMS_LIMIT = 8
"""Arrays in one reply."""
NDIM_LIMIT = 8
"""Axes of one array of a reply."""
_DTYPES = {"float64", "float32", "int64", "bool"}


class ChannelError(Exception):
    """The channel failed: ``why`` is ``garbage`` (not what the runner sends), ``ended`` (the
    student's process is gone) or ``timeout`` (the deadline passed)."""

    def __init__(self, why: str, detail: str = "") -> None:
        super().__init__(detail or why)
        self.why = why
        self.detail = detail


@dataclass
class Clock:
    """The time the student's code has used, measured here: from each request sent to its
    reply read, summed, against ``budget`` seconds."""

    budget: float
    used: float = 0.0
    calls: int = 0

    def left(self) -> float:
        return self.budget - self.used


class Channel:
    """Requests to ``requests`` (a pipe's write end), replies from ``replies`` (a read end);
    ``ended`` is a descriptor that becomes readable when the sandbox's process ends (a
    pidfd), or None (then the pipe's end of file says so)."""

    def __init__(self, requests: int, replies: int, ended: int | None) -> None:
        self._requests = requests
        self._replies = replies
        self._ended = ended
        self._buffer = b""
        os.set_blocking(requests, False)
        os.set_blocking(replies, False)

    def send(self, header: dict[str, Any], arrays: Sequence[NDArray[Any]], deadline: float) -> None:
        """Write one request (``arrays`` as their own dtypes) before ``deadline``.

        Raises:
            ChannelError: the process ended, or stopped reading until the deadline.
        """
        specs = [{"shape": list(a.shape), "dtype": a.dtype.name} for a in arrays]
        line = json.dumps({**header, "arrays": specs}).encode() + b"\n"
        body = b"".join(a.astype(a.dtype.newbyteorder("<")).tobytes() for a in arrays)
        data = memoryview(line + body)
        while data:
            self._wait(self._requests, deadline, write=True)
            try:
                data = data[os.write(self._requests, data) :]
            except BlockingIOError:
                continue
            except OSError as exc:  # EPIPE: nobody reads any more
                raise ChannelError("ended", os.strerror(exc.errno or errno.EPIPE)) from None

    def receive(self, deadline: float) -> tuple[dict[str, Any], list[NDArray[np.float64]]]:
        """Read one reply before ``deadline``: its header (a JSON object) and its arrays.

        Raises:
            ChannelError: not what the runner sends, the process ended, or the deadline passed.
        """
        line = self._line(deadline)
        try:
            header = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ChannelError("garbage", "a header that is not JSON") from None
        if not isinstance(header, dict):
            raise ChannelError("garbage", "a header that is not a JSON object")
        specs = header.get("arrays", [])
        if not isinstance(specs, list) or len(specs) > ITEMS_LIMIT:
            raise ChannelError("garbage", f"not a list of at most {ITEMS_LIMIT} arrays")
        shapes = [_shape(spec) for spec in specs]
        arrays = []
        for shape in shapes:
            data = self._exactly(math.prod(shape) * 8, deadline)
            arrays.append(np.frombuffer(data, dtype="<f8").astype(np.float64).reshape(shape))
        return header, arrays

    def _line(self, deadline: float) -> bytes:
        while b"\n" not in self._buffer:
            if len(self._buffer) > HEADER_LIMIT:
                raise ChannelError("garbage", f"a header longer than {HEADER_LIMIT} bytes")
            self._more(deadline)
        line, _, self._buffer = self._buffer.partition(b"\n")
        if len(line) > HEADER_LIMIT:
            raise ChannelError("garbage", f"a header longer than {HEADER_LIMIT} bytes")
        return line

    def _exactly(self, count: int, deadline: float) -> bytes:
        while len(self._buffer) < count:
            self._more(deadline)
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data

    def _more(self, deadline: float) -> None:
        self._wait(self._replies, deadline, write=False)
        try:
            data = os.read(self._replies, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            raise ChannelError("ended", "the channel was closed")
        self._buffer += data

    def _wait(self, fd: int, deadline: float, *, write: bool) -> None:
        """Until ``fd`` is ready; the process's end counts only when the pipe is not."""
        watched = [self._ended] if self._ended is not None else []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelError("timeout")
            readable, writable, _ = select.select(
                watched if write else [fd, *watched], [fd] if write else [], [], min(left, 0.5)
            )
            if fd in readable or fd in writable:
                return
            if watched and watched[0] in readable:
                raise ChannelError("ended", "the process ended")


def _shape(spec: object) -> tuple[int, ...]:
    if not isinstance(spec, dict) or spec.get("dtype") != "float64":
        raise ChannelError("garbage", "an array that is not float64")
    shape = spec.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > NDIM_LIMIT
        or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= ARRAY_LIMIT for n in shape
        )
    ):
        raise ChannelError("garbage", "an array's shape is not a short list of sizes")
    if math.prod(n for n in shape) > ARRAY_LIMIT:
        raise ChannelError("garbage", f"an array of more than {ARRAY_LIMIT} numbers")
    return tuple(shape)
