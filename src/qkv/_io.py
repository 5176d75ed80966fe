"""Writing files atomically: a temporary file in the same folder, fsync, then a rename.

Every file qkv writes (a rendered explanation, a picture, a page, a trace, word vectors, a
checkpoint pointer) goes through :func:`write_atomic`, so the file holds either its old content
or all of the new one, even after a crash or Ctrl-C, and no temporary file stays behind.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "hello.txt")
    >>> write_atomic(path, "hello\\n")
    >>> open(path).read()
    'hello\\n'
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

__all__ = ["WriteError", "check_target", "write_atomic"]


class WriteError(OSError):
    """A file could not be written: the message names the file the user asked for (never a
    temporary file), says why and gives a hint. ``errno`` and ``filename`` are kept."""

    def __init__(self, target: Path, cause: OSError) -> None:
        code = cause.errno if cause.errno is not None else errno.EIO
        super().__init__(code, cause.strerror or str(cause), str(target))
        self.message = _explain_failure(target, cause)

    def __str__(self) -> str:
        return self.message


def _explain_failure(target: Path, cause: OSError) -> str:
    """One line: the file, what went wrong, and a hint."""
    folder = str(target.parent)
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        why, hint = "the disk is full", "free some space, or write to another disk"
    elif cause.errno == errno.EROFS:
        why, hint = "the file system is read-only", "write to another folder"
    elif cause.errno in (errno.EACCES, errno.EPERM):
        why = f"permission denied (the folder {folder!r} or the file is not writable)"
        hint = "choose a folder you can write to, e.g. your home folder"
    else:
        why = (cause.strerror or str(cause) or type(cause).__name__).rstrip(".")
        hint = "check the path and the disk"
    said = cause.strerror
    if said and said.lower() not in why.lower():
        why += f" ({said})"
    return f"cannot write {str(target)!r}: {why}. Hint: {hint}."


def check_target(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, or a ``ValueError`` (with a hint) when it cannot be a file we write.

    Raises:
        ValueError: ``path`` is a folder, or its folder does not exist.
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"cannot write {str(target)!r}: it is a folder. Hint: give a file name.")
    if not target.parent.is_dir():
        raise ValueError(
            f"cannot write {str(target)!r}: the folder {str(target.parent)!r} does not exist. "
            "Hint: create it first."
        )
    return target


def write_atomic(
    path: str | os.PathLike[str],
    data: str | bytes | Iterable[bytes],
    *,
    compress: bool = False,
) -> None:
    """Write ``data`` (text as UTF-8, bytes, or chunks of bytes) to ``path`` atomically.

    Args:
        path: the file to write; its folder must exist.
        data: a ``str`` (written as UTF-8, newlines kept as given), ``bytes``, or an iterable
            of ``bytes`` chunks (streamed, for large files).
        compress: gzip the bytes (reproducibly: no name, mtime 0).

    Raises:
        ValueError: ``path`` is a folder or its folder does not exist (see :func:`check_target`).
        WriteError: (an ``OSError``) the file cannot be written (no space, no permission):
            the message names ``path``, not a temporary file, and gives a hint; ``path`` is
            left as it was and no temporary file stays behind. An existing ``path`` that is
            not a regular file (``/dev/null``, a pipe) is written in place, not replaced.
    """
    target = check_target(path)
    chunks: Iterable[bytes]
    if isinstance(data, str):
        chunks = (data.encode("utf-8"),)
    elif isinstance(data, bytes):
        chunks = (data,)
    else:
        chunks = data
    if target.exists() and not target.is_file():
        _write_special(target, chunks, compress=compress)  # /dev/null, a pipe: no rename
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise WriteError(target, error) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            _copy(handle, chunks, compress=compress)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise WriteError(target, error) from None
        raise


def _write_special(target: Path, chunks: Iterable[bytes], *, compress: bool) -> None:
    """Write into an existing file that is not a regular one (a device such as /dev/null,
    a named pipe) in place: renaming over it would replace the device by a plain file."""
    try:
        with open(target, "wb") as handle:
            _copy(handle, chunks, compress=compress)
    except OSError as error:
        raise WriteError(target, error) from None


def _copy(handle: BinaryIO, chunks: Iterable[bytes], *, compress: bool) -> None:
    """Write ``chunks`` to ``handle``, gzipped (reproducibly: no name, mtime 0) or not."""
    if compress:
        with gzip.GzipFile(filename="", mode="wb", fileobj=handle, mtime=0, compresslevel=9) as out:
            for chunk in chunks:
                out.write(chunk)
    else:
        for chunk in chunks:
            handle.write(chunk)


def _mode_for(target: Path) -> int:
    """The permissions of the file being replaced, else the usual ones (0o666 minus umask)."""
    with contextlib.suppress(OSError):
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
