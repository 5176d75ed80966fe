"""Opening a word-vector file (plain or gzip) and telling its format from its first bytes.

The formats:

- ``word2vec``: a header line ``COUNT DIM``, then one line per word: the word and DIM numbers,
  separated by spaces.
- ``fasttext`` (``.vec``): the same layout as ``word2vec`` text.
- ``glove``: no header; every line is a word and its numbers, DIM = numbers on line 1.
- ``word2vec-binary``: the header line, then per word: the word, one space, DIM float32
  numbers (4 bytes each, little-endian), and usually a newline.

Detection: a first line of two whole numbers is a header. After a header, the next line
decides: if it is a word and DIM numbers, the file is text. Otherwise the DIM·4 bytes after
the first word decide: float32 data almost always holds control bytes (0x00-0x1f) or bytes
that are not text in the file's encoding; text that holds neither is read as text, so that
its bad line is reported.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from qkv._read import FileLimitError, check_regular, size_text
from qkv.embeddings._errors import EmbeddingsFileError

FORMATS: tuple[str, ...] = ("word2vec", "word2vec-binary", "glove", "fasttext")
"""The file formats :func:`qkv.embeddings.load` reads and :func:`qkv.embeddings.save` writes."""

HEADER_FORMATS = ("word2vec", "word2vec-binary", "fasttext")
MAX_LINE = 1 << 20  # the first line (a header or a GloVe line) is read up to this many bytes
PROBE = 1 << 16  # bytes after the header looked at to tell text from binary (at least)
MAX_DIM = 1 << 16
"""The most numbers per vector a header may claim (65,536): more is a damaged header, and
reading it would allocate memory for nothing."""
GZIP_RATIO = 50
"""A ``.gz`` file may unpack to at most this many times its size (word vectors compress
about 3:1), or :data:`GZIP_FLOOR`, whichever is larger: a gzip bomb stops with an error."""
GZIP_FLOOR = 1 << 26
BOM = codecs.BOM_UTF8
_GZIP_MAGIC = b"\x1f\x8b"
_HEADER = re.compile(rb"[ \t]*(\d+)[ \t]+(\d+)[ \t]*\r?\n?")
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 13)) + b"\x7f"


@dataclass(frozen=True)
class Header:
    """The first line of a word2vec, fastText or word2vec-binary file."""

    count: int
    dim: int
    size: int
    """Bytes of the header line, newline (and a UTF-8 byte-order mark) included."""


@dataclass(frozen=True)
class Detected:
    """A file's format, its header (None for GloVe) and why the format was chosen."""

    format: str
    header: Header | None
    reason: str


def open_file(path: Path, source: str | None = None) -> BinaryIO:
    """The file's bytes, decompressed when it is gzip (recognised by its magic bytes).

    Raises:
        EmbeddingsFileError: not a regular file (a directory, ``/dev/zero``, a pipe).
        OSError: the file does not exist or cannot be read.
    """
    where = source if source is not None else str(path)
    size = _regular_size(path, where)
    handle = path.open("rb")
    if handle.read(2) == _GZIP_MAGIC:
        handle.seek(0)
        raw = _Gunzip(handle, where, gzip_limit(size))
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=1 << 20))
    handle.seek(0)
    return handle


def gzip_limit(size: int) -> int:
    """The most bytes a ``.gz`` file of ``size`` bytes may unpack to."""
    return max(GZIP_FLOOR, GZIP_RATIO * size)


def data_size(path: Path, source: str) -> int:
    """An upper bound on the bytes a reader will see: the file's size, or for a ``.gz`` file
    the most it may unpack to. Claimed counts are checked against it before allocating."""
    size = _regular_size(path, source)
    with path.open("rb") as handle:
        gz = handle.read(2) == _GZIP_MAGIC
    return gzip_limit(size) if gz else size


def _regular_size(path: Path, source: str) -> int:
    try:
        return check_regular(path, what="a word-vector file")
    except FileLimitError as error:
        raise EmbeddingsFileError(error.problem, source=source, hint=error.hint) from None


class _Gunzip(io.RawIOBase):
    """The unpacked bytes of a gzip file, stopping with an :class:`EmbeddingsFileError` when
    they exceed ``limit`` (a gzip bomb) or the data is truncated or damaged."""

    def __init__(self, handle: BinaryIO, source: str, limit: int) -> None:
        super().__init__()
        self._handle = handle
        self._inner = gzip.GzipFile(fileobj=handle, mode="rb")
        self._source = source
        self._limit = limit
        self._total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._inner.read(len(view))
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise EmbeddingsFileError(
                f"the gzip data is truncated or damaged ({error})",
                source=self._source,
                hint="the file was cut short or changed (an interrupted download or copy?); "
                "download it again, or check it with 'gzip -t'",
            ) from None
        self._total += len(data)
        if self._total > self._limit:
            raise EmbeddingsFileError(
                f"the gzip file unpacks to more than {size_text(self._limit)}, over "
                f"{GZIP_RATIO} times its size: word vectors do not compress that well",
                source=self._source,
                offset=self._limit,
                hint="is this the right file? If it is, unpack it first (gunzip) and load that",
            )
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
            self._handle.close()
        super().close()


def parse_header(line: bytes) -> Header | None:
    """The header ``COUNT DIM`` of a first line, or None when the line is not one."""
    body = line[len(BOM) :] if line.startswith(BOM) else line
    match = _HEADER.fullmatch(body)
    if match is None:
        return None
    return Header(count=int(match[1]), dim=int(match[2]), size=len(line))


def encoded(words: Iterable[str], encoding: str) -> set[bytes]:
    """The words as bytes of ``encoding``, less those it cannot write (none of them can be
    in a file of that encoding)."""
    out = set()
    for word in words:
        with contextlib.suppress(UnicodeEncodeError):
            out.add(word.encode(encoding))
    return out


def show(raw: bytes, limit: int = 40) -> str:
    """Bytes from the file as a short quoted text for a message."""
    text = raw.decode("utf-8", "backslashreplace")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return f"'{text}'"


def detect(path: Path, source: str, *, encoding: str) -> Detected:
    """Tell the format of a word-vector file from its first line and the bytes after it.

    Raises:
        EmbeddingsFileError: the file is empty, or its header says DIM = 0.
    """
    with open_file(path, source) as handle:
        first = handle.readline(MAX_LINE)
        header = parse_header(first)
        if header is not None:
            check_header(header, source)  # before reading a probe sized by DIM
        probe = handle.read(max(PROBE, 32 * header.dim + 4096) if header else 0)
    if not first:
        raise EmbeddingsFileError(
            "the file is empty",
            source=source,
            hint="a word-vector file has one line per word: the word and its numbers",
        )
    if header is None:
        return Detected("glove", None, "line 1 is not a header 'COUNT DIM'")
    check_header(header, source)
    if looks_binary(probe, header.dim, encoding=encoding):
        return Detected(
            "word2vec-binary", header, "the bytes after the header are not text (float32 data)"
        )
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    text_format = "fasttext" if name.endswith(".vec") else "word2vec"
    return Detected(text_format, header, "line 1 is a header 'COUNT DIM' and the lines are text")


def check_header(header: Header, source: str) -> None:
    if header.dim < 1:
        raise EmbeddingsFileError(
            f"the header says each vector has DIM = {header.dim} numbers",
            source=source,
            line=1,
            hint="the header is 'COUNT DIM', e.g. '400000 300'; DIM must be at least 1",
        )
    if header.dim > MAX_DIM:
        raise EmbeddingsFileError(
            f"the header says each vector has DIM = {header.dim:,} numbers; qkv reads at "
            f"most {MAX_DIM:,}",
            source=source,
            line=1,
            hint="the header is 'COUNT DIM', e.g. '400000 300'; this one looks damaged",
        )


def looks_binary(probe: bytes, dim: int, *, encoding: str) -> bool:
    """Whether the bytes after a header hold float32 vectors rather than text lines."""
    body = probe.lstrip(b"\n")
    lines = body.split(b"\n")
    # Every complete line of the probe (up to 32; the probe may cut its last line) must read
    # as a text vector line: float32 bytes can look like one line of text by chance.
    complete = [line for line in lines[:-1] if line.strip()][:32] or lines[:1]
    if all(_text_vector_line(line, dim) for line in complete):
        return False
    space = body.find(b" ")
    region = body[space + 1 : space + 1 + 4 * dim] if space >= 0 else body
    if len(region.translate(None, _CONTROL)) < len(region):
        return True
    after = space + 1 + 4 * dim
    if space >= 0 and b"\n" not in region and body[after : after + 1] == b"\n":
        return True  # not numbers, but exactly 4·DIM bytes then a newline: float32 data
    # All of the region, not only up to its first newline: float32 data may hold 0x0A (0.02
    # is 0A D7 A3 3C), and the bytes after it are then what is not text.
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    try:
        decoder.decode(region, final=False)
    except UnicodeDecodeError:
        return True
    return False


def _text_vector_line(line: bytes, dim: int) -> bool:
    fields = line.split()
    return len(fields) > dim and all(number(f) is not None for f in fields[-dim:])


def number(field: bytes) -> float | None:
    """A number field as a float, or None if it is not one (digits with ``_`` are refused)."""
    if b"_" in field:
        return None
    try:
        return float(field)
    except ValueError:
        return None
