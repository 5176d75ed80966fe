"""The text formats (word2vec text, fastText ``.vec``, GloVe): read line by line, in blocks.

Each block of lines is read twice at most: a fast pass converts all its numbers at once with
NumPy's C parser; if anything in the block is unusual (a bad number, a ragged line, a word
with spaces, a bad encoding), the careful pass :func:`parse_line` reads it line by line, and
either reports the first problem with its line number or reads the unusual-but-valid lines.
The careful pass is the reference: on valid files both give the same result (tested).

A line is a word, then D numbers, separated by ASCII whitespace. A word cannot hold ASCII
whitespace, except that a line with more than D + 1 fields whose extra leading fields are
not numbers is read as a word with spaces (GloVe's Common Crawl files have a few).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from qkv.embeddings._errors import EmbeddingsFileError
from qkv.embeddings._rows import Rows
from qkv.embeddings._source import BOM, MAX_LINE, check_header, encoded, number, parse_header, show
from qkv.embeddings._vectors import FloatMatrix

BLOCK_BYTES = 1 << 22  # lines are read in blocks of about this many bytes
MAX_TEXT_LINE = 1 << 24  # a line longer than this (16 MiB) is not a word vector


@dataclass
class TextReader:
    """Reads one text file: the options, and what has been read so far."""

    source: str
    encoding: str = "utf-8"
    unicode_errors: str = "strict"
    duplicates: str = "error"
    limit: int | None = None
    wanted: frozenset[str] | None = None
    size_hint: int | None = None  # the file size, when known: bounds the rows to allocate
    dim: int = 0
    words: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the line of each word, for messages
    index: dict[str, int] = field(default_factory=dict)
    scanned: int = 0  # vectors met in the file (wanted or not)
    header_line: str = ""  # how D was set, for messages

    def read(self, handle: BinaryIO, *, header: bool, auto: bool) -> tuple[list[str], FloatMatrix]:
        """Read the file from its start; ``header``: it begins with ``COUNT DIM``."""
        first = handle.readline(MAX_LINE)
        found = parse_header(first)
        pending: list[bytes] = []
        if header:
            if found is None:
                raise self._not_a_header(first)
            check_header(found, self.source)
            self.dim, count, line_no = found.dim, found.count, 1
            self.header_line = f"the header on line 1 says D = {self.dim}"
        else:
            if found is not None and not auto:
                raise EmbeddingsFileError(
                    f"line 1 is a header {show(first.strip())}, but the GloVe format has none",
                    source=self.source,
                    line=1,
                    hint="for a file with a 'COUNT DIM' header use format='word2vec' "
                    "(or format='auto')",
                )
            first = first.removeprefix(BOM)
            self.dim = self._glove_dim(first, auto=auto)
            self.header_line = f"line 1 has {self.dim}, which sets D"
            count, line_no, pending = -1, 0, [first]
        target = count if count >= 0 else None
        if self.limit is not None:
            target = self.limit if target is None else min(target, self.limit)
        rows = Rows(self.dim, self._capacity(target))
        wanted_bytes = None if self.wanted is None else encoded(self.wanted, self.encoding)
        done = wanted_bytes is not None and not wanted_bytes
        for block, first_line in self._blocks(handle, pending, line_no + 1):
            if done:
                break
            kept: list[tuple[int, bytes]] = []
            for offset, raw in enumerate(block):
                if raw[:1] in b" \t\r\n" and not raw.strip():
                    continue  # a blank line
                number = first_line + offset
                if target is not None and self.scanned == target:
                    if target == count and (self.limit is None or self.limit > count):
                        raise self._too_many(count, number)
                    done = True
                    break
                self.scanned += 1
                if wanted_bytes is not None:
                    word = raw.partition(b" ")[0]
                    if word not in wanted_bytes:
                        continue
                    wanted_bytes.discard(word)
                kept.append((number, raw))
                if wanted_bytes is not None and not wanted_bytes:
                    done = True
                    break
            if kept:
                self._add(rows, kept)
            if done:
                break
        if not done and count >= 0 and self.scanned < (target if target is not None else count):
            raise EmbeddingsFileError(
                f"the file ends after {self.scanned} vectors, but the header (line 1) says {count}",
                source=self.source,
                hint="the file may be truncated (an interrupted download?); "
                f"limit={self.scanned} reads the vectors that are there",
            )
        return self.words, rows.result()

    # -- blocks and lines ---------------------------------------------------------------

    def _blocks(
        self, handle: BinaryIO, pending: list[bytes], first_line: int
    ) -> Iterator[tuple[list[bytes], int]]:
        """Blocks of lines with the line number of their first line."""
        if pending:
            yield pending, first_line
            first_line += len(pending)
        rest = b""
        while True:  # read in blocks and cut at newlines: a line never grows without bound
            chunk = handle.read(BLOCK_BYTES)
            data = rest + chunk if rest else chunk
            if not chunk:
                if data:
                    yield [data], first_line
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                if len(data) > MAX_TEXT_LINE:
                    raise EmbeddingsFileError(
                        f"the line is longer than {MAX_TEXT_LINE:,} bytes",
                        source=self.source,
                        line=first_line,
                        hint="a line is a word and its numbers; is this a word-vector file?",
                    )
                rest = data
                continue
            rest = data[cut:]
            if not data[:cut].strip():  # blank lines only: skipped at C speed, not one by one
                first_line += data.count(b"\n", 0, cut)
                continue
            block = io.BytesIO(data[:cut]).readlines()
            yield block, first_line
            first_line += len(block)

    def _add(self, rows: Rows, kept: list[tuple[int, bytes]]) -> None:
        parsed = self._parse_fast(kept)
        if parsed is None:
            words: list[str] = []
            vectors = np.empty((len(kept), self.dim), dtype=np.float32)
            for i, (number, raw) in enumerate(kept):
                word, vector = parse_line(raw, number, self)
                words.append(word)
                vectors[i] = vector
        else:
            words, vectors = parsed
        keep = np.ones(len(words), dtype=bool)
        for i, word in enumerate(words):
            if self.wanted is not None and word not in self.wanted:
                keep[i] = False
                continue
            row = self.index.get(word)
            if row is not None:
                if self.duplicates == "error":
                    raise EmbeddingsFileError(
                        f"the word {word!r} appears again (first on line {self.lines[row]})",
                        source=self.source,
                        line=kept[i][0],
                        hint="each word must have one vector; duplicates='first' keeps "
                        "the first vector of each word",
                    )
                keep[i] = False
                continue
            self.index[word] = len(self.words)
            self.words.append(word)
            self.lines.append(kept[i][0])
        rows.add(vectors if keep.all() else vectors[keep])

    def _parse_fast(self, kept: list[tuple[int, bytes]]) -> tuple[list[str], FloatMatrix] | None:
        """All lines of a block at once, or None if any line needs the careful pass."""
        words: list[str] = []
        rests: list[bytes] = []
        try:
            for _, raw in kept:
                word, space, rest = raw.partition(b" ")
                if not word or not space or b"\t" in word:
                    return None
                words.append(word.decode(self.encoding, self.unicode_errors))
                rests.append(rest if rest.endswith(b"\n") else rest + b"\n")
            vectors = np.loadtxt(
                io.BytesIO(b"".join(rests)),
                dtype=np.float32,
                comments=None,
                ndmin=2,
                encoding="latin-1",
            )
        except (UnicodeDecodeError, ValueError):
            return None
        if vectors.shape != (len(kept), self.dim) or not np.isfinite(vectors).all():
            return None
        return words, vectors

    # -- messages and small helpers -------------------------------------------------------

    def _glove_dim(self, first: bytes, *, auto: bool) -> int:
        fields = first.split()
        if len(fields) >= 2 and all(number(f) is not None for f in fields[1:]):
            return len(fields) - 1
        problem = (
            "line 1 is neither a word2vec/fastText header 'COUNT DIM' nor a GloVe line "
            f"(a word and its numbers): {show(first.strip())}"
            if auto
            else f"expected a word and its numbers, got {show(first.strip())}"
        )
        raise EmbeddingsFileError(
            problem,
            source=self.source,
            line=1,
            hint="is this a word-vector file? A binary word2vec file starts with a header",
        )

    def _not_a_header(self, first: bytes) -> EmbeddingsFileError:
        fields = first.split()
        glove = len(fields) >= 2 and all(number(f) is not None for f in fields[1:])
        hint = (
            "this line looks like GloVe (no header): format='glove' or format='auto'"
            if glove
            else "word2vec and fastText files start with 'COUNT DIM', e.g. '400000 300'"
        )
        return EmbeddingsFileError(
            f"expected the header 'COUNT DIM', got {show(first.strip())}",
            source=self.source,
            line=1,
            hint=hint,
        )

    def _too_many(self, count: int, line: int) -> EmbeddingsFileError:
        return EmbeddingsFileError(
            f"one vector more than the {count} the header (line 1) says",
            source=self.source,
            line=line,
            hint=f"fix the count in the header, or read the first {count} with limit={count}",
        )

    def _capacity(self, target: int | None) -> int | None:
        bound = None
        if self.size_hint is not None:
            bound = self.size_hint // (2 * self.dim + 2) + 1  # a line holds ≥ 2·D + 2 bytes
        if self.wanted is not None:
            bound = len(self.wanted) if bound is None else min(bound, len(self.wanted))
        if target is None:
            return bound
        return target if bound is None else min(target, bound)


def parse_line(raw: bytes, line: int, reader: TextReader) -> tuple[str, list[float]]:
    """One line: its word and its D numbers, or an error naming the line and the problem.

    The readable reference of the text formats; the fast pass must agree with it.
    """
    dim, source = reader.dim, reader.source
    fields = raw.split()
    if len(fields) > dim + 1 and number(fields[-dim - 1]) is None:
        fields = [b" ".join(fields[:-dim]), *fields[-dim:]]  # a word with spaces
    word = fields[0].decode("utf-8", "replace")
    if len(fields) != dim + 1:
        problem = (
            f"the line holds only {show(fields[0])}: expected a word and {dim} numbers"
            if len(fields) == 1
            else f"the vector of {word!r} has {len(fields) - 1} numbers, expected {dim} "
            f"({reader.header_line})"
        )
        raise EmbeddingsFileError(
            problem,
            source=source,
            line=line,
            hint="each line is a word and D numbers separated by spaces; the file may be "
            "damaged or joined from files of different sizes",
        )
    try:
        word = fields[0].decode(reader.encoding, reader.unicode_errors)
    except UnicodeDecodeError as error:
        bad = error.object[error.start]
        raise EmbeddingsFileError(
            f"the word {show(fields[0])} is not valid {reader.encoding} (byte 0x{bad:02x} at "
            f"column {raw.find(fields[0]) + error.start + 1})",
            source=source,
            line=line,
            hint="pass encoding='latin-1' (or the file's encoding), or unicode_errors='replace' "
            "to read the word with U+FFFD in place of the bad bytes",
        ) from None
    values = []
    for j, text in enumerate(fields[1:], start=1):
        value = number(text)
        if value is None:
            raise EmbeddingsFileError(
                f"{show(text)} is not a number (number {j} of the vector of {word!r})",
                source=source,
                line=line,
                hint="each line is a word and D numbers separated by spaces",
            )
        if not math.isfinite(value):
            raise EmbeddingsFileError(
                f"number {j} of the vector of {word!r} is {value}, not a finite number",
                source=source,
                line=line,
                hint="word vectors must be finite; fix or remove this line",
            )
        values.append(value)
    return word, values
