"""Where a ring-attention call spends its time and memory, for ``qkv bench ring``.

Inside ``with profiling() as p:``, every ring-attention call of this thread adds to ``p``:
the time in the attention kernel (compute), the time spent waiting for exchanges after the
compute of a step is done (the communication that compute did not hide), the number of
exchanges and computed pairs, and the peak bytes of the call's private buffers (received
K/V blocks, the merged output and log-sum-exp, the gradient accumulators). Outside it, the
calls pay one context-variable lookup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["Profile", "current", "profiling"]


@dataclass
class Profile:
    """What the ring-attention calls inside :func:`profiling` did on this rank.

    ``compute_s`` is wall time in the kernel, ``compute_cpu_s`` this thread's CPU time in
    it (steadier on a loaded machine with one thread per rank), ``exposed_s`` wall time
    waiting on exchanges once the step's compute had finished; ``peak_bytes`` the largest
    total of private buffers alive at once in one call.
    """

    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    exposed_s: float = 0.0
    exchanges: int = 0
    pairs: int = 0
    peak_bytes: int = 0

    def note_bytes(self, *tensors: torch.Tensor) -> None:
        """Record the bytes of buffers alive together (keeps the largest total)."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.peak_bytes = max(self.peak_bytes, total)


_CURRENT: ContextVar[Profile | None] = ContextVar("qkv_ring_profile", default=None)


def current() -> Profile | None:
    """The profile being recorded, or None."""
    return _CURRENT.get()


@contextmanager
def profiling() -> Iterator[Profile]:
    """Record the ring-attention calls of this block.

    Example:
        >>> import torch
        >>> from qkv.distributed import ring_attention
        >>> q = torch.randn(1, 2, 8, 4)
        >>> with profiling() as p:                 # one process: P = 1
        ...     _ = ring_attention(q, q, q, is_causal=True, layout="zigzag")
        >>> p.pairs, p.exchanges    # zigzag: 2 chunks, 3 of 4 chunk pairs under the mask
        (3, 0)
    """
    profile = Profile()
    token = _CURRENT.set(profile)
    try:
        yield profile
    finally:
        _CURRENT.reset(token)


class Clock:
    """Times one stretch of compute or waiting into a profile (no-op without one)."""

    def __init__(self, profile: Profile | None, what: str, device: torch.device) -> None:
        self.profile, self.what = profile, what
        self.cuda = device.type == "cuda"  # wait for the GPU at both ends when profiling

    def __enter__(self) -> None:
        if self.profile is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        profile = self.profile
        if profile is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.wall
        if self.what == "compute":
            profile.compute_s += wall
            profile.compute_cpu_s += time.thread_time() - self.cpu
        else:
            profile.exposed_s += wall
