"""Run the kernel's blocks on several threads, each doing PyTorch operations on one core.

PyTorch parallelises every operation on a large tensor across its threads, with a fork and a
join per operation; the tiled kernel makes six to a dozen operations per block, so that
synchronisation would be paid thousands of times per call (and much worse on a busy machine,
where a join waits for a thread the system has paused). Instead, as PyTorch's own fused CPU
kernel does, the kernel hands out whole blocks: T threads (T = ``torch.get_num_threads()``)
each take the next task, and run its operations on one core (an OpenMP setting of that
thread only, restored for the caller when the call ends). Each thread keeps its own
scratch state (score buffers, partial sums), so tasks never write to the same memory.

The caller's own operations around the tasks (input checks, the plan, the sums of the
backward pass) also run on one core, inside :func:`caller_on_one_core`: they are small, and
handing them to PyTorch's OpenMP threads, idle while the blocks ran, costs a wake-up that
was measured at 2 to 12 ms on a busy 2-core virtual machine, more than the operations.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

__all__ = ["caller_on_one_core", "run_tasks", "task_threads"]

State = TypeVar("State")

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_caller = threading.local()  # .threads: the caller's thread count inside caller_on_one_core


@contextlib.contextmanager
def caller_on_one_core(on_cpu: bool = True) -> Iterator[None]:
    """Run the calling thread's PyTorch operations on one core until the block ends (its
    thread count is restored then); :func:`run_tasks` still uses the caller's count.

    Nested uses keep the outermost count. Off the CPU, nothing changes.
    """
    threads = torch.get_num_threads()
    if not on_cpu or threads <= 1 or getattr(_caller, "threads", None) is not None:
        yield
        return
    _caller.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _caller.threads = None
        torch.set_num_threads(threads)


def task_threads() -> int:
    """How many threads :func:`run_tasks` uses: the caller's count (the one it had before
    :func:`caller_on_one_core`)."""
    threads: int | None = getattr(_caller, "threads", None)
    return torch.get_num_threads() if threads is None else threads


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="qkv-tiled")
            _pools[threads] = pool
        return pool


class _States(Generic[State]):
    """One scratch state per thread, created on the thread's first task."""

    def __init__(self, make: Callable[[], State]) -> None:
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self.all: list[State] = []

    def mine(self) -> State:
        state: State | None = getattr(self._local, "state", None)
        if state is None:
            state = self._make()
            self._local.state = state
            with self._lock:
                self.all.append(state)
        return state


def run_tasks(
    tasks: Sequence[Callable[[State], None]],
    make_state: Callable[[], State],
    threads: int | None = None,
    *,
    on_cpu: bool = True,
    in_order: bool = False,
) -> list[State]:
    """Run every task once, each given its thread's state; return the states made.

    With one thread (or one task), or tensors on an accelerator (whose operations are
    queued, not run, by the calling thread), everything runs in the caller's thread.

    Tasks go to whichever thread is free, unless ``in_order``: thread t then runs tasks t,
    t + T, t + 2T, ... in this order, and the states come back in thread order, so that sums
    over the states are the same, bit for bit, from one call to the next.
    """
    threads = task_threads() if threads is None else threads
    if threads <= 1 or len(tasks) <= 1 or not on_cpu:
        state = make_state()
        for task in tasks:
            task(state)
        return [state]
    states: _States[State] = _States(make_state)
    inference = torch.is_inference_mode_enabled()
    caller_threads = torch.get_num_threads()

    def run(task: Callable[[State], None]) -> None:
        torch.set_num_threads(1)  # this thread's operations run on one core
        with torch.inference_mode(inference), torch.no_grad():
            task(states.mine())

    if in_order:
        ordered = [make_state() for _ in range(min(threads, len(tasks)))]

        def run_share(t: int) -> None:
            torch.set_num_threads(1)
            with torch.inference_mode(inference), torch.no_grad():
                for task in tasks[t :: len(ordered)]:
                    task(ordered[t])

        try:
            futures = [_pool(threads).submit(run_share, t) for t in range(len(ordered))]
            for future in futures:
                future.result()
        finally:
            torch.set_num_threads(caller_threads)
        return ordered
    try:
        futures = [_pool(threads).submit(run, task) for task in tasks]
        for future in futures:
            future.result()
    finally:
        torch.set_num_threads(caller_threads)  # the setting new threads start with
    return states.all
