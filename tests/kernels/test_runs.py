"""Runs of key (and query) blocks, computed as one matrix product, and the caller's own
operations on one core: exact against the float64 reference, forward and backward.

The kernel chooses its block sizes from the mask's structure and merges adjacent non-empty
blocks into runs (``qkv.kernels._blockwise.blocks_of``), cut at ``RUN_ELEMENTS`` scores. At
test sizes the real block sizes would give one block per row, so the candidates and the cut
are made small here, drawn by hypothesis, to put many runs, cut in many places, in each row
and column. Ported expectation: FlashAttention's block-sparse kernels are tested against
dense attention on random block masks (Dao et al., ``tests/test_flash_attn.py``); here the
oracle is qkv's float64 reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import masks
from qkv.attention import reference_attention
from qkv.kernels import _blocks, _blockwise, plan_blocks, tiled_attention
from qkv.kernels._threads import call_threads, set_thread_mode, task_threads
from qkv.masks import EMPTY, FULL, PARTIAL

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextmanager
def small_blocks(candidates: tuple[int, ...], run_elements: int) -> Iterator[None]:
    """Block sizes the chooser picks from, and the cut of a run, made test-sized."""
    with (
        mock.patch.object(_blocks, "_CANDIDATES", candidates),
        mock.patch.object(_blocks, "DEFAULT_BLOCK", max(candidates)),
        mock.patch.object(_blocks, "_BLOCK_OVERHEAD", 4),
        mock.patch.object(_blockwise, "RUN_ELEMENTS", run_elements),
    ):
        _blocks._plans.clear()  # plans are kept per mask object: none made with other sizes
        try:
            yield
        finally:
            _blocks._plans.clear()


def _rule(draw: st.DrawFn, lq: int, lk: int) -> masks.Mask | None:
    kind = draw(st.sampled_from(["none", "causal", "window", "documents", "prefix", "user"]))
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal(draw(st.sampled_from(["top-left", "bottom-right"])))
    if kind == "window":
        return masks.sliding_window(draw(st.integers(0, 12)), draw(st.integers(0, 4)))
    if kind == "documents":
        ids = sorted(draw(st.lists(st.integers(0, 4), min_size=lq, max_size=lq)))
        kv_ids = sorted(draw(st.lists(st.integers(0, 4), min_size=lk, max_size=lk)))
        rule = masks.document(ids, kv_ids)
        return rule & masks.causal() if draw(st.booleans()) else rule
    if kind == "prefix":
        return masks.prefix_lm(draw(st.integers(0, lk)))
    return masks.from_function(lambda b, h, q, kv: (q // 3 + kv // 5) % 2 == 0, "checker")


@st.composite
def run_cases(draw: st.DrawFn) -> dict[str, Any]:
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    lq, lk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shapes = ((b, hkv * group, lq, 4), (b, hkv, lk, 4), (b, hkv, lk, 3))
    tensors = [torch.tensor(rng.normal(size=s), requires_grad=True) for s in shapes]
    options: dict[str, Any] = {"mask": _rule(draw, lq, lk), "enable_gqa": True}
    if draw(st.booleans()):
        options["bias"] = torch.tensor(rng.normal(size=(lq, lk)))
    if draw(st.booleans()):
        options["score_mod"] = masks.softcap(3.0)
    candidates = tuple(sorted(set(draw(st.lists(st.integers(2, 7), min_size=1, max_size=3)))))
    run_elements = draw(st.sampled_from([1, 16, 64, 256, 1 << 20]))
    return {
        "tensors": tensors,
        "options": options,
        "candidates": candidates,
        "run_elements": run_elements,
    }


def _outputs(run: Any, tensors: list[torch.Tensor], options: dict[str, Any]) -> list[Any]:
    out = run(*tensors, **options)
    weights = torch.from_numpy(np.random.default_rng(1).normal(size=tuple(out.shape)))
    grads = torch.autograd.grad((out * weights.to(out.dtype)).sum(), tensors)
    return [x.detach().double().numpy() for x in (out, *grads)]


def _tiled(*tensors: torch.Tensor, **options: Any) -> torch.Tensor:
    options = {key: value for key, value in options.items() if key != "enable_gqa"}
    out: torch.Tensor = tiled_attention(*tensors, **options)
    return out


@settings(max_examples=50, deadline=None)
@given(run_cases())
def test_runs_of_blocks_equal_the_float64_reference(case: dict[str, Any]) -> None:
    expected = _outputs(reference_attention, case["tensors"], case["options"])
    with small_blocks(case["candidates"], case["run_elements"]):
        got = _outputs(_tiled, case["tensors"], case["options"])
    for name, e, g in zip(("out", "dq", "dk", "dv"), expected, got, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-10, err_msg=name)


@settings(max_examples=30, deadline=None)
@given(run_cases())
def test_runs_give_the_same_bits_with_and_without_skipping_blocks(case: dict[str, Any]) -> None:
    """Without skipping, the blocks the structure leaves empty are computed on their own, so
    the other blocks form the same runs: the same sums in the same order."""
    tensors = [t.detach().float().requires_grad_(True) for t in case["tensors"]]
    options = dict(case["options"])
    if "bias" in options:
        options["bias"] = options["bias"].float()
    with small_blocks(case["candidates"], case["run_elements"]):
        skipped = _outputs(_tiled, tensors, options)
        computed = _outputs(_tiled, tensors, {**options, "skip_blocks": False})
    for name, s, c in zip(("out", "dq", "dk", "dv"), skipped, computed, strict=True):
        np.testing.assert_array_equal(s, c, err_msg=name)


def test_adjacent_full_blocks_merge_into_runs_cut_at_the_limit() -> None:
    kinds = np.array([FULL, FULL, PARTIAL, FULL, EMPTY, FULL, FULL, FULL], dtype=np.int8)
    runs = _blockwise._runs(kinds, None, 4, 30, longest=8)
    # blocks of 4 (the last one 2 long): a partial block is alone; a run of full blocks
    # stops at an empty or partial block and at 8 positions
    assert runs == [(0, 8, FULL), (8, 12, PARTIAL), (12, 16, FULL), (20, 28, FULL), (28, 30, FULL)]
    assert _blockwise._runs(kinds, None, 4, 30, longest=0) == [
        (j * 4, min(j * 4 + 4, 30), int(kind)) for j, kind in enumerate(kinds) if kind != EMPTY
    ]


def test_without_skipping_the_runs_follow_the_structure() -> None:
    """skip_blocks=False computes every block as partial; the runs are those of the
    structure, and each structurally empty block is a run of its own."""
    structure = np.array([FULL, FULL, PARTIAL, EMPTY, FULL, FULL], dtype=np.int8)
    computed = np.full_like(structure, PARTIAL)
    assert _blockwise._runs(computed, structure, 4, 24, longest=100) == [
        (0, 8, PARTIAL),
        (8, 12, PARTIAL),
        (12, 16, PARTIAL),
        (16, 24, PARTIAL),
    ]
    with_skipping = _blockwise._runs(structure, None, 4, 24, longest=100)
    assert [r[:2] for r in with_skipping] == [(0, 8), (8, 12), (16, 24)]


def test_given_block_sizes_are_computed_one_block_at_a_time() -> None:
    """``block_q``/``block_kv`` given: exactly those blocks (a score modifier sees no
    larger tensor); chosen: runs."""
    chosen = plan_blocks(masks.causal(), batch=1, heads=2, q_len=64, kv_len=64)
    given_sizes = plan_blocks(
        masks.causal(), batch=1, heads=2, q_len=64, kv_len=64, block_q=16, block_kv=16
    )
    assert chosen.runs and not given_sizes.runs
    seen: list[tuple[int, ...]] = []

    def spy(score: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
        seen.append(tuple(score.shape))
        return score

    q = k = v = torch.randn(1, 2, 64, 8)
    tiled_attention(q, k, v, is_causal=True, score_mod=spy, block_q=16, block_kv=16)
    assert max(s[-1] for s in seen) == 16
    seen.clear()
    with small_blocks((16,), 1 << 20):
        tiled_attention(q, k, v, is_causal=True, score_mod=spy)
    # blocks of 32 queries by 16 keys: the last query block's two full key blocks, one run
    assert max(s[-1] for s in seen) == 32


def test_skipping_off_keeps_the_structure_and_the_block_sizes() -> None:
    rule = masks.sliding_window(3)
    sizes: dict[str, Any] = {"batch": 1, "heads": 1, "q_len": 64, "kv_len": 64}
    with small_blocks((4,), 1 << 20):
        plan = plan_blocks(rule, **sizes, skip=False)
        structure = plan_blocks(rule, **sizes)
    assert (plan.block_q, plan.block_kv) == (structure.block_q, structure.block_kv)
    assert (plan.kinds == PARTIAL).all()
    assert plan.structure is not None and structure.structure is None
    np.testing.assert_array_equal(plan.structure, structure.kinds)


@pytest.fixture
def pool_mode() -> Iterator[None]:
    """The kernel's own pool of threads (``set_thread_mode("pool")``) for one test."""
    before = set_thread_mode("pool")
    try:
        yield
    finally:
        set_thread_mode(before)


@pytest.mark.usefixtures("pool_mode")
def test_the_caller_runs_on_one_core_and_gets_its_thread_count_back() -> None:
    with mock.patch.object(torch, "get_num_threads", wraps=torch.get_num_threads):
        torch.set_num_threads(2)
        try:
            with call_threads():
                assert torch.get_num_threads() == 1
                assert task_threads() == 2  # the blocks still go to two threads
                with call_threads():  # nested: the outer count holds
                    assert task_threads() == 2
                assert task_threads() == 2
            assert torch.get_num_threads() == 2
            assert task_threads() == 2
            q = torch.randn(1, 2, 300, 8, requires_grad=True)
            tiled_attention(q, q, q, mask=masks.sliding_window(40)).sum().backward()
            assert torch.get_num_threads() == 2  # forward and backward leave it as it was
        finally:
            torch.set_num_threads(1)


@pytest.mark.usefixtures("pool_mode")
def test_the_caller_gets_its_thread_count_back_after_an_error() -> None:
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="boom"), call_threads():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2 and task_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_two_threads_with_runs_equal_one_thread() -> None:
    """The blocks shared among threads (the caller on one core) change nothing."""
    rng = np.random.default_rng(3)
    tensors = [torch.tensor(rng.normal(size=(1, 2, 90, 8)), requires_grad=True) for _ in "qkv"]
    options: dict[str, Any] = {"mask": masks.sliding_window(20) | masks.prefix_lm(5)}
    with small_blocks((8, 16), 300):
        one = _outputs(_tiled, tensors, options)
        torch.set_num_threads(2)
        try:
            two = _outputs(_tiled, tensors, options)
        finally:
            torch.set_num_threads(1)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
