"""From a file or a string to a YAML node tree that remembers lines, with clean errors.

YAML is never constructed here (no ``yaml.load``): :func:`compose` returns the node tree, and
``_format`` builds Python values from it, so every value keeps its line. JSON is read by the
same composer (JSON is, in practice, YAML), after the JSON parser has checked its syntax, so a
JSON error has a line too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import yaml

from qkv._read import FileLimitError, read_bytes, size_text
from qkv.examples._errors import ExampleError

MAX_BYTES = 1 << 20
"""The most bytes an example file may hold (1 MiB): a worked example is small, and reading
YAML is slow, so a larger file is refused at once instead of taking minutes."""
MAX_DEPTH_HINT = "a worked example nests lists and mappings only a few levels deep"

Kind = Literal["yaml", "json"]

_SUFFIXES: dict[str, Kind] = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
_YAML_HINT = (
    "check the indentation and the quoting near this line; a value with ': ' or ' #' in it "
    "needs quotes"
)
_JSON_HINT = (
    "JSON needs double quotes around keys and strings, a comma between items and none after "
    "the last"
)


def kind_of(path: str | os.PathLike[str]) -> Kind | None:
    """``"json"`` or ``"yaml"`` from the file extension; None when it says neither."""
    return _SUFFIXES.get(Path(path).suffix.lower())


def read_text(path: str | os.PathLike[str]) -> str:
    """The file's text (UTF-8, with or without a byte-order mark).

    Raises:
        ExampleError: the file is missing, a directory, unreadable or not UTF-8.
    """
    source = os.fspath(path)
    if Path(path).is_dir():
        raise ExampleError(
            "is a directory, not an example file",
            source=source,
            hint="give the path of a .yaml or .json file",
        )
    try:
        data = read_bytes(path, limit=MAX_BYTES, what="a worked example")
    except FileLimitError as error:
        raise ExampleError(error.problem, source=source, hint=error.hint) from None
    except FileNotFoundError:
        raise ExampleError(
            "no such file",
            source=source,
            hint="check the path; `qkv examples` lists the built-in examples",
        ) from None
    except OSError as error:
        raise ExampleError(
            f"cannot be read ({error.strerror or error})",
            source=source,
            hint="check that the file exists and that you may read it",
        ) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ExampleError(
            f"is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})",
            source=source,
            line=data.count(b"\n", 0, error.start) + 1,
            hint="an example is a YAML or JSON text file; save it with the UTF-8 encoding",
        ) from None


def compose(text: str, source: str, kind: Kind | None = None) -> yaml.Node:
    """The node tree of one YAML (or JSON) document.

    Args:
        text: the file's content.
        source: the name used in error messages.
        kind: ``"json"``, ``"yaml"``, or None to tell from the content (JSON starts with ``{``).

    Raises:
        ExampleError: empty text, a syntax error (with its line), several documents.
    """
    text = text.removeprefix("\ufeff")
    if len(text) > MAX_BYTES:
        raise ExampleError(
            f"the text holds {size_text(len(text))}, more than the {size_text(MAX_BYTES)} a "
            "worked example may hold",
            source=source,
            hint="a worked example is small: a few tokens, their embeddings and the weights",
        )
    if not text.strip():
        raise ExampleError(
            "the file is empty",
            source=source,
            hint="see docs/example-format.md for a complete example",
        )
    json_error: json.JSONDecodeError | None = None
    if kind == "json" or (kind is None and text.lstrip()[0] in "{["):
        try:
            json.loads(text)
        except RecursionError:
            raise ExampleError(
                "the file is nested too deeply to read", source=source, hint=MAX_DEPTH_HINT
            ) from None
        except json.JSONDecodeError as error:
            if kind == "json":
                raise _json_error(error, source) from None
            json_error = error  # maybe YAML in flow style; report this if YAML fails as well
        else:
            text = text.replace("\t", " ")  # valid JSON has tabs only as whitespace
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        if json_error is not None:
            raise _json_error(json_error, source) from None
        raise _yaml_error(error, text, source) from None
    except RecursionError:
        raise ExampleError(
            "the file is nested too deeply to read", source=source, hint=MAX_DEPTH_HINT
        ) from None
    if node is None:
        raise ExampleError(
            "the file holds no data (only comments)",
            source=source,
            hint="see docs/example-format.md for a complete example",
        )
    return node


def _json_error(error: json.JSONDecodeError, source: str) -> ExampleError:
    return ExampleError(
        f"not valid JSON: {error.msg} (column {error.colno})",
        source=source,
        line=error.lineno,
        hint=_JSON_HINT,
    )


def _yaml_error(error: yaml.YAMLError, text: str, source: str) -> ExampleError:
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        line = None if mark is None else mark.line + 1
        problem = error.problem or "cannot be read"
        if "another document" in problem:
            return ExampleError(
                "holds more than one YAML document (a second '---')",
                source=source,
                line=line,
                hint="put one worked example in each file",
            )
        context = f" ({error.context})" if error.context else ""
        hint = "indent with spaces, not tabs" if "'\\t'" in problem else _YAML_HINT
        return ExampleError(
            f"not valid YAML: {problem}{context}", source=source, line=line, hint=hint
        )
    if isinstance(error, yaml.reader.ReaderError):
        return ExampleError(
            f"not valid YAML: {error.reason} (character 0x{error.character:x})"
            if isinstance(error.character, int)
            else f"not valid YAML: {error.reason}",
            source=source,
            line=text.count("\n", 0, error.position) + 1,
            hint="remove the control character; an example is plain text",
        )
    return ExampleError(f"not valid YAML: {error}", source=source, hint=_YAML_HINT)
