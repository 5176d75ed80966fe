"""Reading a zip of submissions (Gradescope, Canvas and Moodle export them) safely.

A zip is outside input, and a hostile one tries to write outside the folder it is unpacked
into (``../../.bashrc``, an absolute path: "zip-slip"), to link to the teacher's files (a
symbolic link), or to fill the disk (a small file that unpacks to gigabytes: a "zip bomb").
:func:`extract` unpacks only regular files and folders whose cleaned names stay inside the
target, counts the entries and the bytes before unpacking and again while writing (a header
may lie about a size), refuses a file that unpacks to more than :data:`MAX_RATIO` times its
packed size, and leaves nothing behind when it refuses.

Example:
    >>> import io, tempfile, zipfile
    >>> from pathlib import Path
    >>> buffer = io.BytesIO()
    >>> with zipfile.ZipFile(buffer, "w") as z:
    ...     z.writestr("../evil.py", "x = 1")
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     zip_path = Path(tmp, "class.zip")
    ...     _ = zip_path.write_bytes(buffer.getvalue())
    ...     try:
    ...         extract(zip_path, Path(tmp, "out"))
    ...     except ArchiveError as error:
    ...         print(str(error)[:60])
    ...     Path(tmp, "out").exists()
    class.zip: the entry '../evil.py' would be written outside t
    False
"""

from __future__ import annotations

import shutil
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from qkv._format import visible
from qkv._read import size_text

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "MAX_FILE", "MAX_RATIO", "ArchiveError", "extract"]

MAX_ENTRIES = 20_000
"""The most entries (files and folders) a zip of submissions may hold."""
MAX_BYTES = 512 << 20
"""The most bytes its files may unpack to, all together."""
MAX_FILE = 16 << 20
"""The most bytes one file may unpack to."""
MAX_RATIO = 200
"""The most a file may grow when unpacked (a text file packs ~5×; a zip bomb ~1000×)."""
_CHUNK = 1 << 16


class ArchiveError(ValueError):
    """A zip that cannot be unpacked safely: one line that says why."""


def extract(path: Path, target: Path) -> None:
    """Unpack the zip ``path`` into the new folder ``target``, every name checked.

    Raises:
        ArchiveError: not a zip, or an entry that would leave ``target``, a link or a special
            file, too many entries, too many bytes, or a file packed too densely. ``target``
            is removed again.
    """
    name = visible(path.name)
    hint = "Hint: re-export the submissions from your course platform"
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise ArchiveError(f"{name}: not a readable zip file ({error}). {hint}") from None
    target.mkdir(parents=True)
    try:
        with archive:
            infos = archive.infolist()
            if len(infos) > MAX_ENTRIES:
                raise ArchiveError(
                    f"{name}: {len(infos)} entries, more than the {MAX_ENTRIES} qkv unpacks. {hint}"
                )
            declared = sum(i.file_size for i in infos)
            if declared > MAX_BYTES:
                raise ArchiveError(
                    f"{name}: its files unpack to {size_text(declared)}, more than "
                    f"{size_text(MAX_BYTES)}. {hint}"
                )
            total = 0
            for info in infos:
                total += _extract_one(archive, info, target, name, hint, MAX_BYTES - total)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


def _extract_one(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, name: str, hint: str, left: int
) -> int:
    """Unpack one entry; return the bytes written."""
    shown = visible(info.filename)
    if len(shown) > 120:
        shown = f"{shown[:70]}…{shown[-40:]}"
    parts = PurePosixPath(info.filename.replace("\\", "/")).parts
    if (
        not parts
        or info.filename.startswith(("/", "\\"))
        or ":" in parts[0]
        or any(p in ("..", "") for p in parts)
        or any("\x00" in p for p in parts)
    ):
        raise ArchiveError(
            f"{name}: the entry {shown!r} would be written outside the folder it is unpacked "
            f"into (an absolute path or '..'). {hint}"
        )
    kind = stat.S_IFMT(info.external_attr >> 16)  # 0 where the zip's maker set no type
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise ArchiveError(
            f"{name}: the entry {shown!r} is a link or a special file, not a file or a "
            f"folder. {hint}"
        )
    destination = target.joinpath(*[p for p in parts if p != "."])
    if info.is_dir():
        _make_folder(destination, name, shown, hint)
        return 0
    if info.file_size > MAX_FILE:
        raise ArchiveError(
            f"{name}: the entry {shown!r} unpacks to {size_text(info.file_size)}, more than "
            f"the {size_text(MAX_FILE)} of one submission's file. {hint}"
        )
    if info.file_size > MAX_RATIO * max(info.compress_size, 1024):
        raise ArchiveError(
            f"{name}: the entry {shown!r} unpacks to {info.file_size // max(info.compress_size, 1)}"
            f" times its packed size (a zip bomb?). {hint}"
        )
    _make_folder(destination.parent, name, shown, hint)
    if destination.is_dir():
        raise ArchiveError(
            f"{name}: the entry {shown!r} is a file where the zip also has a folder of that "
            f"name. {hint}"
        )
    if destination.exists():
        raise ArchiveError(f"{name}: the entry {shown!r} is in the zip twice. {hint}")
    limit = min(info.file_size, left)
    written = 0
    try:
        with archive.open(info) as source, destination.open("xb") as sink:
            while chunk := source.read(_CHUNK):
                written += len(chunk)
                if written > limit:  # the header lied about the size
                    raise ArchiveError(
                        f"{name}: the entry {shown!r} unpacks to more bytes than its header "
                        f"says. {hint}"
                    )
                sink.write(chunk)
    except (
        zipfile.BadZipFile,
        zlib.error,
        EOFError,
        NotImplementedError,
        RuntimeError,
        OSError,
    ) as error:
        raise ArchiveError(
            f"{name}: the entry {shown!r} cannot be unpacked ({_why(error)}). {hint}"
        ) from None
    return written


def _make_folder(folder: Path, name: str, shown: str, hint: str) -> None:
    """Make the folder an entry goes into; an entry whose folder cannot be made (a file of
    that name, a name too long for this file system) is one line naming the entry."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ArchiveError(
            f"{name}: the entry {shown!r} needs a folder where the zip has a file of the same "
            f"name. {hint}"
        ) from None
    except NotADirectoryError:
        raise ArchiveError(
            f"{name}: the entry {shown!r} is inside a name that the zip also uses for a file. "
            f"{hint}"
        ) from None
    except OSError as error:
        raise ArchiveError(
            f"{name}: the entry {shown!r} cannot be unpacked here ({_why(error)}). {hint}"
        ) from None


def _why(error: BaseException) -> str:
    """An error's reason without the temporary path it names."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return visible(" ".join(str(error).split()))[:200]
