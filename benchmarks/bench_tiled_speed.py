"""The tiled kernel's speed against torch's SDPA on the CPU, forward and forward + backward,
dense and causal, with other versions of the kernel measured in the same run.

Every implementation takes its turn inside each repeat (the order rotates from repeat to
repeat), so a machine whose load drifts slows them all alike. Each row prints, for every
implementation, the median time and its ratio to SDPA: the median of the per-repeat ratios
(each repeat's time over SDPA's time in the same repeat), with their spread (the lowest and
highest per-repeat ratio, and the interquartile range).

``--old PATH`` (repeatable) adds the tiled kernel of another tree: PATH is a source tree
holding ``src/qkv/kernels`` (or that folder itself), for example an older commit extracted
with ``git archive ab7ec47 src/qkv/kernels | tar -x -C /tmp/old``. Its kernel modules are
loaded under a package name of their own (their ``qkv.kernels`` imports rewritten), over
this tree's ``qkv.masks`` and ``qkv._array``; ``LABEL=PATH`` names it in the table.

Usage:
    python benchmarks/bench_tiled_speed.py                       # N=4096, B=1, H=8, D=64
    python benchmarks/bench_tiled_speed.py --old /tmp/old --repeats 15
    python benchmarks/bench_tiled_speed.py --old ab7ec47=/tmp/old --old head=/tmp/head
    python benchmarks/bench_tiled_speed.py --quick               # N=1024, a few seconds
    python benchmarks/bench_tiled_speed.py --threads 1 --clock cpu  # on a busy machine
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from qkv.kernels import set_thread_mode, tiled_attention

Attention = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Implementation:
    name: str
    attend: Attention  # (q, k, v, *, is_causal) -> context
    set_mode: Callable[[Any], object] | None  # sets the thread mode of this tree's kernel


@dataclass(frozen=True)
class Case:
    name: str
    causal: bool
    backward: bool


CASES = (
    Case("forward dense", False, False),
    Case("forward causal", True, False),
    Case("fwd+bwd dense", False, True),
    Case("fwd+bwd causal", True, True),
)


def load_tree(path: str, label: str) -> Implementation:
    """The tiled kernel of the tree at ``path``, as a package of its own."""
    root = Path(path)
    kernels = root / "src" / "qkv" / "kernels"
    if not kernels.is_dir():
        kernels = root
    if not (kernels / "_api.py").is_file():
        sys.exit(
            f"--old: {path} holds no src/qkv/kernels/_api.py. Hint: extract a commit with "
            "`git archive REV src/qkv/kernels | tar -x -C DIR` and pass DIR."
        )
    package = "_qkv_kernels_" + re.sub(r"\W", "_", label)
    folder = tempfile.mkdtemp(prefix="bench_tiled_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    target = Path(folder) / package
    target.mkdir()
    (target / "__init__.py").write_text("")
    for source in kernels.glob("*.py"):
        if source.name == "__init__.py":
            continue
        text = re.sub(r"\bqkv\.kernels\b", package, source.read_text())
        (target / source.name).write_text(text)
    sys.path.insert(0, str(target.parent))
    api: ModuleType = importlib.import_module(f"{package}._api")
    threads: ModuleType = importlib.import_module(f"{package}._threads")
    return Implementation(label, api.tiled_attention, threads.set_thread_mode)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_once(
    attend: Attention,
    inputs: tuple[torch.Tensor, ...],
    case: Case,
    grad: torch.Tensor,
    clock: Callable[[], float],
) -> float:
    """Seconds of one call (and its backward, for a backward case)."""
    start = clock()
    if case.backward:
        out = attend(*inputs, is_causal=case.causal)
        torch.autograd.backward(out, grad)
    else:
        with torch.no_grad():
            attend(*inputs, is_causal=case.causal)
    return clock() - start


@dataclass
class Result:
    seconds: list[float]
    ratios: list[float]  # per repeat, against SDPA in the same repeat


def measure(
    implementations: list[Implementation], case: Case, args: argparse.Namespace
) -> dict[str, Result]:
    generator = torch.Generator().manual_seed(0)
    shape_q = (args.batch, args.heads, args.length, args.dim)
    inputs = tuple(
        torch.randn(shape_q, generator=generator).requires_grad_(case.backward) for _ in range(3)
    )
    grad = torch.randn(shape_q, generator=generator)
    clock = CLOCKS[args.clock]
    seconds: dict[str, list[float]] = {impl.name: [] for impl in implementations}
    for impl in implementations:  # warm up: plans, buffers, first-touch pages
        for _ in range(args.warmup):
            time_once(impl.attend, inputs, case, grad, clock)
    for repeat in range(args.repeats):
        turn = repeat % len(implementations)
        for impl in implementations[turn:] + implementations[:turn]:
            seconds[impl.name].append(time_once(impl.attend, inputs, case, grad, clock))
    base = seconds["sdpa"]
    return {
        name: Result(times, [t / b for t, b in zip(times, base, strict=True)])
        for name, times in seconds.items()
    }


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", action="append", default=[], metavar="[LABEL=]PATH")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="default 11 (5 with --quick)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--mode",
        default="auto",
        choices=("auto", "torch", "pool"),
        help="the kernels' thread mode (default auto, what a user gets; torch on a quiet "
        "machine, pool on a busy one, to hold it fixed)",
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=tuple(CLOCKS),
        help="wall time, or the process's CPU time (steadier on a busy machine with --threads 1)",
    )
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--quick", action="store_true", help="N=1024, 5 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.length = 1024
    if args.repeats is None:
        args.repeats = 5 if args.quick else 11
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = {name.strip() for name in args.cases.split(",")}
    unknown = wanted - {c.name for c in CASES}
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; choose from {[c.name for c in CASES]}")

    implementations = [Implementation("sdpa", sdpa, None)]
    for spec in args.old:
        label, _, path = spec.rpartition("=")
        implementations.append(load_tree(path, label or Path(path).name))
    implementations.append(Implementation("tiled", tiled_attention, set_thread_mode))
    for impl in implementations:
        if impl.set_mode is not None:
            impl.set_mode(args.mode)

    print(
        f"N={args.length} B={args.batch} H={args.heads} D={args.dim} float32, "
        f"{torch.get_num_threads()} threads, mode {args.mode}, {args.repeats} repeats, "
        f"{args.clock} clock, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'case':16} {'impl':10} {'median ms':>10} {'÷ sdpa':>7} {'min':>6} {'IQR':>13} max")
    for case in CASES:
        if case.name not in wanted:
            continue
        results = measure(implementations, case, args)
        for name, result in results.items():
            ms = statistics.median(result.seconds) * 1e3
            ratio = statistics.median(result.ratios)
            low, high = quartiles(result.ratios)
            print(
                f"{case.name:16} {name:10} {ms:10.1f} {ratio:7.3f} {min(result.ratios):6.3f} "
                f"{low:6.3f}-{high:6.3f} {max(result.ratios):6.3f}"
            )


if __name__ == "__main__":
    main()
