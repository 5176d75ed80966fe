"""The one error of the word-vector readers: which file, where in it, what is wrong, a hint."""

from __future__ import annotations

from typing import Any

from qkv._format import visible


class EmbeddingsFileError(ValueError):
    """A word-vector file that cannot be read.

    The message reads ``"vectors.txt, line 7: ... Hint: ..."`` for the text formats and
    ``"vectors.bin, byte 1234: ... Hint: ..."`` for the binary one; the parts are also
    attributes, for programs that want to point at the place.

    Attributes:
        source: the file path.
        problem: what is wrong, without the location.
        line: the 1-based line of a text file, when known.
        offset: the 0-based byte offset in a binary file (of the uncompressed data for a
            ``.gz`` file), when known.
        hint: how to fix it, or None.

    Example:
        >>> error = EmbeddingsFileError("expected 3 numbers, got 2", source="v.txt", line=7,
        ...                             hint="every line is a word and 3 numbers")
        >>> str(error)
        'v.txt, line 7: expected 3 numbers, got 2. Hint: every line is a word and 3 numbers'
        >>> isinstance(error, ValueError)
        True
    """

    def __init__(
        self,
        problem: str,
        *,
        source: str,
        line: int | None = None,
        offset: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.source = source
        self.line = line
        self.offset = offset
        self.hint = hint
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.source
        if self.line is not None:
            where += f", line {self.line}"
        if self.offset is not None:
            where += f", byte {self.offset}"
        text = f"{where}: {self.problem}"
        if self.hint:
            text = f"{text.rstrip('.')}. Hint: {self.hint}"
        return visible(text)  # a word from the file may hold anything

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild from the parts so the error survives pickling.
        return (_rebuild, (self.problem, self.source, self.line, self.offset, self.hint))


def _rebuild(
    problem: str, source: str, line: int | None, offset: int | None, hint: str | None
) -> EmbeddingsFileError:
    return EmbeddingsFileError(problem, source=source, line=line, offset=offset, hint=hint)
