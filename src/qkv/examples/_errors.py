"""The one error of the worked-example format: where, which field, what is wrong, and a hint."""

from __future__ import annotations

from typing import Any

from qkv._format import visible


class ExampleError(ValueError):
    """A worked example that cannot be read: the file, the line, the field and a hint.

    The message reads ``"ex.yaml, line 7: weights.W_q: expected 3 rows (...), got 2. Hint: ..."``;
    the parts are also attributes, for programs that want to point at the place. The file's
    own text (keys, tokens, the file's name) is escaped in the message
    (:func:`qkv._format.visible`), never in the attributes.

    Attributes:
        source: the file path, ``"<string>"`` or ``"<built-in NAME>"``; None when no file is
            involved (an unknown built-in name).
        line: the 1-based line of the offending value, when known.
        field: the path of the offending value, e.g. ``"claimed.scores.love"`` or
            ``"embeddings[2]"``; None for the file as a whole.
        problem: what is wrong, without the location.
        hint: how to fix it, or None.

    Example:
        >>> error = ExampleError("expected a number", source="ex.yaml", line=7, field="heads",
        ...                      hint="write heads: 2")
        >>> str(error)
        'ex.yaml, line 7: heads: expected a number. Hint: write heads: 2'
        >>> isinstance(error, ValueError)
        True
    """

    def __init__(
        self,
        problem: str,
        *,
        source: str | None = None,
        line: int | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.source = source
        self.line = line
        self.field = field
        self.hint = hint
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.source or ""
        if self.line is not None:
            where = f"{where}, line {self.line}" if where else f"line {self.line}"
        parts = [p for p in (where, self.field) if p]
        text = ": ".join([*parts, self.problem])
        if self.hint:
            text = f"{text.rstrip('.')}. Hint: {self.hint}"
        return visible(text)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild from the parts so the error survives pickling.
        return (_rebuild, (self.problem, self.source, self.line, self.field, self.hint))


def _rebuild(
    problem: str, source: str | None, line: int | None, field: str | None, hint: str | None
) -> ExampleError:
    return ExampleError(problem, source=source, line=line, field=field, hint=hint)
