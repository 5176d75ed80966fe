"""What every subcommand shares: the parser class, option types, errors and atomic writes."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from qkv import _io
from qkv._format import visible

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "Command",
    "CommandError",
    "Option",
    "Output",
    "Parser",
    "add_options",
    "add_output_options",
    "emit",
    "int_in_range",
    "refuse_options",
    "write_all",
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


MAX_THREADS = max(256, os.cpu_count() or 1)
"""The most threads ``--threads`` takes: more than any CPU here has (PyTorch fails past a few
tens of thousands with an internal error)."""


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


Option = tuple[str, Callable[[str], Any] | None, str, str]
"""A valued option: its flag, argparse ``type`` (None: text), metavar and help."""


def add_options(group: Any, options: Sequence[Option]) -> None:
    """Add valued options to a parser or an argument group, one :data:`Option` each.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_options(parser, [("--steps", int_in_range(1), "N", "optimizer steps")])
        >>> parser.parse_args(["--steps", "3"]).steps
        3
    """
    for flag, kind, metavar, text in options:
        group.add_argument(flag, type=kind, metavar=metavar, help=text)


def write_atomic(path: str | os.PathLike[str], text: str, *, option: str = "--output") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`qkv._io.write_atomic`).

    A failure at any point leaves ``path`` as it was (absent or with its old content) and no
    temporary file behind; a path that cannot be a file is a :class:`CommandError` naming
    ``option``.
    """
    try:
        _io.write_atomic(path, text)
    except (ValueError, _io.WriteError) as error:
        raise CommandError(f"{option} {error}") from None


@dataclass(frozen=True)
class Output:
    """One file a command was asked to write.

    Attributes:
        option: the option that asked for it (``"--html"``), named in every error about it.
        path: the file, as the user gave it.
        write: writes the content to the path it is given (atomically, e.g. through
            :func:`qkv._io.write_atomic`); it may raise ``ValueError`` or ``OSError``.
        what: a few words for the "qkv: wrote FILE (what)" line.
        suffixes: the file endings allowed (e.g. ``(".png", ".svg")``), or empty for any.
    """

    option: str
    path: str
    write: Callable[[Path], None]
    what: str
    suffixes: tuple[str, ...] = ()


def check_outputs(outputs: Sequence[Output]) -> list[Path]:
    """Check every target before any work: each can be a file we write, none is asked twice.

    Raises:
        CommandError: naming the option of the first target that cannot be written (a
            folder, a missing folder, a folder without write permission, a wrong ending, or
            the same file for two options).
    """
    targets: list[Path] = []
    seen: dict[Path, str] = {}
    for output in outputs:
        try:
            target = _io.check_target(output.path)
        except ValueError as error:
            raise CommandError(f"{output.option} {error}") from None
        if output.suffixes and target.suffix.lower() not in output.suffixes:
            raise CommandError(
                f"{output.option} {output.path!r} must end in "
                f"{' or '.join(output.suffixes)}, got {target.suffix or 'no ending'!r}. "
                f"Hint: e.g. {output.option} {target.with_suffix(output.suffixes[0]).name}"
            )
        special = target.exists() and not target.is_file()
        if not special and not os.access(target.parent, os.W_OK | os.X_OK):
            raise CommandError(
                f"{output.option} cannot write {output.path!r}: permission denied (the folder "
                f"{str(target.parent)!r} is not writable). Hint: choose a folder you can write "
                "to, e.g. your home folder"
            )
        key = target.resolve()
        if key in seen and not special:
            raise CommandError(
                f"{output.option} {output.path!r} is also the file of {seen[key]}. "
                "Hint: give each output its own file"
            )
        seen[key] = output.option
        targets.append(target)
    return targets


def write_all(outputs: Sequence[Output]) -> None:
    """Write several outputs all or none, then say what was written (one line each).

    Every target is checked first (:func:`check_outputs`); each content is then written to a
    temporary file beside its target, and only when all are written are they renamed into
    place. A failure leaves every target as it was, no temporary file behind, and an error
    that names the option and the user's file (never the temporary one).
    """
    targets = check_outputs(outputs)
    staged: list[tuple[Path, Path]] = []  # (temporary file, target)
    direct: list[tuple[Output, Path]] = []  # /dev/null, pipes: written last, in place
    try:
        for output, target in zip(outputs, targets, strict=True):
            if target.exists() and not target.is_file():
                direct.append((output, target))
                continue
            temporary = target.with_name(f".{target.name}.qkv-{os.getpid()}{target.suffix}")
            staged.append((temporary, target))
            _write_one(output, target, temporary)
        for temporary, target in staged:
            with contextlib.suppress(OSError):
                os.chmod(temporary, target.stat().st_mode & 0o777)
            os.replace(temporary, target)
    except BaseException:
        for temporary, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    for output, target in direct:
        _write_one(output, target, target)
    for output in outputs:
        print(f"qkv: wrote {visible(output.path)} ({output.what})", file=sys.stderr)


def _write_one(output: Output, target: Path, where: Path) -> None:
    """``output.write(where)``, its errors naming ``output.option`` and ``target``."""
    from qkv._extras import MissingExtraError

    try:
        output.write(where)
    except (ValueError, OSError, MissingExtraError) as error:
        text = one_line(error).replace(str(where), str(target))
        raise CommandError(f"{output.option} {text}") from None


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
        text = render(args.width or 80)
        write_all(
            [
                Output(
                    "--output",
                    args.output,
                    lambda path: _io.write_atomic(path, text),
                    args.format,
                )
            ]
        )
    elif args.format == "text":
        from rich.console import Console

        print_text(Console(width=args.width, highlight=False, emoji=False, markup=False))
    else:
        sys.stdout.write(render(args.width or 80))


def one_line(error: BaseException) -> str:
    """An error message on one line (for ``qkv: error: ...``), every control character in
    it escaped (:func:`qkv._format.visible`): whatever text of a file, a file name or a
    student's exception the message quotes cannot act on the terminal."""
    if isinstance(error, _io.WriteError):
        text = str(error)
    elif isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        text = f"{error.strerror}{where}"
    else:
        text = " ".join(str(error).split())
    return visible(text) or type(error).__name__
