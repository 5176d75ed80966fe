"""``qkv bench ring``: ring attention across spawned gloo ranks (see :mod:`qkv.bench._ring`).

A subcommand of ``qkv bench``: its parser is added by :func:`add_ring` and it runs
:func:`run` instead of the kernel suite.
"""

from __future__ import annotations

import argparse
from typing import Any

from qkv.cli._common import examples_block, int_in_range

__all__ = ["add_ring", "run"]

_EXAMPLES = (
    ("qkv bench ring --quick", "a smoke test: P = 1, 2 and small N (under 30 s)"),
    ("qkv bench ring", "P = 1, 2, 4 at N = 4096; memory at N = 2048 to 8192: minutes"),
    ("qkv bench ring --sizes 1 2 3 --length 3072", "other process counts and length"),
)


def add_ring(parser: argparse.ArgumentParser) -> None:
    """Add the ``ring`` subcommand to ``qkv bench``'s parser."""
    tasks = parser.add_subparsers(dest="bench_task", metavar="TASK", title="tasks")
    sub = tasks.add_parser(
        "ring",
        help="ring attention across spawned gloo processes: time, balance, memory",
        description=(
            "Spawn P processes joined by gloo on 127.0.0.1 (one PyTorch thread each) and run\n"
            "causal forward + backward of qkv.distributed.ring_attention on each rank's\n"
            "shards: wall time against one process (the same tiled kernel, and PyTorch's\n"
            "SDPA), per-rank compute and exposed communication, load balance (max/mean\n"
            "compute) per layout, and per-rank peak memory against N and P. Prints the\n"
            "tables (see docs/benchmarks.md). Needs PyTorch."
        ),
        epilog=examples_block(_EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.add_argument("--quick", action="store_true", help="small sizes, one repeat: < 30 s")
    sub.add_argument(
        "--sizes",
        nargs="+",
        type=int_in_range(1, 16),
        metavar="P",
        help="process counts (default: 1 2 4; 1 is always run, as the baseline)",
    )
    sub.add_argument(
        "--length",
        type=int_in_range(16),
        metavar="N",
        help="sequence length of the timing rows (default: 4096, quick: 512)",
    )
    sub.add_argument(
        "--repeats",
        type=int_in_range(1, 50),
        metavar="R",
        help="timed repeats after one warm-up; the median is kept (default: 3)",
    )
    sub.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Measure and print the tables."""
    from qkv._extras import require

    require("torch", feature="qkv bench ring")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from qkv.bench._ring import RingSettings, check, format_tables, run_ring, ticks

    settings = RingSettings.quick_run() if args.quick else RingSettings()
    overrides: dict[str, Any] = {}
    if args.sizes:
        overrides["sizes"] = tuple(sorted({1, *args.sizes}))
    if args.length:
        overrides["length"] = args.length
    if args.repeats:
        overrides["repeats"] = args.repeats
    if overrides:
        settings = RingSettings(**{**settings.__dict__, **overrides})
    check(settings)
    console = Console(width=min(Console().width, 80), highlight=False, emoji=False)
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting processes", total=ticks(settings))

        def tick(name: str) -> None:
            progress.update(task, advance=1, description=f"measured: {name}")

        groups = run_ring(settings, tick)
    for line in format_tables(settings, groups):
        console.print(line, markup=False)
    return 0
