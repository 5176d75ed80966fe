"""How the tiled kernel uses several threads: PyTorch's own, or a pool of its own.

``"torch"``: the kernel's operations run in the calling thread, and each large one is spread
over PyTorch's OpenMP threads (``torch.get_num_threads()``), as every PyTorch operation is.
Inside a model, attention follows other operations (the projections' matrix products) whose
OpenMP threads stay awake, spinning, for some milliseconds after them; the kernel's
operations find them ready. But on a machine whose cores are busy with other work, each of
the kernel's few hundred operations per call waits, at its end, for a thread the system has
paused: measured 3 times slower than "pool" beside one busy process on 2 cores, and up to
50 times beside several.

``"pool"``: T threads of the kernel's own (T = ``torch.get_num_threads()``) each take whole
query (or key) blocks and run their operations on one core, with one wait per call. It
keeps its speed on a busy machine, but right after an OpenMP operation its threads compete
with the spinning OpenMP threads for the cores (measured up to 1.5 times slower than
"torch" at N = 1,024 on an otherwise idle machine). Each pool thread keeps its own scratch
state (score buffers, partial sums), so tasks never write to the same memory, and the
caller's own operations around the tasks run on one core.

``"auto"`` (the default) runs "torch", and watches each call of more than
:data:`_WATCHED_SECONDS`: when the process got less than :data:`_STARVED` of T cores for
it (its CPU time over T times its wall time; about 0.97 on an idle machine, 0.5 to 0.77
beside busy processes) in two calls in a row, or less than :data:`_VERY_STARVED` in one,
other work is taking the cores, and the next calls run "pool" for a while (5 s, doubled
each time it happens again, up to 5 minutes) before "torch" is tried again.

Choose with :func:`set_thread_mode`, or the environment variable ``QKV_THREAD_MODE`` (read at
import). Every mode runs the same operations on the same blocks, and the backward adds the
key blocks' shares of dQ in the same T partial sums, so the results are the same to the bit
in every mode (and from one call to the next, even when "auto" changes its mind).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Literal, TypeVar

import torch

__all__ = [
    "ThreadMode",
    "call_threads",
    "get_thread_mode",
    "run_tasks",
    "set_thread_mode",
    "task_threads",
]

State = TypeVar("State")
ThreadMode = Literal["auto", "torch", "pool"]
_MODES: tuple[ThreadMode, ...] = ("auto", "torch", "pool")

_WATCHED_SECONDS = 0.005  # shorter calls: CPU time is too coarse to judge
_STARVED, _VERY_STARVED = 0.8, 0.6
_FIRST_BACKOFF, _LONGEST_BACKOFF = 5.0, 300.0
_wall_clock, _cpu_clock = time.perf_counter, time.process_time  # the CPU time of all threads


def _mode_from_environment() -> ThreadMode:
    value = os.environ.get("QKV_THREAD_MODE", "auto").strip().lower() or "auto"
    for mode in _MODES:
        if value == mode:
            return mode
    warnings.warn(
        f"QKV_THREAD_MODE must be 'auto', 'torch' or 'pool', got {value!r}; using 'auto'. "
        "Hint: unset it, or QKV_THREAD_MODE=pool on a machine busy with other work.",
        stacklevel=2,
    )
    return "auto"


class _Setting:
    """The chosen mode, and for "auto" until when the pool runs and for how long next."""

    def __init__(self) -> None:
        self.mode: ThreadMode = _mode_from_environment()
        self.pool_until = 0.0  # time.monotonic()
        self.backoff = _FIRST_BACKOFF
        self.strikes = 0  # calls in a row that did not get their cores
        self.lock = threading.Lock()

    def now(self) -> Literal["torch", "pool"]:
        """The mode a call starting now runs."""
        if self.mode != "auto":
            return self.mode
        return "pool" if time.monotonic() < self.pool_until else "torch"

    def judge(self, wall: float, cpu: float, threads: int) -> None:
        """After an "auto" call that ran "torch": did the process get its cores? Two calls
        in a row that did not, or one that got less than :data:`_VERY_STARVED`, send the
        next calls to the pool (one short of its cores may be a passing moment)."""
        if wall < _WATCHED_SECONDS:
            return
        share = cpu / (threads * wall)
        with self.lock:
            if share >= _STARVED:
                self.strikes, self.backoff = 0, _FIRST_BACKOFF
                return
            self.strikes += 2 if share < _VERY_STARVED else 1
            if self.strikes >= 2:
                self.strikes = 0
                self.pool_until = time.monotonic() + self.backoff
                self.backoff = min(self.backoff * 2, _LONGEST_BACKOFF)


_setting = _Setting()


def get_thread_mode() -> ThreadMode:
    """How the tiled kernel is set to use several threads: ``"auto"``, ``"torch"`` or
    ``"pool"``.

    Example:
        >>> get_thread_mode() in ("auto", "torch", "pool")
        True
    """
    return _setting.mode


def set_thread_mode(mode: ThreadMode) -> ThreadMode:
    """Choose how the tiled kernel uses ``torch.get_num_threads()`` threads, for the whole
    process; returns the mode it had.

    ``"torch"`` spreads each operation over PyTorch's OpenMP threads, like any PyTorch
    operation: the fastest on a machine that runs nothing else. ``"pool"`` gives whole
    blocks to threads of the kernel's own, each on one core: much the faster when other
    busy processes share the cores. ``"auto"`` (the default) runs "torch" and turns to
    "pool" for a while when a call shows the cores taken. See the module's docstring.

    Example:
        >>> old = set_thread_mode("pool")
        >>> get_thread_mode()
        'pool'
        >>> _ = set_thread_mode(old)
    """
    if mode not in _MODES:
        raise ValueError(
            f"set_thread_mode: mode must be 'auto', 'torch' or 'pool', got {mode!r}. Hint: "
            "'auto' chooses; 'torch' on an otherwise idle machine, 'pool' when other work "
            "shares the cores."
        )
    with _setting.lock:  # what "auto" has seen of the machine still holds
        previous = _setting.mode
        _setting.mode = mode
    return previous


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_call = threading.local()  # .mode, .threads: those of the call the thread is in, if any


@contextlib.contextmanager
def call_threads(on_cpu: bool = True) -> Iterator[None]:
    """One call of the kernel (its forward, or its backward): its thread mode is chosen once,
    at the start, and holds for every :func:`run_tasks` inside.

    In the pool, the calling thread's own PyTorch operations (checks, plan, the sums of the
    backward) run on one core until the block ends (its thread count is restored then):
    handing them to PyTorch's idle OpenMP threads costs a wake-up that was measured at 2 to
    12 ms on a busy 2-core machine, more than the operations. An "auto" call that runs
    "torch" is timed, and judged at its end (see the module's docstring).

    Nested uses keep the outermost call's mode. Off the CPU, nothing changes.
    """
    threads = torch.get_num_threads()
    if not on_cpu or threads <= 1 or getattr(_call, "mode", None) is not None:
        yield
        return
    mode = _setting.now()
    _call.mode, _call.threads = mode, threads
    watched = _setting.mode == "auto" and mode == "torch"
    wall, cpu = _wall_clock(), _cpu_clock()
    if mode == "pool":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _call.mode = _call.threads = None
        if mode == "pool":
            torch.set_num_threads(threads)
        if watched:
            _setting.judge(_wall_clock() - wall, _cpu_clock() - cpu, threads)


def task_threads() -> int:
    """How many threads :func:`run_tasks` uses: the caller's count (the one it had before
    :func:`call_threads`)."""
    threads: int | None = getattr(_call, "threads", None)
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

    In the pool (the mode of the enclosing :func:`call_threads`, else the mode a call
    starting now would run), the tasks go to the pool's threads. Otherwise, with one thread
    (or one task), or with tensors on an accelerator (whose operations are queued, not run,
    by the calling thread), everything runs in the caller's thread, in order; ``in_order``
    tasks then still fill T states as the pool's threads would.

    Tasks go to whichever thread is free, unless ``in_order``: thread t then runs tasks t,
    t + T, t + 2T, ... in this order, and the states come back in thread order, so that sums
    over the states are the same, bit for bit, from one call to the next.
    """
    threads = task_threads() if threads is None else threads
    mode = getattr(_call, "mode", None) or _setting.now()
    if threads <= 1 or len(tasks) <= 1 or not on_cpu:
        state = make_state()
        for task in tasks:
            task(state)
        return [state]
    if mode == "torch":
        if not in_order:
            state = make_state()
            for task in tasks:
                task(state)
            return [state]
        # The pool's states, filled in the caller: state t gets tasks t, t + T, ... in this
        # order, as thread t would, so the sums over them have the same bits in both modes.
        shared = [make_state() for _ in range(min(threads, len(tasks)))]
        for i, task in enumerate(tasks):
            task(shared[i % len(shared)])
        return shared
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
