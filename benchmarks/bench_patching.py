"""Activation patching of every head: qkv.patching against the same sweep on eager hooks.

A Llama-like causal language model (random weights built from its config: nothing is
downloaded; float32, B = 1) is swept two ways over the same clean and corrupt prompts of N
tokens, measured in the same run:

- qkv.patching: the clean run's contexts recorded once on the fast path, then one forward
  per (layer, head) with that head's slice of the output projection's input replaced; every
  head runs on torch's SDPA kernel;
- eager + hooks: what TransformerLens-style code does: ``attn_implementation="eager"`` (the
  whole (N, N) pattern of every head formed), the clean contexts captured by a forward
  pre-hook on each ``o_proj``, then one forward per (layer, head) with a pre-hook that
  writes that head's slice.

Before timing, the script checks that both tables agree (to 1e-4). Time: the whole sweep
(recording included), the median of the repeats, the two alternating.

Usage:
    python benchmarks/bench_patching.py                 # N = 128, 512, 1024
    python benchmarks/bench_patching.py --quick         # a smoke run: N = 16
    python benchmarks/bench_patching.py --lengths 256 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import qkv

HEADER = "| N | sweep | forwards | time (s) | x qkv |"
TOLERANCE = 1e-4


def build(quick: bool) -> Any:
    size: dict[str, Any] = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
        if quick
        else {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4}
    )
    config = LlamaConfig(vocab_size=1000, num_attention_heads=8, num_key_value_heads=8, **size)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    return model.eval()


def prompts(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    clean = torch.randint(0, 1000, (1, length), generator=generator)
    corrupt = clean.clone()
    corrupt[0, length // 2] = (corrupt[0, length // 2] + 1) % 1000
    return clean, corrupt


def metric(logits: torch.Tensor) -> float:
    return float(logits[0, -1, 3] - logits[0, -1, 7])


@contextmanager
def _eager(model: Any) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def eager_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> list[list[float]]:
    layers = model.model.layers
    heads = model.config.num_attention_heads
    width = model.config.hidden_size // heads
    captured: dict[int, torch.Tensor] = {}

    def capture(index: int) -> Callable[..., None]:
        def hook(_: Any, args: tuple[torch.Tensor, ...]) -> None:
            captured[index] = args[0].clone()

        return hook

    def write(index: int, head: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        part = slice(head * width, (head + 1) * width)

        def hook(_: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            edited = args[0].clone()
            edited[..., part] = captured[index][..., part]
            return (edited, *args[1:])

        return hook

    table = []
    with torch.no_grad(), _eager(model):
        handles = [
            layer.self_attn.o_proj.register_forward_pre_hook(capture(i))
            for i, layer in enumerate(layers)
        ]
        model(clean)
        for handle in handles:
            handle.remove()
        for i, layer in enumerate(layers):
            row = []
            for head in range(heads):
                handle = layer.self_attn.o_proj.register_forward_pre_hook(write(i, head))
                row.append(metric(model(corrupt).logits))
                handle.remove()
            table.append(row)
    return table


def qkv_sweep(model: Any, clean: torch.Tensor, corrupt: torch.Tensor) -> list[list[float]]:
    values: list[list[float]] = qkv.patching(model, clean, corrupt, metric).values
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [16] if args.quick else args.lengths
    repeats = 1 if args.quick else args.repeats
    model = build(args.quick)
    cells = model.config.num_hidden_layers * model.config.num_attention_heads
    # qkv: the clean run recorded, the corrupt run's metric, one run per head; eager: the
    # clean run captured, one run per head
    forwards = {"qkv.patching": cells + 2, "eager + hooks": cells + 1}
    config = model.config
    print(
        f"Llama-like, {config.num_hidden_layers} layers x {config.num_attention_heads} heads, "
        f"hidden {config.hidden_size}, float32, B = 1, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(HEADER)
    print("|---|---|---|---|---|")
    for length in lengths:
        clean, corrupt = prompts(length)
        ours, theirs = qkv_sweep(model, clean, corrupt), eager_sweep(model, clean, corrupt)
        worst = max(
            abs(a - b)
            for ra, rb in zip(ours, theirs, strict=True)
            for a, b in zip(ra, rb, strict=True)
        )
        if worst > TOLERANCE:
            print(f"the tables differ by {worst:.2e} at N = {length}", file=sys.stderr)
            return 1
        times: dict[str, list[float]] = {"qkv.patching": [], "eager + hooks": []}
        for _ in range(repeats):
            for name, sweep in (("qkv.patching", qkv_sweep), ("eager + hooks", eager_sweep)):
                start = time.perf_counter()
                sweep(model, clean, corrupt)
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["qkv.patching"])
        for name, seconds in times.items():
            median = statistics.median(seconds)
            ratio = median / base
            print(f"| {length} | {name} | {forwards[name]} | {median:.3f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
