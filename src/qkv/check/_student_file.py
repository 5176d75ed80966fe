"""Running a student's Python file to find one function or class in it.

A file handed in is often a notebook exported to a script: several functions, and
top-level code around them (tests that print, a call that fails, ``get_ipython()`` lines,
``!pip install`` and ``%matplotlib`` lines that are not Python). :func:`run_student_file`
runs it the way ``python FILE.py`` would, with two differences that let the chosen
function be checked anyway:

- a top-level statement that raises is noted (the first one, as one line) and the next
  statement runs: the functions defined after it still exist;
- IPython lines (starting with ``!`` or ``%``) are skipped, and noted.

The file's own errors come back as that one line, raw: the judge escapes them
(:func:`~qkv.check._function_run.student_text`); the check of the function goes on.
Running a file runs its code: this module runs in the student's sandboxed process, copied
beside the runner ``_student_main.py`` and imported by its plain name, so it imports nothing
of qkv (a test scans it), only the standard library.
"""

from __future__ import annotations
import __future__ as future_flags

import ast
import sys
import types
from pathlib import Path

__all__ = ["MAX_SOURCE_BYTES", "StudentFileError", "raised", "run_student_file"]

MAX_SOURCE_BYTES = 5_000_000
"""A larger file is no hand-written exercise: refused before it is read."""
_MODULE_NAME = "_qkv_student_module"


class StudentFileError(ValueError):
    """The file cannot be run at all (not readable, too large, not Python): one line, raw."""


def raised(exc: BaseException) -> str:
    """``"TypeError: the message"`` for the student's exception, raw (the judge escapes it)."""
    try:
        text = str(exc)
    except Exception:  # a __str__ of the student's own that raises
        text = ""
    name = str(getattr(type(exc), "__name__", "Exception"))
    return f"{name}: {text}" if text.strip() else name


def _without_ipython(source: str) -> tuple[str, int]:
    """The source with IPython's ``!`` and ``%`` lines made ``pass`` (indentation kept), and
    how many there were."""
    lines, count = [], 0
    for line in source.splitlines():
        body = line.lstrip()
        if body.startswith(("!", "%")):
            lines.append(line[: len(line) - len(body)] + "pass")
            count += 1
        else:
            lines.append(line)
    return "\n".join(lines) + "\n", count


def _parse(path: Path, source: str) -> tuple[ast.Module, str | None]:
    try:
        return ast.parse(source, filename=str(path)), None
    except SyntaxError as first:
        cleaned, count = _without_ipython(source)
        if count:
            try:
                tree = ast.parse(cleaned, filename=str(path))
            except SyntaxError:
                pass
            else:
                lines = "line" if count == 1 else "lines"
                return tree, f"{count} IPython {lines} (! or %) skipped"
        shown = str(path)
        raise StudentFileError(
            f"{shown}, line {first.lineno}: SyntaxError: {first.msg}. Hint: "
            f"run 'python {shown}' to see the line"
        ) from None


def run_student_file(path: Path) -> tuple[types.ModuleType, str | None]:
    """Run ``path`` top-level statement by statement: the module, and the file's own errors
    as one line, raw (None when it ran cleanly).

    Raises:
        StudentFileError: the file cannot be read, is too large, or is not Python.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "exported.py"
        ...     code = "print(undefined)\\n\\ndef attention(Q, K, V):\\n    return V\\n"
        ...     _ = path.write_text(code)
        ...     module, errors = run_student_file(path)
        >>> callable(module.attention), errors
        (True, "line 1: NameError: name 'undefined' is not defined")
    """
    try:
        size = path.stat().st_size
        if size > MAX_SOURCE_BYTES:
            raise StudentFileError(
                f"{path}: {size} bytes, more than {MAX_SOURCE_BYTES} for a "
                "Python file. Hint: give the file with the function"
            )
        source = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise StudentFileError(
            f"{path}: cannot be read ({exc.strerror}). Hint: check the path"
        ) from None
    tree, skipped = _parse(path, source)
    sys.path.insert(0, str(path.resolve().parent))
    module = types.ModuleType(_MODULE_NAME)
    module.__file__ = str(path)
    sys.modules[_MODULE_NAME] = module  # dataclasses and pickling look their module up
    flags = 0
    errors: list[str] = []
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            for alias in statement.names:
                feature = getattr(future_flags, alias.name, None)
                flags |= getattr(feature, "compiler_flag", 0)
        code = compile(
            ast.Module(body=[statement], type_ignores=[]), str(path), "exec", flags=flags,
            dont_inherit=True,
        )  # fmt: skip
        try:
            exec(code, module.__dict__)
        except BaseException as exc:  # the file's own error (SystemExit too): the next runs
            errors.append(f"line {statement.lineno}: {raised(exc)}")
    notes = errors[:1]
    if len(errors) > 1:
        notes.append(f"{len(errors) - 1} more top-level statement(s) failed")
    if skipped:
        notes.append(skipped)
    return module, "; ".join(notes) or None
