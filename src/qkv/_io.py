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
import gzip
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["check_target", "write_atomic"]


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
        OSError: the file cannot be written; ``path`` is left as it was.
    """
    target = check_target(path)
    chunks: Iterable[bytes]
    if isinstance(data, str):
        chunks = (data.encode("utf-8"),)
    elif isinstance(data, bytes):
        chunks = (data,)
    else:
        chunks = data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            if compress:
                with gzip.GzipFile(
                    filename="", mode="wb", fileobj=handle, mtime=0, compresslevel=9
                ) as packed:
                    for chunk in chunks:
                        packed.write(chunk)
            else:
                for chunk in chunks:
                    handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(target: Path) -> int:
    """The permissions of the file being replaced, else the usual ones (0o666 minus umask)."""
    with contextlib.suppress(OSError):
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
