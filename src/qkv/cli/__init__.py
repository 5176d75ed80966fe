"""The ``qkv`` command: ``qkv explain``, ``qkv examples``.

Each subcommand is one module here that defines a :class:`~qkv.cli._common.Command` (name,
help, examples, options, run); :data:`COMMANDS` lists them, so adding ``check``, ``train``,
``bench`` or ``inspect`` is one new module and one line.

User errors (a bad example file, an unknown query token, heads that do not divide d_k) print
one line, ``qkv: error: ... Hint: ...``, to stderr and exit with status 2; never a traceback.

Example:
    >>> main(["--version"])  # doctest: +ELLIPSIS
    qkv ...
    0
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from qkv.cli import (
    _bench,
    _check,
    _evaluate,
    _examples,
    _explain,
    _grade,
    _heads,
    _patch,
    _train,
)
from qkv.cli._common import Command, CommandError, Parser, examples_block, one_line

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS: tuple[Command, ...] = (
    _explain.COMMAND,
    _check.COMMAND,
    _grade.COMMAND,
    _examples.COMMAND,
    _bench.COMMAND,
    _train.COMMAND,
    _evaluate.COMMAND,
    _patch.COMMAND,
    _heads.COMMAND,
)
"""The subcommands, in the order ``qkv --help`` lists them."""

_TAGLINE = "the attention mechanism, softmax(Q·Kᵀ/√d_k)·V, exact and step by step"


def _version() -> str:
    from qkv import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``qkv`` and its subcommands."""
    overview = [
        ("qkv explain", 'every step of attention on "I love statistics" (seed 000)'),
        ("qkv explain --example two-heads", "multi-head attention, head by head"),
        ("qkv explain --format markdown -o attention.md", "a page for a blog post"),
        ("qkv check --example i-love-statistics", "find the mistakes in a worked example"),
        ("qkv examples", "the built-in worked examples"),
        ("qkv bench --quick", "time the attention kernels against PyTorch's SDPA"),
        ("qkv train recall", "train attention on associative recall (docs/training.md)"),
        ("qkv explain --model RUN --text '...'", "a trained model's attention on a sentence"),
    ]
    parser = Parser(
        prog="qkv",
        description=f"qkv: {_TAGLINE}.",
        epilog=examples_block(tuple(overview))
        + "\n\nRun 'qkv COMMAND --help' for the options of a command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qkv {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for command in COMMANDS:
        sub = subparsers.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            epilog=command.epilog(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.configure(sub)
        sub.set_defaults(handler=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qkv`` with the given arguments (default: ``sys.argv[1:]``); return the exit status.

    0 on success (and for ``qkv`` with no arguments, which prints a short help), 2 for a user
    error, with one line ``qkv: error: ...`` on stderr (also when a command needs an extra
    that is not installed: "... needs torch ... Hint: pip install 'qkv[torch]'").
    """
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list:
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    from qkv._extras import MissingExtraError

    try:
        status: int = args.handler(args)
        return status
    except (CommandError, ValueError, OSError, MissingExtraError) as error:
        if isinstance(error, BrokenPipeError):
            return _broken_pipe()
        print(f"qkv: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130


def _broken_pipe() -> int:
    """``qkv explain | head``: the reader left; stop quietly, as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141
