"""How the tiled kernel uses several threads: PyTorch's own (the default), or a pool of its own.

``"torch"`` (the default): the kernel's operations run in the calling thread, and each large
one is spread over PyTorch's OpenMP threads (``torch.get_num_threads()``), as every PyTorch
operation is. Inside a model, attention follows other operations (the projections' matrix
products) whose OpenMP threads stay awake, spinning, for some milliseconds after them; the
kernel's operations find them ready.

``"pool"``: T threads of the kernel's own (T = ``torch.get_num_threads()``) each take whole
query (or key) blocks and run their operations on one core, with one join per call instead
of one per operation. It is faster on a machine whose cores are busy with other work: there
every join of an OpenMP operation waits for a thread the system has paused, and the kernel
makes a few dozen such operations per call (measured 1.2 to 4 times faster than "torch" on
2 cores with one other busy process). On an otherwise idle machine it is slower right after
an OpenMP operation, whose spinning threads then compete with the pool's for the cores
(measured up to 1.5 times slower at N = 1,024). Each pool thread keeps its own scratch state
(score buffers, partial sums), so tasks never write to the same memory, and the caller's own
operations around the tasks run on one core (:func:`caller_on_one_core`).

Choose with :func:`set_thread_mode`, or the environment variable ``QKV_THREAD_MODE`` (read at
import). Both run the same operations on the same blocks: the forward's numbers are the same
to the bit; the backward adds the key blocks' shares of dQ in another order (T partial sums
in the pool), so dQ may differ in its last bits.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Literal, TypeVar

import torch

__all__ = [
    "ThreadMode",
    "caller_on_one_core",
    "get_thread_mode",
    "run_tasks",
    "set_thread_mode",
    "task_threads",
]

State = TypeVar("State")
ThreadMode = Literal["torch", "pool"]
_MODES: tuple[ThreadMode, ...] = ("torch", "pool")


def _mode_from_environment() -> ThreadMode:
    value = os.environ.get("QKV_THREAD_MODE", "torch").strip().lower() or "torch"
    for mode in _MODES:
        if value == mode:
            return mode
    warnings.warn(
        f"QKV_THREAD_MODE must be 'torch' or 'pool', got {value!r}; using 'torch'. Hint: "
        "unset it, or QKV_THREAD_MODE=pool on a machine busy with other work.",
        stacklevel=2,
    )
    return "torch"


_mode: list[ThreadMode] = [_mode_from_environment()]


def get_thread_mode() -> ThreadMode:
    """How the tiled kernel uses several threads now: ``"torch"`` or ``"pool"``.

    Example:
        >>> get_thread_mode() in ("torch", "pool")
        True
    """
    return _mode[0]


def set_thread_mode(mode: ThreadMode) -> ThreadMode:
    """Choose how the tiled kernel uses ``torch.get_num_threads()`` threads, for the whole
    process; returns the mode it had.

    ``"torch"`` (the default) spreads each operation over PyTorch's OpenMP threads, like any
    PyTorch operation: the fastest on a machine that runs nothing else. ``"pool"`` gives
    whole blocks to threads of the kernel's own, each on one core: the faster choice on a
    machine whose cores are shared with other busy processes. See the module's docstring.

    Example:
        >>> old = set_thread_mode("pool")
        >>> get_thread_mode()
        'pool'
        >>> _ = set_thread_mode(old)
    """
    if mode not in _MODES:
        raise ValueError(
            f"set_thread_mode: mode must be 'torch' or 'pool', got {mode!r}. Hint: 'torch' "
            "on an otherwise idle machine, 'pool' when other work shares the cores."
        )
    previous = _mode[0]
    _mode[0] = mode
    return previous


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_caller = threading.local()  # .threads: the caller's thread count inside caller_on_one_core


@contextlib.contextmanager
def caller_on_one_core(on_cpu: bool = True) -> Iterator[None]:
    """In the ``"pool"`` mode, run the calling thread's PyTorch operations on one core until
    the block ends (its thread count is restored then); :func:`run_tasks` still uses the
    caller's count.

    Nested uses keep the outermost count. In the ``"torch"`` mode, or off the CPU, nothing
    changes.
    """
    threads = torch.get_num_threads()
    nested = getattr(_caller, "threads", None) is not None
    if _mode[0] == "torch" or not on_cpu or threads <= 1 or nested:
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

    In the ``"torch"`` mode, with one thread (or one task), or with tensors on an
    accelerator (whose operations are queued, not run, by the calling thread), everything
    runs in the caller's thread, in order.

    Tasks go to whichever thread is free, unless ``in_order``: thread t then runs tasks t,
    t + T, t + 2T, ... in this order, and the states come back in thread order, so that sums
    over the states are the same, bit for bit, from one call to the next.
    """
    threads = task_threads() if threads is None else threads
    if _mode[0] == "torch" or threads <= 1 or len(tasks) <= 1 or not on_cpu:
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
