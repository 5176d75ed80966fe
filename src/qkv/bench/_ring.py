"""``qkv bench ring``: ring attention across spawned gloo ranks on this machine.

One group of P processes (gloo on 127.0.0.1, one PyTorch thread each) is spawned per P;
inside it every rank runs causal forward + backward on its shards for each layout and
strategy, under :func:`qkv.distributed.profiling`, and reports:

- the wall time of the call (the slowest rank), against one process doing the whole
  sequence with the same tiled kernel (P = 1) and against PyTorch's SDPA;
- per-rank compute: the CPU time of the rank's thread inside the attention kernel
  (steadier than wall time when the machine is shared), and the exposed communication:
  wall time spent waiting for an exchange after the step's compute was done;
- load balance: the largest per-rank compute over the mean (1.0 is perfect), and the
  (query piece, key piece) pairs each rank computed, counted (what a layout promises);
- per-rank peak memory at several N: what the operating system saw the call add (peak
  resident set, reset before the call: :func:`qkv.bench.peak_memory`; the ranks run with
  glibc's mmap threshold fixed, so freed tensors leave the resident set), with the
  inputs' shards, and the bytes of the private buffers the ring allocated (counted).

Shape legend: B batch, H heads, N the whole sequence, P ranks, D head_dim.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["RingSettings", "balance", "format_tables", "run_ring", "ticks"]

DEADLINE_S = 600.0


@dataclass(frozen=True)
class RingSettings:
    """What ``qkv bench ring`` measures."""

    sizes: tuple[int, ...] = (1, 2, 4)
    length: int = 4096  # N of the timing rows
    memory_lengths: tuple[int, ...] = (2048, 4096, 8192)
    heads: int = 8
    head_dim: int = 64
    repeats: int = 3
    layouts: tuple[str, ...] = ("contiguous", "zigzag", "striped")
    strategies: tuple[str, ...] = ("allgather", "ulysses")  # besides ring, at P = 2

    @classmethod
    def quick_run(cls) -> RingSettings:
        """A smoke test: small N, P = 1 and 2, one repeat (well under 30 s)."""
        return cls(
            sizes=(1, 2),
            length=512,
            memory_lengths=(256, 512),
            heads=2,
            head_dim=32,
            repeats=1,
        )


def _configs(size: int, settings: RingSettings) -> list[tuple[str, str]]:
    """(layout, strategy) pairs a group of ``size`` ranks runs."""
    if size == 1:
        return [("contiguous", "ring"), ("contiguous", "sdpa")]
    runs = [(layout, "ring") for layout in settings.layouts]
    if size == 2:
        runs += [("zigzag", s) for s in settings.strategies]
    return runs


def _shards(n: int, size: int, settings: RingSettings, rank: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    shape = (1, settings.heads, n // size, settings.head_dim)
    return [torch.randn(shape, generator=gen).requires_grad_(True) for _ in range(4)]


def _once(n: int, size: int, settings: RingSettings, rank: int, layout: str, strategy: str) -> Any:
    """Forward + backward of one causal call; returns the profile."""
    import torch

    from qkv.distributed import profiling, ring_attention

    q, k, v, grad = _shards(n, size, settings, rank)
    cpu = time.thread_time()
    with profiling() as profile:
        if strategy == "sdpa":
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = ring_attention(q, k, v, is_causal=True, layout=layout, strategy=strategy)  # type: ignore[arg-type]
        out.backward(grad.detach())  # type: ignore[no-untyped-call]
    if strategy in ("sdpa", "ulysses"):  # not profiled step by step: the whole call's CPU
        profile.compute_cpu_s = time.thread_time() - cpu
        profile.exposed_s = math.nan
    return profile


def rank_work(
    rank: int, size: int, port: int, folder: str, settings: RingSettings, progress: Any
) -> None:
    """One spawned rank: every configuration of its group, then the memory rows."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from qkv.bench._memory import peak_memory

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    try:
        found: dict[str, Any] = {"runs": [], "memory": []}
        for layout, strategy in _configs(size, settings):
            walls, compute, exposed, buffers, pairs = [], [], [], 0, 0
            for repeat in range(settings.repeats + 1):  # the first one warms up
                dist.barrier()
                start = time.perf_counter()
                profile = _once(settings.length, size, settings, rank, layout, strategy)
                wall = time.perf_counter() - start
                if repeat:
                    walls.append(wall)
                    compute.append(profile.compute_cpu_s)
                    exposed.append(profile.exposed_s)
                    buffers, pairs = profile.peak_bytes, profile.pairs
            found["runs"].append(
                {
                    "layout": layout,
                    "strategy": strategy,
                    "wall_ms": 1e3 * statistics.median(walls),
                    "compute_ms": 1e3 * statistics.median(compute),
                    "exposed_ms": 1e3 * statistics.median(exposed),
                    "buffer_bytes": buffers,
                    "pairs": pairs,  # (query piece, key piece) pairs computed, counted
                }
            )
            if rank == 0:
                progress.put(f"P={size} {layout} {strategy}")
        for n in settings.memory_lengths:
            if n % (2 * size):
                continue
            dist.barrier()
            added, profile = peak_memory(
                functools.partial(_once, n, size, settings, rank, "zigzag", "ring")
            )
            found["memory"].append(
                {"n": n, "peak_bytes": added, "buffer_bytes": profile.peak_bytes}
            )
            if rank == 0:
                progress.put(f"P={size} memory N={n}")
        Path(folder, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _fixed_mmap_threshold() -> Iterator[None]:
    """Spawn the ranks with glibc's mmap threshold fixed at 64 KiB: every tensor buffer is
    then mapped on allocation and unmapped when freed, so the resident set follows the live
    tensors (by default the threshold grows after large frees, the heap keeps freed
    buffers resident, and a later, smaller call adds nothing the OS can see)."""
    saved = os.environ.get(_MMAP)
    os.environ[_MMAP] = "65536"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[_MMAP]
        else:
            os.environ[_MMAP] = saved


_MMAP = "MALLOC_MMAP_THRESHOLD_"


def ticks(settings: RingSettings) -> int:
    """How many progress ticks :func:`run_ring` reports."""
    runs = sum(len(_configs(p, settings)) for p in settings.sizes)
    memory = sum(1 for p in settings.sizes for n in settings.memory_lengths if n % (2 * p) == 0)
    return runs + memory


def check(settings: RingSettings) -> None:
    """One-line errors for settings that cannot run (before any process is spawned)."""
    for p in settings.sizes:
        if settings.length % (2 * p):
            raise ValueError(
                f"length {settings.length} does not split into 2·P = {2 * p} chunks. Hint: "
                "use a multiple of 2·P for every P (e.g. 4096 for P = 1, 2, 4)."
            )
    if 2 in settings.sizes and settings.heads % 2:
        raise ValueError(f"heads must be even for ulysses at P = 2, got {settings.heads}")


def run_ring(settings: RingSettings, tick: Callable[[str], None]) -> list[dict[str, Any]]:
    """Spawn one gloo group per P; returns, per P, each rank's figures (JSON-like)."""
    import tempfile

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import start_processes

    check(settings)
    groups = []
    context = mp.get_context("spawn")
    for size in settings.sizes:
        progress = context.Queue()
        with tempfile.TemporaryDirectory() as folder:
            with _fixed_mmap_threshold():
                group = start_processes(  # type: ignore[no-untyped-call]
                    rank_work,
                    args=(size, _free_port(), folder, settings, progress),
                    nprocs=size,
                    join=False,
                    start_method="spawn",
                )
            deadline = time.monotonic() + DEADLINE_S
            while not group.join(timeout=0.2):
                while not progress.empty():
                    tick(progress.get())
                if time.monotonic() > deadline:
                    for process in group.processes:
                        if process.is_alive():
                            process.terminate()
                    raise TimeoutError(f"the group of {size} processes ran past {DEADLINE_S} s")
            while not progress.empty():
                tick(progress.get())
            ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(size)]
        groups.append({"size": size, "ranks": ranks, "load": os.getloadavg()[0]})
    return groups


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_tables(settings: RingSettings, groups: list[dict[str, Any]]) -> list[str]:
    """The report: lines of at most 80 characters."""
    lines = [
        "Ring attention, gloo on CPU, 1 thread per rank: causal forward + backward,",
        f"B=1, H={settings.heads}, D={settings.head_dim}, float32, median of {settings.repeats}; "
        f"load average {max(g['load'] for g in groups):.1f} on {os.cpu_count()} CPUs",
        "",
        f"Time at N={settings.length} (wall: slowest rank; compute: CPU time in the kernel,",
        "the whole call for SDPA and ulysses)",
        "",
        " P  layout      strategy   wall ms    speed  compute ms    exposed   balance",
        "                                             mean    max    comm ms  max/mean",
    ]
    single = None
    for group in groups:
        size, ranks = group["size"], group["ranks"]
        for i, run in enumerate(ranks[0]["runs"]):
            rows = [r["runs"][i] for r in ranks]
            wall = max(r["wall_ms"] for r in rows)
            compute = [r["compute_ms"] for r in rows]
            mean = sum(compute) / len(compute)
            exposed = max((r["exposed_ms"] for r in rows), key=lambda x: (math.isnan(x), x))
            if size == 1 and run["strategy"] == "ring":
                single = wall
            speed = f"{single / wall:.2f}x" if single else "—"
            strategy = "torch SDPA" if run["strategy"] == "sdpa" else run["strategy"]
            layout = "—" if size == 1 else run["layout"]
            shown = "—" if math.isnan(exposed) else f"{exposed:.0f}"
            figures = f"{mean:>6.0f} {max(compute):>6.0f}  {shown:>9}  "
            figures += f"{max(compute) / mean:>8.2f}" if mean > 0 else f"{'—':>8}"
            lines.append(
                f"{size:>2}  {layout:<10}  {strategy:<10} {wall:>7.0f}  {speed:>7}  {figures}"
            )
    lines += [
        "",
        "Peak memory per rank (the largest over the ranks), zigzag ring, in MiB:",
        "OS = peak resident set the call added (inputs' shards included);",
        "buffers = the ring's own buffers, counted (received K/V, merge, gradients)",
        "",
        "     N   P   OS MiB   vs P=1   buffers MiB   vs P=1",
    ]
    base: dict[int, tuple[float, float]] = {}
    rows = []
    for group in groups:
        size, ranks = group["size"], group["ranks"]
        for i, entry in enumerate(ranks[0]["memory"]):
            peak = max(r["memory"][i]["peak_bytes"] for r in ranks)
            buffers = max(r["memory"][i]["buffer_bytes"] for r in ranks)
            rows.append((entry["n"], size, peak, buffers))
            if size == 1:
                base[entry["n"]] = (peak, buffers)
    for n, size, peak, buffers in sorted(rows):
        ratio = [
            f"{x / b:.2f}" if b else "—"
            for x, b in zip((peak, buffers), base.get(n, (0, 0)), strict=True)
        ]
        lines.append(
            f"{n:>6}  {size:>2}  {_mib(peak):>7}   {ratio[0]:>6}"
            f"   {_mib(buffers):>11}   {ratio[1]:>6}"
        )
    return lines


def balance(groups: list[dict[str, Any]]) -> dict[str, float]:
    """Max/mean per-rank compute of the ring at the largest P, per layout (the promise:
    zigzag ≤ 1.1 under the causal mask)."""
    ranks = groups[-1]["ranks"]
    found = {}
    for i, run in enumerate(ranks[0]["runs"]):
        if run["strategy"] == "ring":
            compute = [r["runs"][i]["compute_ms"] for r in ranks]
            found[run["layout"]] = max(compute) / (sum(compute) / len(compute))
    return found
