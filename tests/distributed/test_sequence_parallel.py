"""A small qkv.nn transformer trains on one sequence split across processes exactly as in one.

Each rank holds N/P positions of the sequence (zigzag and contiguous layouts, ring and
all-gather strategies); RoPE angles come from the layout's global positions; the loss of a
rank is its tokens' share of the whole sequence's mean loss; the parameter gradients are
summed over ranks with one all-reduce (what DDP does, up to its averaging). Over a few Adam
steps, in float64, the summed loss and every parameter gradient and value equal
single-process training on the whole sequence to 1e-10. The expectation that sequence
(context) parallel training must match single-device training step for step follows
PyTorch's context-parallel tests (test/distributed/tensor/test_attention.py), which compare
outputs and gradients with the unsplit run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import qkv
from qkv import masks
from qkv.distributed import Layout, shard
from tests.distributed._group import run_group

N, E, STEPS = 24, 16, 3
SEGMENTS = [[0] * 10 + [1] * 14, [0] * 5 + [1] * 19]


def _model() -> nn.Sequential:
    torch.manual_seed(7)  # the same initial parameters on every rank
    return nn.Sequential(
        *[
            qkv.nn.TransformerBlock(E, num_heads=4, num_kv_heads=2, positional="rope", sinks=True)
            for _ in range(2)
        ]
    ).double()


def _run(
    model: nn.Sequential,
    x: torch.Tensor,
    target: torch.Tensor,
    options: dict[str, Any],
    total: int,
    split: bool,
) -> tuple[list[float], list[list[torch.Tensor]], list[torch.Tensor]]:
    """Train STEPS Adam steps; returns the losses, the gradients per step and the final
    parameters. ``total`` is the number of loss terms of the whole sequence; ``split``: the
    ranks hold parts of the sequence (sum the loss and the gradients over them)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        out = x
        for block in model:
            out = block(out, **options)
        loss = ((out - target) ** 2).sum() / total
        loss.backward()
        summed = loss.detach().clone()
        if split:
            dist.all_reduce(summed)
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)  # DDP's all-reduce (a sum here, not an average)
        losses.append(float(summed))
        grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
        optimizer.step()
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def _case(layout: Layout, strategy: str, options: dict[str, Any]) -> float:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, N, E, generator=gen, dtype=torch.float64)
    target = torch.randn(2, N, E, generator=gen, dtype=torch.float64)
    total = target.numel()
    reference = _run(_model(), x, target, options, total, split=False)
    split = qkv.nn.split_sequence(_model(), layout=layout, strategy=strategy)
    here = [shard(t, layout=layout, dim=1) for t in (x, target)]
    got = _run(split, here[0], here[1], options, total, split=True)
    errors = [abs(a - b) for a, b in zip(got[0], reference[0], strict=True)]
    for mine, theirs in zip(got[1], reference[1], strict=True):
        errors += [float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)]
    errors += [float((a - b).abs().max()) for a, b in zip(got[2], reference[2], strict=True)]
    assert len(got[1][0]) == len(list(split.parameters()))  # every parameter has a gradient
    return max(errors)


def work(rank: int, size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    window = masks.sliding_window(5) & masks.document(SEGMENTS)
    results = {
        "zigzag ring causal": _case("zigzag", "ring", {"is_causal": True}),
        "contiguous ring window + documents": _case("contiguous", "ring", {"mask": window}),
        "zigzag allgather causal + padding": _case(
            "zigzag", "allgather", {"is_causal": True, "key_padding_lengths": [24, 17]}
        ),
    }
    block = qkv.nn.split_sequence(qkv.nn.TransformerBlock(E, num_heads=2))
    message = "no error"
    try:
        block(torch.zeros(1, 6, E), mask=torch.ones(6 * size, 6 * size, dtype=torch.bool))
    except TypeError as error:
        message = str(error)
    return {"errors": results, "dense mask": message}


@pytest.mark.parametrize("size", [2, 3])
def test_split_sequence_training_equals_single_process(size: int, tmp_path: Path) -> None:
    for rank, result in enumerate(run_group(size, work, tmp_path)):
        for name, error in result["errors"].items():
            assert error <= 1e-10, f"rank {rank} {name}: {error}"
        assert result["dense mask"].startswith("mask must be a qkv.masks.Mask rule")


def test_sequence_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"sequence_group must be a torch\.distributed"):
        qkv.nn.MultiHeadAttention(8, 2, sequence_group="world")
    with pytest.raises(ValueError, match="sequence_layout must be one of"):
        qkv.nn.split_sequence(qkv.nn.MultiHeadAttention(8, 2), layout="spiral")


def test_split_sequence_in_one_process_equals_the_plain_module() -> None:
    torch.manual_seed(0)
    plain = qkv.nn.TransformerBlock(8, num_heads=2, positional="rope", sinks=True).double()
    split = qkv.nn.split_sequence(
        qkv.nn.TransformerBlock(8, num_heads=2, positional="rope", sinks=True).double()
    )
    split.load_state_dict(plain.state_dict())
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    assert torch.allclose(split(x, is_causal=True), plain(x, is_causal=True), atol=1e-12)
    with pytest.raises(ValueError, match="does not support a KV cache"):
        split(x, cache=qkv.nn.KVCache())
