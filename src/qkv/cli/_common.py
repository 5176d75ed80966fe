"""What every subcommand shares: the parser class, option types, errors and atomic writes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from qkv import _io

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "Command",
    "CommandError",
    "Parser",
    "add_output_options",
    "emit",
    "int_in_range",
    "refuse_options",
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


def write_atomic(path: str | os.PathLike[str], text: str, *, option: str = "--output") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`qkv._io.write_atomic`).

    A failure at any point leaves ``path`` as it was (absent or with its old content) and no
    temporary file behind; a path that cannot be a file is a :class:`CommandError` naming
    ``option``.
    """
    try:
        _io.write_atomic(path, text)
    except ValueError as error:
        raise CommandError(f"{option} {error}") from None


def add_output_options(parser: argparse.ArgumentParser, output_help: str) -> None:
    """``--width`` and ``--output``, the options :func:`emit` reads (with ``--format``)."""
    parser.add_argument(
        "--width",
        type=int_in_range(40),
        metavar="COLUMNS",
        help="line length of the text format (default: the terminal's, 80 in a file)",
    )
    parser.add_argument("--output", "-o", metavar="FILE", help=output_help)


def refuse_options(given: Mapping[str, object], *, alongside: str, reason: str) -> None:
    """A :class:`CommandError` for the first option of ``given`` that was set.

    ``given`` maps option names to their parsed values; ``reason`` (with its hint) says why
    they cannot be used with the option ``alongside``.
    """
    for option, value in given.items():
        if value:
            raise CommandError(f"{option} cannot be used with {alongside}: {reason}")


def emit(
    args: argparse.Namespace,
    render: Callable[[int], str],
    print_text: Callable[[Console], None],
) -> None:
    """Show a command's result: to ``--output`` (atomically), else on the terminal.

    ``render(width)`` gives the text of ``args.format``; on a terminal the text format is
    printed with colour by ``print_text(console)`` instead.
    """
    if args.output is not None:
        write_atomic(args.output, render(args.width or 80))
        print(f"qkv: wrote {args.output} ({args.format})", file=sys.stderr)
    elif args.format == "text":
        from rich.console import Console

        print_text(Console(width=args.width, highlight=False, emoji=False, markup=False))
    else:
        sys.stdout.write(render(args.width or 80))


def one_line(error: BaseException) -> str:
    """An error message on one line (for ``qkv: error: ...``)."""
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}"
    text = " ".join(str(error).split())
    return text or type(error).__name__
