"""The built-in worked examples (YAML files in ``qkv/examples/data``) and name-or-path lookup."""

from __future__ import annotations

import difflib
import os
import re
from importlib import resources
from pathlib import Path

from qkv.examples._errors import ExampleError
from qkv.examples._format import load, parse
from qkv.examples._model import Example

BUILTIN_NAMES = (
    "i-love-statistics",
    "the-cat-sat-on-the-mat",
    "two-heads",
    "flash-by-hand",
    "flash-forgot-rescale",
)
"""The built-in examples, in order; the first is the default of ``qkv explain``."""


def builtin_names() -> list[str]:
    """The names of the built-in examples, in order; the first is the default.

    Example:
        >>> builtin_names()[0]
        'i-love-statistics'
    """
    return list(BUILTIN_NAMES)


def _slug(name: str) -> str:
    """``"I love statistics"`` → ``"i-love-statistics"``."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def builtin(name: str) -> Example:
    """A built-in worked example by name (case, spaces and underscores do not matter).

    Args:
        name: one of :func:`builtin_names`, e.g. ``"i-love-statistics"``.

    Raises:
        ExampleError: an unknown name; the message lists the built-in names.

    Example:
        >>> ex = builtin("two-heads")
        >>> ex.heads, ex.W_o.shape
        (2, (4, 4))
    """
    slug = _slug(name)
    if slug not in BUILTIN_NAMES:
        close = difflib.get_close_matches(slug, BUILTIN_NAMES, n=1)
        mean = f"did you mean {close[0]!r}? " if close else ""
        raise ExampleError(
            f"unknown built-in example {name!r}",
            hint=f"{mean}the built-in examples are: {', '.join(BUILTIN_NAMES)}",
        )
    text = resources.files("qkv.examples").joinpath("data", f"{slug}.yaml").read_text("utf-8")
    return parse(text, source=f"<built-in {slug}>", slug=slug)


def resolve(name_or_path: str | os.PathLike[str]) -> Example:
    """A built-in example by name, else the example file at that path.

    A built-in name wins over a file of the same name in the current folder; write
    ``./two-heads`` to mean the file.

    Raises:
        ExampleError: neither a built-in name nor an existing file (the message names both
            possibilities), or a file that breaks the format.

    Example:
        >>> resolve("i-love-statistics").slug
        'i-love-statistics'
    """
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and _slug(text) in BUILTIN_NAMES:
        return builtin(text)
    if Path(text).exists():
        return load(text)
    close = difflib.get_close_matches(_slug(text), BUILTIN_NAMES, n=1)
    mean = f"did you mean {close[0]!r}? " if close else ""
    raise ExampleError(
        f"{text!r} is neither a built-in example nor an existing file",
        hint=f"{mean}the built-in examples are: {', '.join(BUILTIN_NAMES)}; or give the path "
        "of a YAML or JSON example file (see docs/example-format.md)",
    )
