"""``qkv bench``: the attention kernels against their peers, in one run, as tables and plots.

A thin command over :mod:`qkv.bench`: options, the output checked before measuring, a
progress bar, and the page and plots written all or none."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qkv import _io
from qkv.bench import Settings, Table, _tables
from qkv.bench._tables import ON_REQUEST, SECTION_NAMES
from qkv.cli._bench_ring import add_ring
from qkv.cli._common import (
    MAX_THREADS,
    Command,
    CommandError,
    Output,
    check_outputs,
    int_in_range,
    write_all,
)

DEFAULT_OUTPUT = "docs/benchmarks.md"


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short lengths and fewer repeats: 5 to 8 minutes on 2 cores shared with other "
        "work, much of it compiling FlexAttention (the full run: about 12 minutes on 2 quiet "
        "cores, longer on busy ones)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTION_NAMES,
        metavar="SECTION",
        help=f"run only these sections: {', '.join(SECTION_NAMES)} (default: all but "
        f"{', '.join(ON_REQUEST)}, which runs only when named)",
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int_in_range(16),
        metavar="N",
        help="sequence lengths of the dense/causal section (default: 1024 4096 16384)",
    )
    parser.add_argument(
        "--long-length",
        type=int_in_range(256),
        metavar="N",
        help="the length of the long forward + backward (default: 32768, quick: 4096; "
        "65536 takes several minutes)",
    )
    parser.add_argument(
        "--repeats",
        type=int_in_range(1, 50),
        metavar="R",
        help="timed repeats per case; the median is kept (default: 3, quick: 2)",
    )
    parser.add_argument(
        "--threads",
        type=int_in_range(1, MAX_THREADS),
        metavar="T",
        help="PyTorch threads (default: PyTorch's own choice)",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help=f"the Markdown file whose benchmark section is rewritten, plots beside it in "
        f"img/ (default: {DEFAULT_OUTPUT}, when its folder exists; a --quick run writes "
        "only with --output)",
    )
    parser.add_argument(
        "--no-write",
        action="store_true",
        help="only print the tables; write no file",
    )
    add_ring(parser)  # qkv bench ring: ring attention across processes


def _run(args: argparse.Namespace) -> int:
    from qkv._extras import require

    require("torch", feature="qkv bench")
    output = _output_path(args)  # checked before minutes of measuring
    from rich.console import Console

    from qkv.bench import _suite

    settings = _suite.Settings.quick_run() if args.quick else _suite.Settings()
    overrides: dict[str, Any] = {}
    if args.lengths:
        overrides["lengths"] = tuple(args.lengths)
    if args.long_length:
        overrides["long_length"] = args.long_length
    if args.repeats:
        overrides["repeats"] = args.repeats
    if args.threads:
        overrides["threads"] = args.threads
    if overrides:
        settings = _suite.Settings(**{**settings.__dict__, **overrides})
    sections = tuple(args.only or (n for n in SECTION_NAMES if n not in ON_REQUEST))
    _check_memory(settings, sections)

    console = Console(width=min(Console().width, 80), highlight=False, emoji=False)
    about = _suite.machine()
    if settings.threads:
        about["threads"] = settings.threads
    rates = [_suite.gemm_rate()]
    tables = _measure(settings, sections, console, rates)
    rate = max(rates)  # sampled before, between and after the sections: the best
    console.print(_tables.machine_line(about, rate))
    for table in tables:
        console.print()
        console.print(_tables.rich_table(table, rate))
        if table.note:
            console.print(table.note, style="dim")
    if output is not None:
        skipped = _write(output, tables, about, rate, settings, _command_line(args))
        if skipped:
            print(f"qkv: plots skipped: {skipped}", file=sys.stderr)
    elif args.no_write:
        pass
    elif args.quick:
        print(
            f"qkv: tables not written: a --quick run leaves {DEFAULT_OUTPUT} as it is. "
            "Hint: --output FILE writes them there.",
            file=sys.stderr,
        )
    else:
        print(
            f"qkv: {Path(DEFAULT_OUTPUT).parent}/ not found: tables not written. "
            "Hint: --output FILE writes them anywhere.",
            file=sys.stderr,
        )
    return 0


def memory_needed(length: int, *, backward: bool) -> int:
    """Bytes a dense section (forward) or the long one (forward and backward) needs at
    ``length``: q, k, v, the output (and dQ, dK, dV, the output's gradient and the kernel's
    workspace) of B=1, H=8, D=64 float32; up to 4096 tokens also the (N, N) matrices of the
    naive peers."""
    from qkv.bench._measure import DIM, HEADS

    tensor = HEADS * length * DIM * 4
    quadratic = 3 * HEADS * length * length * 4 if length <= 4096 else 0
    return (10 if backward else 5) * tensor + quadratic


def _check_memory(settings: Any, sections: tuple[str, ...]) -> None:
    """One line naming the option whose length does not fit, before anything is allocated."""
    from qkv._memory import physical_memory
    from qkv._read import size_text

    available = physical_memory()
    asked = []
    if "dense" in sections:
        asked += [("--lengths", n, memory_needed(n, backward=False)) for n in settings.lengths]
    if "long" in sections:
        n = settings.long_length
        asked.append(("--long-length", n, memory_needed(n, backward=True)))
    for option, length, needed in asked:
        if needed > available:
            raise CommandError(
                f"{option} {length} needs about {size_text(needed)} of memory (B=1, H=8, D=64, "
                f"float32), more than the {size_text(available)} of this machine. Hint: a "
                "shorter length"
            )


def _command_line(args: argparse.Namespace) -> str:
    """The options of this run, as a command (for the page)."""
    words = ["qkv bench"]
    if args.quick:
        words.append("--quick")
    if args.only:
        words += ["--only", *args.only]
    for flag, value in (
        ("--lengths", args.lengths),
        ("--long-length", args.long_length),
        ("--repeats", args.repeats),
        ("--threads", args.threads),
    ):
        if value:
            words += [flag, *(str(v) for v in (value if isinstance(value, list) else [value]))]
    return " ".join(words)


def _output_path(args: argparse.Namespace) -> Path | None:
    """The page to write (checked now, before measuring), or None: --no-write, a --quick run
    without --output, or no docs/ folder here for the default."""
    if args.no_write:
        return None
    if args.output is None:
        if args.quick or not Path(DEFAULT_OUTPUT).parent.is_dir():
            return None
        text = DEFAULT_OUTPUT
    else:
        text = args.output
    page = Path(text)
    images = page.parent / "img"
    if images.exists() and not images.is_dir():
        raise CommandError(
            f"--output {text!r}: the plots go in {str(images)!r}, which is a file. "
            "Hint: write the page into another folder"
        )
    check_outputs(
        [
            Output("--output", text, _no_write, "the tables", suffixes=(".md", ".markdown")),
            *(
                Output("--output", str(images / f"bench-{key}.png"), _no_write, "a plot")
                for key in _tables.PLOTTED
                if images.is_dir()
            ),
        ]
    )
    return page


def _no_write(path: Path) -> None:
    """What :func:`_output_path` checks writes nothing."""


def _measure(
    settings: Settings, sections: Sequence[str], console: Any, rates: list[float]
) -> list[Table]:
    """Run the sections under a progress bar; sample the GEMM rate after each into ``rates``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from qkv.bench import _suite

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    tables = []
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=_suite.ticks(settings, sections))

        def tick(name: str) -> None:
            progress.update(task, advance=1, description=f"measuring: {name}")

        for table in _suite.run_suite(settings, sections, tick):
            tables.append(table)
            rates.append(_suite.gemm_rate(repeats=3))
    return tables


def _write(
    path: Path,
    tables: Sequence[Table],
    about: dict[str, Any],
    rate: float,
    settings: Settings,
    command: str = "qkv bench",
) -> str | None:
    """Rewrite the tables measured now inside the page's section (:func:`_tables.page`); keep
    the others and the rest of the page. The page and its plots (in ``img/`` beside it) are
    written all or none.

    Returns:
        Why the plots were not drawn (matplotlib is not installed), or None.
    """
    from qkv._extras import MissingExtraError, require
    from qkv.bench._plots import plot

    try:
        require("matplotlib", feature="qkv bench plots")
        skipped = None
    except MissingExtraError:
        skipped = "matplotlib is not installed; needs qkv[viz]"
    plotted = [t for t in tables if t.key in _tables.PLOTTED] if skipped is None else []
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    text = _tables.page(
        old, tables, about, rate, settings, command, plotted=[t.key for t in plotted]
    )
    images = path.parent / "img"
    if plotted:
        images.mkdir(exist_ok=True)
    write_all(
        [
            *(
                Output(
                    "--output",
                    str(images / f"bench-{table.key}.png"),
                    functools.partial(plot, table),
                    "a plot",
                )
                for table in plotted
            ),
            Output("--output", str(path), lambda where: _io.write_atomic(where, text), "tables"),
        ]
    )
    return skipped


COMMAND = Command(
    name="bench",
    summary="time the attention kernels against SDPA, FlexAttention and naive",
    description=(
        "Measure qkv (its public call with backend auto, and the tiled kernel) against\n"
        "PyTorch's SDPA (flash and math kernels), naive attention (PyTorch and NumPy),\n"
        "FlexAttention in eager mode and under torch.compile (compile times apart), in\n"
        "one run: dense and causal forward, structured masks (causal, sliding window,\n"
        "documents) at N = 4096 and 16384 with peak memory, forward + backward against\n"
        "SDPA, with structured masks, and the training step of a small transformer on\n"
        "packed documents (against nn.MultiheadAttention with the dense mask and against\n"
        "padding), a long forward + backward, the cost of qkv's public entry, and one\n"
        "decoding step with a KV cache.\n"
        "Every figure is also a ratio to a peer measured in the same run, and a last\n"
        "table reads the performance targets from those ratios; a target missed while\n"
        "the machine was busy (1-minute load average above its cores) or with repeats\n"
        'that spread says so beside its "no", and a rerun on a quiet machine decides.\n'
        "The tables are printed and written into the benchmark section\n"
        f"of {DEFAULT_OUTPUT} (or --output), with plots in docs/img/; a --quick run\n"
        "writes only with --output. Needs PyTorch (and matplotlib for the plots)."
    ),
    examples=(
        ("qkv bench --quick", "short lengths, 5-8 minutes on 2 cores; prints the tables only"),
        ("qkv bench", "the full run (B=1, H=8, D=64, N up to 32768): about 12 minutes"),
        ("qkv bench --only masks", "auto and tiled against compiled FlexAttention, SDPA"),
        ("qkv bench --only masks-bwd train", "training with structured masks, packing"),
        ("qkv bench --only long --long-length 65536", "forward + backward at 65536 tokens"),
        ("qkv bench --only dense --lengths 1024 2048 4096", "one section, your lengths"),
        ("qkv bench --threads 2 --repeats 5", "two PyTorch threads, median of 5"),
        ("qkv bench --no-write", "the full run, printing the tables only"),
        ("qkv bench -o results.md", "write the tables into another file"),
        ("qkv bench ring --quick", "ring attention across processes (qkv bench ring -h)"),
    ),
    configure=_configure,
    run=_run,
)
