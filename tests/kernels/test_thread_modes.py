"""The tiled kernel's ways of using threads: the same numbers, and "auto" turns to the pool
when the process does not get its cores.

``"torch"`` spreads each operation over PyTorch's threads; ``"pool"`` gives whole blocks to
threads of its own. The output and every gradient are the same to the bit (dQ is summed in
the same T parts); the float64 reference checks both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

import qkv
from qkv.kernels import _forward, _threads, get_thread_mode, set_thread_mode, tiled_attention
from qkv.masks import document, sliding_window


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two PyTorch threads, and "auto" having seen nothing yet; both restored after."""
    before, mode = torch.get_num_threads(), get_thread_mode()
    setting = _threads._setting
    seen = (setting.pool_until, setting.backoff)
    setting.pool_until, setting.backoff = 0.0, _threads._FIRST_BACKOFF
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        set_thread_mode(mode)
        setting.pool_until, setting.backoff = seen


def _grads(
    mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object
) -> list[torch.Tensor]:
    """The output and dQ, dK, dV of the tiled kernel in ``mode`` ("reference": qkv's
    readable reference instead)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    if mode == "reference":
        out = qkv.scaled_dot_product_attention(*leaves, backend="reference", **options)  # type: ignore[arg-type]
    else:
        set_thread_mode(mode)  # type: ignore[arg-type]
        out = tiled_attention(*leaves, **options)  # type: ignore[arg-type]
    out.backward(torch.cos(out.detach()))
    return [out.detach(), *(x.grad for x in leaves if x.grad is not None)]


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"mask": sliding_window(40)},
        {"mask": document([0] * 70 + [1] * 90 + [2] * 140)},
        {},
    ],
    ids=["causal", "window", "documents", "dense"],
)
def test_both_modes_compute_the_same_numbers(options: dict[str, object]) -> None:
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 16, generator=generator) for _ in "qkv")
    out_t, dq_t, dk_t, dv_t = _grads("torch", q, k, v, **options)
    out_p, dq_p, dk_p, dv_p = _grads("pool", q, k, v, **options)
    assert torch.equal(out_t, out_p) and torch.equal(dk_t, dk_p) and torch.equal(dv_t, dv_p)
    assert torch.equal(dq_t, dq_p)
    exact = _grads("reference", q.double(), k.double(), v.double(), **options)
    for fast, reference in zip((out_p, dq_p, dk_p, dv_p), exact, strict=True):
        torch.testing.assert_close(fast.double(), reference, rtol=1e-4, atol=1e-5)


def test_a_mode_that_does_not_exist_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"'auto', 'torch' or 'pool', got 'openmp'"):
        set_thread_mode("openmp")  # type: ignore[arg-type]


class _Clocks:
    """time.perf_counter and time.process_time as a kernel call sees them: each call lasts
    ``wall`` seconds and uses ``cpu`` seconds of CPU in all."""

    def __init__(self, wall: float, cpu: float) -> None:
        self.wall, self.cpu, self.t, self.c = wall, cpu, 0.0, 0.0

    def perf_counter(self) -> float:
        self.t += self.wall / 2  # read once at the start of a call, once at its end
        return self.t

    def process_time(self) -> float:
        self.c += self.cpu / 2
        return self.c


def _call_with(clocks: _Clocks) -> str:
    """Run one small kernel call under the given clocks; return the mode it ran."""
    seen: list[str] = []
    original = _threads.run_tasks

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(_threads._call, "mode", None) or "none")
        return original(*args, **kwargs)

    q = torch.randn(1, 2, 64, 8)
    with (
        mock.patch.object(_threads, "_wall_clock", clocks.perf_counter),
        mock.patch.object(_threads, "_cpu_clock", clocks.process_time),
        mock.patch.object(_forward, "run_tasks", spy),
    ):
        tiled_attention(q, q, q)
    return seen[0]


@pytest.mark.usefixtures("two_threads")
def test_auto_turns_to_the_pool_when_the_cores_are_taken_and_comes_back() -> None:
    set_thread_mode("auto")
    idle, starved = _Clocks(wall=0.02, cpu=0.039), _Clocks(wall=0.02, cpu=0.02)
    short_of = _Clocks(wall=0.02, cpu=0.028)  # 0.7 of 2 cores: maybe a passing moment
    assert _call_with(idle) == "torch"
    assert _call_with(short_of) == "torch" and _call_with(idle) == "torch"
    assert _call_with(idle) == "torch"  # the good call in between forgot the first
    assert _call_with(short_of) == "torch" and _call_with(short_of) == "torch"
    assert _call_with(idle) == "pool"  # two in a row: the pool, for a while
    _threads._setting.pool_until = 0.0
    assert _call_with(idle) == "torch"
    assert _call_with(starved) == "torch"  # half of 2 cores: one call is enough
    assert _call_with(idle) == "pool"
    assert _threads._setting.backoff == 2 * _threads._FIRST_BACKOFF  # the good call reset it
    _threads._setting.pool_until = 0.0  # the while is over: "torch" is tried again
    assert _call_with(idle) == "torch"
    assert _threads._setting.backoff == _threads._FIRST_BACKOFF  # and it went well
    short = _Clocks(wall=0.001, cpu=0.0)  # too short to judge
    assert _call_with(short) == "torch" and _call_with(idle) == "torch"


@pytest.mark.usefixtures("two_threads")
def test_a_fixed_mode_is_never_changed_by_what_a_call_shows() -> None:
    set_thread_mode("torch")
    starved = _Clocks(wall=0.02, cpu=0.001)
    assert [_call_with(starved) for _ in range(3)] == ["torch"] * 3
    set_thread_mode("pool")
    assert _call_with(starved) == "pool"
    set_thread_mode("auto")  # what auto saw before still holds
    assert _threads._setting.pool_until == 0.0 and _call_with(starved) == "torch"
    set_thread_mode("torch")
    set_thread_mode("auto")
    assert _call_with(starved) == "pool"


def test_the_backoff_doubles_up_to_its_longest_and_a_good_call_resets_it() -> None:
    setting = _threads._Setting()
    for _ in range(20):
        setting.judge(wall=1.0, cpu=0.1, threads=2)
    assert setting.backoff == _threads._LONGEST_BACKOFF
    setting.judge(wall=1.0, cpu=1.9, threads=2)
    assert setting.backoff == _threads._FIRST_BACKOFF


@pytest.mark.parametrize(
    ("value", "expected"),
    [("pool", "pool"), ("torch", "torch"), ("", "auto"), ("bogus", "auto")],
)
def test_the_environment_variable_chooses_the_mode(value: str, expected: str) -> None:
    code = "import qkv.kernels as k; print(k.get_thread_mode())"
    env = {**os.environ, "QKV_THREAD_MODE": value}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == expected
    if value == "bogus":
        assert "QKV_THREAD_MODE must be 'auto', 'torch' or 'pool', got 'bogus'" in done.stderr
