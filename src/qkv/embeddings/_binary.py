"""The word2vec binary format: a text header ``COUNT DIM``, then per word the word, one
space, and DIM float32 numbers (4 bytes each, little-endian), usually followed by a newline.

The file is read in chunks; problems are reported with the byte offset where they start.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np

from qkv.embeddings._errors import EmbeddingsFileError
from qkv.embeddings._rows import Rows
from qkv.embeddings._source import MAX_LINE, check_header, encoded, parse_header, show
from qkv.embeddings._vectors import FloatMatrix

CHUNK = 1 << 22  # bytes read at a time
MAX_WORD = 1 << 16  # a word longer than this means the file is not what it claims
QUICK_WORD = 256  # words up to this long take the quick path
BATCH = 4096  # vectors converted together
_TEXT = bytes(range(32, 127)) + b"\t\n\r"


class BinaryReader:
    """Reads one word2vec binary file: the options, and what has been read so far."""

    def __init__(
        self,
        handle: BinaryIO,
        *,
        source: str,
        encoding: str = "utf-8",
        unicode_errors: str = "strict",
        duplicates: str = "error",
        limit: int | None = None,
        wanted: frozenset[str] | None = None,
        size_hint: int | None = None,
    ) -> None:
        self.source = source
        self.encoding = encoding
        self.unicode_errors = unicode_errors
        self.duplicates = duplicates
        self.limit = limit
        self.wanted = wanted
        self.size_hint = size_hint  # the bytes the file holds at most: bounds the rows
        self.words: list[str] = []
        self.offsets: list[int] = []  # where each word starts, for messages
        self.index: dict[str, int] = {}
        self.scanned = 0  # vectors met in the file (wanted or not)
        self._handle = handle
        self._buf = b""
        self._pos = 0
        self._base = 0  # file offset of _buf[0]
        self._eof = False

    def read(self) -> tuple[list[str], FloatMatrix]:
        first = self._handle.readline(MAX_LINE)
        header = parse_header(first)
        if header is None:
            raise EmbeddingsFileError(
                f"expected the header 'COUNT DIM', got {show(first.strip())}",
                source=self.source,
                line=1,
                hint="a word2vec binary file starts with a text line such as '400000 300'",
            )
        check_header(header, self.source)
        dim, count = header.dim, header.count
        size = 4 * dim
        target = count if self.limit is None else min(count, self.limit)
        capacity = target if self.wanted is None else min(target, len(self.wanted))
        if self.size_hint is not None:  # an entry is ≥ 4·D + 2 bytes: a header of 10¹² rows
            capacity = min(capacity, self.size_hint // (size + 2) + 1)  # allocates nothing
        rows = Rows(dim, capacity)
        wanted = None if self.wanted is None else encoded(self.wanted, self.encoding)
        self._base = len(first)
        pending: list[bytes] = []
        words, offsets, index = self.words, self.offsets, self.index
        buf, pos = self._buf, self._pos
        while self.scanned < target and (wanted is None or wanted):
            # The quick path: one newline at most, a short word, all of the entry in the buffer.
            if buf[pos : pos + 1] == b"\n":
                pos += 1
            space = buf.find(b" ", pos, pos + QUICK_WORD)
            end = space + 1 + size
            if space <= pos or end > len(buf) or buf[pos] == 10 or self.scanned == 0:
                self._pos = pos
                pos, space = self._locate(size, count)  # more data, or a problem to report
                buf = self._buf
                end = space + 1 + size
            raw_word = buf[pos:space]
            start, pos = pos, end
            self.scanned += 1
            if wanted is not None:
                if raw_word not in wanted:
                    continue
                wanted.discard(raw_word)
            try:
                word = raw_word.decode(self.encoding, self.unicode_errors)
            except UnicodeDecodeError as error:
                raise self._not_text(raw_word, error, self._base + start) from None
            if word in index or (self.wanted is not None and word not in self.wanted):
                if not self._keep(word, self._base + start):
                    continue
            else:
                index[word] = len(words)
                words.append(word)
                offsets.append(self._base + start)
            pending.append(buf[space + 1 : end])
            if len(pending) == BATCH:
                rows.add(_floats(pending, dim))
                pending = []
        self._pos = pos
        if pending:
            rows.add(_floats(pending, dim))
        if self.scanned == count and (self.limit is None or self.limit > count):
            self._check_end(count)
        matrix = rows.result()
        self._check_finite(matrix)
        return self.words, matrix

    def _locate(self, size: int, count: int) -> tuple[int, int]:
        """The next entry, read with care: (where its word starts, where the space after it
        is) in the buffer, after reading more of the file if needed; or an error."""
        self._ensure(256 + size + 2)
        self._skip_newlines(256 + size + 2)
        if self._pos >= len(self._buf):
            raise self._ended(count)
        space = self._find_space(self._pos)
        word_len = space - self._pos
        self._ensure(word_len + 2 + size)
        start = self._pos
        space = start + word_len
        raw_word = self._buf[start:space]
        vector = self._buf[space + 1 : space + 1 + size]
        # Printable bytes are text, unless exactly DIM float32s and a newline follow the word.
        laid_out = self._buf[space + 1 + size : space + 2 + size] == b"\n" and b"\n" not in vector
        if self.scanned == 0 and vector and not vector.translate(None, _TEXT) and not laid_out:
            raise EmbeddingsFileError(
                f"the vector of {show(raw_word)} is printable text, not float32 numbers",
                source=self.source,
                offset=self._base + space + 1,
                hint="this looks like a text file: format='word2vec' or format='auto'",
            )
        if len(vector) < size:
            raise EmbeddingsFileError(
                f"the file ends in the middle of the vector of {show(raw_word)}: "
                f"{len(vector)} of {size} bytes ({size // 4} float32 numbers)",
                source=self.source,
                offset=self._base + space + 1,
                hint="the file is truncated (an interrupted download or copy?); "
                f"limit={self.scanned} reads the vectors before it",
            )
        return start, space

    # -- the buffer -----------------------------------------------------------------------

    def _ensure(self, n: int) -> None:
        """Make ``n`` bytes from the current position available, if the file has them."""
        have = len(self._buf) - self._pos
        if have >= n or self._eof:
            return
        parts = [self._buf[self._pos :]]
        while have < n:
            piece = self._handle.read(max(CHUNK, n - have))
            if not piece:
                self._eof = True
                break
            parts.append(piece)
            have += len(piece)
        self._base += self._pos
        self._buf = b"".join(parts)
        self._pos = 0

    def _skip_newlines(self, window: int) -> None:
        while True:
            while self._buf[self._pos : self._pos + 1] == b"\n":  # a run at C speed, not per byte
                piece = self._buf[self._pos : self._pos + (1 << 16)]
                self._pos += len(piece) - len(piece.lstrip(b"\n"))
            if self._pos < len(self._buf) or self._eof:
                return
            self._ensure(window)

    def _find_space(self, start: int) -> int:
        space = self._buf.find(b" ", start, start + MAX_WORD)
        while space < 0:
            have = len(self._buf) - self._pos
            if have >= MAX_WORD or self._eof:
                where = self._base + start
                if self._eof and have < MAX_WORD:
                    raise EmbeddingsFileError(
                        f"the file ends inside a word ({show(self._buf[start:])})",
                        source=self.source,
                        offset=where,
                        hint="the file is truncated (an interrupted download or copy?); "
                        f"limit={self.scanned} reads the vectors before it",
                    )
                raise EmbeddingsFileError(
                    f"no space after a word within {MAX_WORD} bytes",
                    source=self.source,
                    offset=where,
                    hint="is this a word2vec binary file? Each word ends with a space, then "
                    "its float32 numbers follow",
                )
            shift = start - self._pos
            self._ensure(have + CHUNK)
            start = self._pos + shift
            space = self._buf.find(b" ", start, start + MAX_WORD)
        if space == start:
            raise EmbeddingsFileError(
                "an empty word (a space where a word should start)",
                source=self.source,
                offset=self._base + start,
                hint="the header's DIM may be wrong, or the file is damaged",
            )
        return space

    # -- checks ---------------------------------------------------------------------------

    def _not_text(self, raw: bytes, error: UnicodeDecodeError, offset: int) -> EmbeddingsFileError:
        return EmbeddingsFileError(
            f"the word {show(raw)} is not valid {self.encoding} (byte 0x{raw[error.start]:02x})",
            source=self.source,
            offset=offset + error.start,
            hint="pass encoding='latin-1' (or the file's encoding), or "
            "unicode_errors='replace' to read the word with U+FFFD in place of the bad bytes",
        )

    def _keep(self, word: str, offset: int) -> bool:
        """Whether to keep a word that is unwanted or seen before (duplicates='first': no)."""
        if self.wanted is not None and word not in self.wanted:
            return False
        if word in self.index:
            if self.duplicates == "error":
                raise EmbeddingsFileError(
                    f"the word {word!r} appears again (first at byte "
                    f"{self.offsets[self.index[word]]})",
                    source=self.source,
                    offset=offset,
                    hint="each word must have one vector; duplicates='first' keeps the first "
                    "vector of each word",
                )
            return False
        self.index[word] = len(self.words)
        self.words.append(word)
        self.offsets.append(offset)
        return True

    def _ended(self, count: int) -> EmbeddingsFileError:
        return EmbeddingsFileError(
            f"the file ends after {self.scanned} vectors, but the header (line 1) says {count}",
            source=self.source,
            offset=self._base + self._pos,
            hint="the file may be truncated (an interrupted download?); "
            f"limit={self.scanned} reads the vectors that are there",
        )

    def _check_end(self, count: int) -> None:
        self._ensure(MAX_WORD)
        self._skip_newlines(MAX_WORD)
        if self._pos < len(self._buf):
            raise EmbeddingsFileError(
                f"more data after the {count} vectors the header (line 1) says",
                source=self.source,
                offset=self._base + self._pos,
                hint=f"fix the count in the header, or read the first {count} with limit={count}",
            )

    def _check_finite(self, matrix: FloatMatrix) -> None:
        finite = np.isfinite(matrix).all(axis=1)
        if finite.all():
            return
        row = int(np.flatnonzero(~finite)[0])
        raise EmbeddingsFileError(
            f"the vector of {self.words[row]!r} holds nan or inf",
            source=self.source,
            offset=self.offsets[row],
            hint="word vectors must be finite; the file may be damaged",
        )


def _floats(vectors: list[bytes], dim: int) -> FloatMatrix:
    floats = np.frombuffer(b"".join(vectors), dtype="<f4").reshape(-1, dim)
    return floats.astype(np.float32, copy=False)
