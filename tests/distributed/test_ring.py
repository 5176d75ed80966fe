"""Ring attention across P processes (gloo on CPU) equals single-process attention.

One group of P processes is spawned per P and runs every case inside it: each layout × mask
(none, causal, sliding windows, documents + causal, prefix-LM, key padding, a rule without
block hints, sinks, grouped-query heads). Each rank compares its output and its gradients
of q, k, v (and the sum over ranks of the sinks' gradient) with the reference on the whole
sequence in float64 (in float32: within a small multiple of the float32 reference's own
error), checks that a second call gives the same bits and that its inputs are
untouched, and records the one-line errors that bad input gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

import qkv
from qkv import masks
from qkv.distributed import Layout, ring_attention, shard
from qkv.distributed._profile import profiling
from tests.distributed._group import run_group

N = 24  # divides into 2·P chunks for P = 1, 2, 3, 4
LAYOUTS: tuple[Layout, ...] = ("zigzag", "contiguous", "striped")
GATHERED = (
    "causal",
    "sliding window both sides",
    "window + documents + sinks",
    "grouped-query causal",
)
SEGMENTS = [[0] * 7 + [1] * 9 + [2] * 8, [0] * 13 + [1] * 11]


def _parity_blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any) -> tuple[Any, Any]:
    """Exact hint of ALTERNATE: which chunk parities each range of positions touches."""
    q_even, q_odd = _touches(q0, q1)
    k_even, k_odd = _touches(k0, k1)
    some = (q_even & k_even) | (q_odd & k_odd)
    every = (q_even ^ q_odd) & (k_even ^ k_odd) & (q_even == k_even)
    return some, every


def _touches(start: Any, end: Any) -> tuple[Any, Any]:
    first, last = start // 6, (end - 1) // 6
    spans = last > first
    return spans | (first % 2 == 0), spans | (first % 2 == 1)


def _other_blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any) -> tuple[Any, Any]:
    """Exact hint of OTHER_CHUNKS: a block inside one chunk against itself is empty."""
    q_first, q_last, k_first, k_last = q0 // 6, (q1 - 1) // 6, k0 // 6, (k1 - 1) // 6
    some = ~((q_first == q_last) & (k_first == k_last) & (q_first == k_first))
    every = (q_last < k_first) | (k_last < q_first)
    return some, every


# keys of the other chunks of 6 only: with the contiguous layout and P = 4, every rank's own
# block (ring step 0) is empty, so the first block comes from one hop behind
OTHER_CHUNKS = masks.from_function(
    lambda b, h, q, kv: q // 6 != kv // 6, "other chunks", blocks=_other_blocks
)

# chunks of 6 alternate between two documents: with the contiguous layout and P = 4, rank r
# needs only ranks r ± 2, so ring steps 1 and 3 are empty on every rank
ALTERNATE = masks.from_function(
    lambda b, h, q, kv: (q // 6) % 2 == (kv // 6) % 2, "alternate", blocks=_parity_blocks
)


def _cases() -> dict[str, dict[str, Any]]:
    """name -> keyword arguments of attention (and heads / kv_heads)."""
    return {
        "none": {},
        "causal": {"is_causal": True},
        "sliding window": {"mask": masks.sliding_window(5)},
        "sliding window both sides": {"mask": masks.sliding_window(3, 2)},
        "documents + causal": {"mask": masks.document(SEGMENTS), "is_causal": True},
        "prefix-LM": {"mask": masks.prefix_lm(9)},
        "alternating documents": {"mask": ALTERNATE},
        "other chunks": {"mask": OTHER_CHUNKS},
        "key padding + causal": {"mask": masks.key_padding([17, 24]), "is_causal": True},
        "rule without block hints": {
            "mask": masks.from_function(lambda b, h, q, kv: (q + kv) % 3 != 1, "thirds")
        },
        "sinks + causal": {"is_causal": True, "sinks": True},
        "window + documents + sinks": {
            "mask": masks.sliding_window(4) & masks.document(SEGMENTS),
            "sinks": True,
        },
        "grouped-query causal": {"is_causal": True, "kv_heads": 2},
    }


def _one_case(
    rank: int, size: int, layout: Layout, options: dict[str, Any], strategy: str = "ring"
) -> dict[str, Any]:
    options = dict(options)
    heads = options.pop("heads", 4)
    kv_heads = options.pop("kv_heads", heads)
    with_sinks = options.pop("sinks", False)
    gen = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
    full = [
        torch.randn(2, heads, N, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]
    grad = torch.randn(2, heads, N, 4, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64, requires_grad=True)
    extra: dict[str, Any] = {**options, "sinks": sinks if with_sinks else None}
    ref = qkv.scaled_dot_product_attention(
        full[0], full[1], full[2], **extra, enable_gqa=kv_heads != heads, backend="reference"
    )
    expected = torch.autograd.grad(ref, [*full, sinks], grad, allow_unused=True)

    shards = [shard(x, layout=layout) for x in full]
    kept = [s.detach().clone() for s in shards]
    out = ring_attention(shards[0], shards[1], shards[2], **extra, layout=layout, strategy=strategy)
    got = torch.autograd.grad(out, [*full, sinks], shard(grad, layout=layout), allow_unused=True)
    errors = [float((out - shard(ref, layout=layout)).abs().max())]
    for g, e in zip(got[:3], expected[:3], strict=True):
        errors.append(float((shard(g, layout=layout) - shard(e, layout=layout)).abs().max()))
    if with_sinks:
        summed = got[3].clone()
        dist.all_reduce(summed)
        errors.append(float((summed - expected[3]).abs().max()))
    with torch.no_grad():
        again = ring_attention(
            shards[0], shards[1], shards[2], **extra, layout=layout, strategy=strategy
        )
    return {
        "error": max(errors),
        "repeat_identical": bool(torch.equal(again, out)),
        "inputs_untouched": all(torch.equal(a, b) for a, b in zip(shards, kept, strict=True)),
    }


def _errors_float32(layout: Layout, options: dict[str, Any]) -> list[float]:
    """The largest error of the float32 reference and of float32 ring attention against the
    float64 reference (output and gradients of q, k, v, sinks)."""
    gen = torch.Generator().manual_seed(99)
    exact = [torch.randn(2, 4, N, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    exact.append(torch.randn(4, generator=gen, dtype=torch.float64))
    grad = torch.randn(2, 4, N, 8, generator=gen, dtype=torch.float64)

    def run(dtype: torch.dtype, ring: bool) -> list[torch.Tensor]:
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in exact]
        if ring:
            q, k, v = (shard(x, layout=layout) for x in leaves[:3])
            out = ring_attention(q, k, v, **options, sinks=leaves[3], layout=layout)
            found = list(torch.autograd.grad(out, leaves, shard(grad, layout=layout).to(dtype)))
            dist.all_reduce(found[3])
        else:  # the whole sequence in one process
            out = qkv.scaled_dot_product_attention(
                leaves[0], leaves[1], leaves[2], **options, sinks=leaves[3], backend="reference"
            )
            found = list(torch.autograd.grad(out, leaves, grad.to(dtype)))
            out = shard(out, layout=layout)
        shards = [shard(g, layout=layout) for g in found[:3]]
        return [x.detach().double() for x in (out, *shards, found[3])]

    truth = run(torch.float64, False)
    return [
        max(
            float((a - b).abs().max()) for a, b in zip(run(torch.float32, ring), truth, strict=True)
        )
        for ring in (False, True)
    ]


def _message(call: Any) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_input(rank: int, size: int) -> dict[str, str]:
    q = torch.zeros(1, 2, 6, 4, dtype=torch.float64)
    odd = torch.zeros(1, 2, 6 * size + 1, 4)
    dense: Any = torch.ones(6, 6, dtype=torch.bool)
    uneven = torch.zeros(1, 2, 6 if rank == 0 else 4, 4, dtype=torch.float64)
    return {
        "length": _message(lambda: shard(odd, layout="zigzag")),
        "mask": _message(lambda: ring_attention(q, q, q, mask=dense)),
        "shapes": _message(lambda: ring_attention(uneven, uneven, uneven)) if size > 1 else "",
        "heads": _message(lambda: ring_attention(q, q, q, strategy="ulysses")),
        # a bad argument on rank 0 only: rank 0 raises its error, the others name rank 0,
        # and nobody waits for the collective timeout
        "one rank": _message(lambda: ring_attention(q, q, q, mask=dense if rank == 0 else None)),
        # after an error every rank can still run a call together
        "after": str(float(ring_attention(q, q, q, is_causal=True).abs().max())),
    }


def _counted(layout: Layout, options: dict[str, Any]) -> list[int]:
    """How many (query piece, key piece) pairs this rank's forward pass computes, and how
    many K/V exchanges it starts."""
    q = torch.zeros(1, 1, N // dist.get_world_size(), 4)
    with profiling() as profile:
        ring_attention(q, q, q, layout=layout, **options)
    return [profile.pairs, profile.exchanges]


def work(rank: int, size: int) -> dict[str, Any]:
    """Every case on this rank (run by each spawned process)."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {"bad": _bad_input(rank, size)}
    results["float32"] = {
        f"{layout} / {name}": _errors_float32(layout, options)
        for layout in LAYOUTS
        for name, options in (
            ("causal", {"is_causal": True}),
            ("window + documents", {"mask": masks.sliding_window(4) & masks.document(SEGMENTS)}),
        )
    }
    results["counts"] = {
        "zigzag causal": _counted("zigzag", {"is_causal": True}),
        "contiguous window": _counted("contiguous", {"mask": masks.sliding_window(2)}),
        "contiguous alternating": _counted("contiguous", {"mask": ALTERNATE}),
        "contiguous other chunks": _counted("contiguous", {"mask": OTHER_CHUNKS}),
    }
    for layout in LAYOUTS:
        for name, options in _cases().items():
            results[f"{layout} / {name}"] = _one_case(rank, size, layout, options)
        for name in GATHERED:
            results[f"{layout} / allgather / {name}"] = _one_case(
                rank, size, layout, _cases()[name], "allgather"
            )
            # ulysses needs H and Hkv divisible by P: 12 heads (6 key/value heads) for P ≤ 4
            options = {**_cases()[name], "heads": 12, "kv_heads": 6 if size < 4 else 12}
            results[f"{layout} / ulysses / {name}"] = _one_case(
                rank, size, layout, options, "ulysses"
            )
    return results


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ring_attention_equals_single_process_forward_and_backward(
    size: int, tmp_path: Path
) -> None:
    per_rank = run_group(size, work, tmp_path)
    failures = []
    for rank, results in enumerate(per_rank):
        bad = results.pop("bad")
        for name, (reference, ring) in results.pop("float32").items():
            # float32: within a small multiple of the float32 reference's own error
            if not ring <= 4 * reference + 1e-6:
                failures.append(f"rank {rank} float32 {name}: {ring} vs reference {reference}")
        counts = results.pop("counts")
        # zigzag: every rank computes the same 2P + 1 of its 4P (query, key) chunk pairs, the
        # rest are empty under the causal rule and skipped; every step has work somewhere
        assert counts["zigzag causal"] == [2 * size + 1, size - 1]
        # a window of 2 over N/P ≥ 6 positions reaches only this rank's and the previous
        # rank's block: one exchange, and the other P − 2 steps are neither computed nor sent
        assert counts["contiguous window"] == [1 if rank == 0 else 2, min(size - 1, 1)]
        # P = 4: the empty steps 1 and 3 are skipped on every rank; the one exchange goes
        # two hops; P = 2 and 3: every step has work somewhere
        assert (
            counts["contiguous alternating"] == {1: [1, 0], 2: [2, 1], 3: [3, 2], 4: [2, 1]}[size]
        )
        # P = 4: step 0 is empty everywhere: one move, then the two steps' exchanges
        other = {1: [1, 0], 2: [2, 1], 3: [3, 2], 4: [3, 3]}[size]
        assert counts["contiguous other chunks"] == other
        for name, result in results.items():
            if not (result["error"] <= 1e-10 and result["repeat_identical"]):
                failures.append(f"rank {rank} {name}: {result}")
            if not result["inputs_untouched"]:
                failures.append(f"rank {rank} {name}: inputs modified")
        assert "ValueError: sequence length" in bad["length"] and "Hint:" in bad["length"]
        assert "TypeError: mask must be a qkv.masks.Mask" in bad["mask"]
        if size > 1:
            assert "ValueError: the shards differ between ranks" in bad["shapes"]
        assert bad["after"] == "0.0"
        if rank == 0:
            assert bad["one rank"].startswith("TypeError: mask must be a qkv.masks.Mask")
        else:
            assert bad["one rank"].startswith("ValueError: rank 0 refused its input")
        if size in (3, 4):  # 2 heads do not split across 3 or 4 ranks
            assert "ValueError: strategy 'ulysses' needs the heads" in bad["heads"]
    assert not failures, "\n".join(failures)
    assert len(per_rank[0]) == len(LAYOUTS) * (len(_cases()) + 2 * len(GATHERED))


def _one_rank_fails(rank: int, size: int) -> dict[str, Any]:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # would wait for rank 1 forever
    return {}


def test_a_failing_rank_stops_the_group_instead_of_hanging(tmp_path: Path) -> None:
    # whichever rank reports first (rank 1's error, or rank 0 losing its peer), the group
    # ends with an error well before its deadline
    with pytest.raises((ProcessRaisedException, ProcessExitedException)):
        run_group(2, _one_rank_fails, tmp_path)
