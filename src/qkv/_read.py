"""Reading the files qkv is given, with bounds: regular files only, a size limit, JSON depth.

Every reader of a user's file (worked examples, traces, data files, checkpoints) goes through
:func:`read_bytes`, so ``/dev/zero``, a pipe or a 50 GB file is refused at once with one line
instead of filling the memory, and through :func:`json_value` / :func:`json_lines`, so JSON
nested thousands deep is an error, not a ``RecursionError``. The errors are
:class:`FileLimitError` (a ``ValueError``) with the problem and a hint; each reader adds the
file's name in its own error type.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "small.json"
    >>> _ = path.write_text('{"a": 1}')
    >>> json_value(read_bytes(path, limit=100, what="a JSON file").decode())
    {'a': 1}
    >>> try:
    ...     read_bytes(path, limit=4, what="a JSON file")
    ... except FileLimitError as error:
    ...     print(error.problem)
    the file holds 8 bytes, more than the 4 bytes a JSON file may hold
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["FileLimitError", "json_lines", "json_value", "read_bytes", "size_text"]


class FileLimitError(ValueError):
    """A file qkv refuses to read: not a regular file, too large, or nested too deeply.

    Attributes:
        problem: what is wrong, without the file's name.
        hint: how to fix it.
    """

    def __init__(self, problem: str, hint: str) -> None:
        self.problem = problem
        self.hint = hint
        super().__init__(f"{problem}. Hint: {hint}")


def size_text(size: int) -> str:
    """A byte count for a message: ``"512 bytes"``, ``"3.2 MB"``, ``"1.0 GB"``."""
    if size < 1000:
        return f"{size} bytes"
    for unit, factor in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12)):
        if size < factor * 1000 or unit == "TB":
            return f"{size / factor:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def check_regular(path: str | os.PathLike[str], *, what: str) -> int:
    """The size of ``path`` in bytes, after checking that it is a regular file.

    Raises:
        FileLimitError: a directory, a device (``/dev/zero``), a pipe or a socket.
        OSError: the file does not exist or cannot be looked at.
    """
    info = os.stat(path)
    if stat.S_ISDIR(info.st_mode):
        raise FileLimitError(f"is a directory, not {what}", f"give the path of {what}")
    if not stat.S_ISREG(info.st_mode):
        raise FileLimitError(
            "is not a regular file (a device, a pipe or a socket)",
            f"give the path of {what} saved on disk",
        )
    return info.st_size


def read_bytes(path: str | os.PathLike[str], *, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, read with that bound.

    Args:
        path: the file.
        limit: the most bytes the file may hold.
        what: the kind of file, for messages (``"a worked example"``).

    Raises:
        FileLimitError: not a regular file, or larger than ``limit``.
        OSError: the file does not exist or cannot be read.
    """
    size = check_regular(path, what=what)
    with Path(path).open("rb") as handle:
        data = handle.read(limit + 1)
    size = max(size, len(data))
    if size > limit:
        raise FileLimitError(
            f"the file holds {size_text(size)}, more than the {size_text(limit)} {what} may hold",
            f"is this the right file? qkv reads {what} of up to {size_text(limit)}",
        )
    return data


def json_value(text: str) -> Any:
    """``json.loads(text)``, with a clear error for data nested too deeply to read.

    Raises:
        json.JSONDecodeError: the text is not valid JSON.
        FileLimitError: lists or objects nested too deeply (thousands of levels).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise FileLimitError(
            "the JSON is nested too deeply to read (thousands of levels of [ or {)",
            "is this the right file? qkv's files nest a few levels deep",
        ) from None


def json_lines(text: str) -> list[tuple[int, str]]:
    """The lines of a JSON Lines text with their 1-based numbers.

    Lines end at ``\\n`` (and ``\\r\\n``) only: U+2028, U+2029 and the other characters that
    :meth:`str.splitlines` also breaks at are valid inside a JSON string.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [(number, line.removesuffix("\r")) for number, line in enumerate(lines, start=1)]
