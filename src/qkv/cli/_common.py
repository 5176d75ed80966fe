"""What every subcommand shares: the parser class, option types, errors and atomic writes."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

__all__ = [
    "Command",
    "CommandError",
    "Parser",
    "int_in_range",
    "write_atomic",
]


class CommandError(Exception):
    """A user error found by a subcommand: printed as ``qkv: error: ...``, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: ``qkv: error: ... Hint: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"qkv: error: {message}. Hint: see '{self.prog} --help'.\n")


@dataclass(frozen=True)
class Command:
    """A subcommand of ``qkv``: one module under ``qkv/cli/`` defines one.

    Attributes:
        name: the word after ``qkv`` (``"explain"``).
        summary: one line for the command list.
        description: the text at the top of ``qkv NAME --help``.
        examples: (command line, what it does) pairs, shown under "Examples:".
        configure: adds the command's options to its parser.
        run: does the work; returns the exit status. Raises :class:`CommandError`,
            ``ValueError`` or ``OSError`` for a user error.
    """

    name: str
    summary: str
    description: str
    examples: tuple[tuple[str, str], ...]
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def epilog(self) -> str:
        return examples_block(self.examples)


def examples_block(examples: tuple[tuple[str, str], ...]) -> str:
    """The "Examples:" block of a help text: each command line, then what it does."""
    lines = ["Examples:"]
    for command, what in examples:
        lines += [f"  {command}", f"      {what}"]
    return "\n".join(lines)


def int_in_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` that reads an integer from ``low`` to ``high`` (inclusive)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"expected a number {bounds}, got {value}")
        return value

    parse.__name__ = "number"  # argparse names the type in its messages
    return parse


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename it.

    A failure at any point leaves ``path`` as it was (absent or with its old content) and no
    temporary file behind.
    """
    target = Path(path)
    if target.is_dir():
        raise CommandError(f"--output {str(target)!r} is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise CommandError(
            f"--output {str(target)!r}: the folder {str(folder)!r} does not exist. "
            "Hint: create it first"
        )
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
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


def one_line(error: BaseException) -> str:
    """An error message on one line (for ``qkv: error: ...``)."""
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}"
    text = " ".join(str(error).split())
    return text or type(error).__name__
