"""Train a small qkv transformer on one sequence split across processes, with torchrun.

    torchrun --nproc-per-node 2 examples/torchrun_ring.py
    torchrun --nproc-per-node 3 examples/torchrun_ring.py --layout contiguous --steps 5

Each of the P processes holds N/P positions of every sequence (``qkv.distributed.shard``,
zigzag layout by default); ``qkv.nn.split_sequence`` makes the model's attention layers run
ring attention across the processes, with RoPE angles taken from the global positions and
a sliding-window + document mask kept exactly. ``DistributedDataParallel`` averages the
parameter gradients; with each rank's loss the mean over its own tokens (equal shares),
that average is the gradient of the whole sequence's mean loss. To show it, every rank also
trains an unsplit copy of the model on the whole sequence and prints both losses.

Runs on CPU with gloo (the default), or on GPUs with NCCL (``--backend nccl``, one GPU per
process). Needs qkv with the torch extra. A bad argument is one line, printed by rank 0 only
(exit status 2 on every rank; torchrun then adds its own report of the failed ranks).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import qkv
from qkv import masks
from qkv.distributed import Layout, shard


class Stack(nn.Module):
    """Two pre-norm blocks with RoPE and sinks: (B, L, E) → (B, L, E)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            qkv.nn.TransformerBlock(width, num_heads=4, positional="rope", sinks=True)
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor, mask: masks.Mask) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, mask=mask)
        return x


def make_model(width: int, device: torch.device) -> Stack:
    """The same parameters on every rank (a fixed seed), in float64."""
    torch.manual_seed(0)
    return Stack(width).double().to(device)


def train(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    mask: masks.Mask,
    steps: int,
) -> list[float]:
    """Adam steps on the mean squared error; returns the loss of each step on this rank."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(x, mask)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


FAIL_GRACE = 10.0
"""Seconds a rank other than 0 waits before it exits on a bad argument."""


def fail(message: str) -> NoReturn:
    """End this rank with exit status 2; rank 0 alone prints the one line.

    The other ranks wait a little first: torchrun stops every rank as soon as one fails,
    and a rank that failed before rank 0 had printed would cut the line off.
    """
    if os.environ.get("RANK", "0") == "0":
        print(f"torchrun_ring.py: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(FAIL_GRACE)  # torchrun ends this rank once rank 0 has exited
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors through :func:`fail` (one line, once)."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message}. Hint: torchrun --nproc-per-node 2 examples/torchrun_ring.py --help")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous", "striped"))
    parser.add_argument("--strategy", default="ring", choices=("ring", "allgather", "ulysses"))
    parser.add_argument("--length", type=positive, default=96, help="N, a multiple of 2·P")
    parser.add_argument("--steps", type=positive, default=3)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = parser.parse_args()
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    try:
        run(args)
    except (ValueError, TypeError) as error:  # qkv's one-line errors, raised on every rank
        fail(str(error).splitlines()[0])


def run(args: argparse.Namespace) -> None:
    """Train the split model and the whole one; rank 0 prints both losses of each step."""
    layout: Layout = args.layout
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    n, width = args.length, 32
    gen = torch.Generator().manual_seed(1)  # the same sequences on every rank
    x = torch.randn(2, n, width, generator=gen, dtype=torch.float64).to(device)
    target = torch.randn(2, n, width, generator=gen, dtype=torch.float64).to(device)
    documents = [[0] * (n // 3) + [1] * (n - n // 3)] * 2
    mask = masks.sliding_window(n // 4) & masks.document(documents)  # in global positions

    split = qkv.nn.split_sequence(make_model(width, device), layout=layout, strategy=args.strategy)
    ddp = DistributedDataParallel(split)
    here = [shard(t, layout=layout, dim=1) for t in (x, target)]  # (2, N/P, width)
    mine = train(ddp, here[0], here[1], mask, args.steps)
    whole = train(make_model(width, device), x, target, mask, args.steps)

    means = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(means)  # the whole sequence's mean loss: the mean of equal shares
    means /= size
    for step, (split_loss, one) in enumerate(zip(means.tolist(), whole, strict=True)):
        if rank == 0:
            print(
                f"step {step + 1}: loss {split_loss:.12f} on {size} processes, "
                f"{one:.12f} in one (difference {abs(split_loss - one):.1e})"
            )
    # DDP's reducer holds work on the group inside a reference cycle: collect it now, not at
    # interpreter exit (where gloo may abort the process), then destroy the group together
    del ddp
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
