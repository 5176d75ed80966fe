"""Run a function on P spawned processes joined by gloo on 127.0.0.1, with a deadline.

Each rank writes a JSON file of results into a folder; the caller reads them. A rank that
raises stops the others (torch.multiprocessing terminates them); a group that passes its
deadline is terminated and reported, so no test hangs.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

DEADLINE_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, size: int, port: int, folder: str, work: Callable[[int, int], dict[str, Any]]
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=60),
    )
    try:
        results = work(rank, size)
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_group(
    size: int, work: Callable[[int, int], dict[str, Any]], folder: Path
) -> list[dict[str, Any]]:
    """Run ``work(rank, size)`` on ``size`` processes; returns each rank's results."""
    context = start_processes(
        _entry,
        args=(size, free_port(), str(folder), work),
        nprocs=size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"the group of {size} processes ran past {DEADLINE_S} s")
    return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(size)]
