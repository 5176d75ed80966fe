"""The tiled kernel's thread modes, "torch", "pool" and "auto" (the default, which chooses),
in the situations that decide between them, in one run.

- ``alone``: the kernel called again and again, nothing in between;
- ``after matmul``: each call right after a (1024 × 1024) matrix product on PyTorch's
  threads, as attention follows its projections inside a model (their OpenMP threads keep
  spinning for some milliseconds afterwards);
- ``busy``: the same as ``alone`` while another process keeps one core busy.

Each case prints the median time of each mode, and the ratio of "auto" to the faster of the
other two (1.0: auto chose well). The modes take turns within each repeat. See "Threads" in
docs/kernels.md.

Usage:
    python benchmarks/bench_threads.py              # B=1, H=8, D=64, float32
    python benchmarks/bench_threads.py --repeats 21 --threads 2
    python benchmarks/bench_threads.py --quick      # small sizes, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import Progress

from qkv.kernels import set_thread_mode, tiled_attention
from qkv.masks import Mask, causal, document, sliding_window

MODES = ("torch", "pool", "auto")
SITUATIONS = ("alone", "after matmul", "busy")


@dataclass(frozen=True)
class Case:
    name: str
    length: int
    mask: Mask | None


@dataclass
class Row:
    case: Case
    situation: str
    ms: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.ms["auto"] / min(self.ms["torch"], self.ms["pool"])


def cases(quick: bool) -> list[Case]:
    long, short = (1024, 256) if quick else (4096, 1024)
    documents = torch.arange(16).repeat_interleave(long // 16)
    return [
        Case("16 documents", long, document(documents) & causal()),
        Case("window 512", long, sliding_window(min(511, long // 4))),
        Case("causal", long, causal()),
        Case("dense", short, None),
    ]


@contextmanager
def busy_core() -> Iterator[None]:
    """Another process spinning on one core while the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it start spinning
        yield
    finally:
        spinner.kill()
        spinner.wait()


def measure(case: Case, situation: str, repeats: int) -> Row:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, case.length, 64, generator=generator) for _ in "qkv")
    x = torch.randn(1024, 1024, generator=generator)

    def call() -> None:
        tiled_attention(q, k, v, mask=case.mask)

    before: Callable[[], object] = (lambda: x @ x) if situation == "after matmul" else (lambda: 0)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm up each mode
        set_thread_mode(mode)  # type: ignore[arg-type]
        call()
    for i in range(repeats):
        for mode in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:
            set_thread_mode(mode)  # type: ignore[arg-type]
            before()
            start = time.perf_counter()
            call()
            times[mode].append(time.perf_counter() - start)
    set_thread_mode("auto")
    return Row(case, situation, {m: statistics.median(t) * 1e3 for m, t in times.items()})


def table(rows: Sequence[Row], threads: int) -> str:
    lines = [
        f"Tiled forward, B=1, H=8, D=64, float32, {threads} PyTorch threads; ms, median.",
        "",
        "| case | N | situation | torch | pool | auto | auto / best |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case.name} | {r.case.length} | {r.situation} | {r.ms['torch']:.1f} | "
            f"{r.ms['pool']:.1f} | {r.ms['auto']:.1f} | {r.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11, help="timed calls per mode")
    parser.add_argument("--threads", type=int, default=None, help="PyTorch threads")
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repeats")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    rows: list[Row] = []
    work = [(c, s) for s in SITUATIONS for c in cases(args.quick)]
    with Progress(transient=True) as progress:
        bar = progress.add_task("measuring", total=len(work))
        for situation in SITUATIONS:
            with busy_core() if situation == "busy" else _nothing():
                for case in cases(args.quick):
                    rows.append(measure(case, situation, repeats))
                    progress.advance(bar)
    Console().print(table(rows, torch.get_num_threads()), markup=False, highlight=False)
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    sys.exit(main())
