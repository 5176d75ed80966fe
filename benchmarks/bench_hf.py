"""Tracing one head of a Hugging Face model with qkv: its cost, beside eager's weights.

A 12-layer, 12-head Llama-like model (hidden size 768, multi-head attention, float32,
random weights built from its config: nothing is downloaded) runs a forward pass over N
tokens (B = 1) in three ways, measured in the same run:

- sdpa: the model's own ``attn_implementation="sdpa"``, untraced (the baseline);
- qkv.tracing: ``qkv.tracing(model=model, layers=-1, heads=0, queries=-1)``, the last
  layer's first head, last query row; every layer runs on the fast path and the traced one
  recomputes that row alone on qkv's reference;
- eager + output_attentions: ``attn_implementation="eager"`` with
  ``output_attentions=True``, what transformers needs to return any weight (all layers,
  heads and rows, O(layers · heads · N²) memory). Skipped where it would need more than
  half the memory available (``--eager-share``).

Time: the median of the repeats, the cases alternating within each repeat (the first run
is a warm-up, or a repeat when it takes over 5 s). Peak: the most memory the forward pass
added at any moment, measured by the operating system on that first run
(``qkv.bench.peak_memory``: PyTorch's CPU tensors are invisible to tracemalloc), after
handing the memory freed by earlier runs back to the system. Before timing, the script
checks that the traced output and recorded row equal eager's.

Usage:
    python benchmarks/bench_hf.py                   # N = 512, 2048, 4096
    python benchmarks/bench_hf.py --quick           # a smoke run: 2 small layers, N = 32, 64
    python benchmarks/bench_hf.py --lengths 1024 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaModel

import qkv
from qkv.bench import peak_memory

CASES = ("sdpa, untraced", "qkv.tracing, 1 head x 1 row", "eager + output_attentions")
HEADER = "| N | case | time (s) | x sdpa | peak (MiB) | x sdpa |"
TOLERANCE = 1e-4  # float32 through 12 layers: what the check before timing allows


@dataclass
class Result:
    """One case at one length: median seconds and peak bytes (None: skipped)."""

    length: int
    case: str
    seconds: float | None
    peak: int | None


def build(quick: bool) -> LlamaModel:
    """The model: 12 layers of hidden size 768 and 12 heads, or 2 small layers (quick)."""
    hidden, heads, layers = (64, 4, 2) if quick else (768, 12, 12)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = LlamaModel(config)
    model.train(False)
    model.set_attn_implementation("sdpa")
    return model


def _available() -> int | None:
    """Bytes of memory available now (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _release() -> None:
    """Hand the memory freed by earlier runs back to the system (glibc's ``malloc_trim``),
    so that the next peak is measured from what is really in use, not from a cache."""
    gc.collect()
    with contextlib.suppress(AttributeError, OSError):  # not glibc: as it is
        ctypes.CDLL(None).malloc_trim(0)


def eager_bytes(model: LlamaModel, length: int) -> int:
    """What eager + output_attentions holds at its peak: every layer's weights, kept, and
    a few more (N, N) matrices per head for the layer running (float32)."""
    config = model.config
    matrix = config.num_attention_heads * length * length * 4
    return (config.num_hidden_layers + 3) * matrix


def runs(model: LlamaModel, ids: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The three forward passes, by case."""

    def sdpa() -> Any:
        with torch.no_grad():
            return model(ids).last_hidden_state

    def traced() -> Any:
        with torch.no_grad(), qkv.tracing(model=model, layers=-1, heads=0, queries=-1) as t:
            out = model(ids).last_hidden_state
        return out, t

    def eager() -> Any:
        model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                return model(ids, output_attentions=True)
        finally:
            model.set_attn_implementation("sdpa")

    return dict(zip(CASES, (sdpa, traced, eager), strict=True))


def check(length: int, cases: dict[str, Callable[[], Any]]) -> str:
    """The traced output (and recorded row) against eager's (or sdpa's, where eager is
    skipped); exits when they disagree."""
    out, trace = cases[CASES[1]]()
    row = torch.from_numpy(trace["weights"].value[0, 0, 0])
    if CASES[2] in cases:
        eager = cases[CASES[2]]()
        output = (out - eager.last_hidden_state).abs().max().item()
        weights = (row - eager.attentions[-1][0, 0, -1]).abs().max().item()
        found = f"N={length}: vs eager, output {output:.1e}, recorded row {weights:.1e}"
    else:
        output = (out - cases[CASES[0]]()).abs().max().item()
        weights = 0.0
        found = f"N={length}: vs sdpa (eager skipped), output {output:.1e}"
    if output > TOLERANCE or weights > 1e-6:
        raise SystemExit(f"qkv.tracing disagrees with eager at {found}")
    return found


def measure(
    model: LlamaModel, length: int, repeats: int, *, eager_share: float = 0.5
) -> list[Result]:
    """Every case at one length: peak memory on a first run, then the timed repeats; eager
    + output_attentions only where it needs at most ``eager_share`` of the memory
    available."""
    ids = torch.randint(
        0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)
    )
    cases = runs(model, ids)
    available = _available()
    need = eager_bytes(model, length)
    if available is not None and need > available * eager_share:
        del cases[CASES[2]]
        print(
            f"N={length}: eager + output_attentions skipped: needs about {need / 2**30:.1f} "
            f"GiB, {available / 2**30:.1f} GiB available",
            file=sys.stderr,
        )
    print(check(length, cases), file=sys.stderr)
    times: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, int] = {}
    for name, run in cases.items():

        def first(run: Callable[[], Any] = run) -> float:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start

        _release()
        peaks[name], seconds = peak_memory(first)
        if seconds > 5.0:  # a long first run counts as a repeat (else: a warm-up)
            times[name].append(seconds)
    for i in range(repeats):
        order = list(cases)[i % len(cases) :] + list(cases)[: i % len(cases)]
        for name in order:
            if len(times[name]) < repeats:
                start = time.perf_counter()
                cases[name]()
                times[name].append(time.perf_counter() - start)
        print(f"N={length}: repeat {i + 1} of {repeats}", file=sys.stderr)
    return [
        Result(
            length,
            name,
            statistics.median(times[name]) if name in times else None,
            peaks.get(name),
        )
        for name in CASES
    ]


def table(results: Sequence[Result]) -> str:
    """A Markdown table (80 columns), each case also as a ratio to sdpa at its length."""
    base = {r.length: r for r in results if r.case == CASES[0]}
    lines = [HEADER, "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        ref = base[r.length]
        if r.seconds is None or r.peak is None:
            lines.append(f"| {r.length} | {r.case} | skipped | - | - | - |")
            continue
        time_ratio = f"{r.seconds / ref.seconds:.2f}" if ref.seconds else "-"
        peak_ratio = f"{r.peak / ref.peak:.1f}" if ref.peak else "-"
        lines.append(
            f"| {r.length} | {r.case} | {r.seconds:.2f} | {time_ratio} | "
            f"{r.peak / 2**20:.1f} | {peak_ratio} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Example: python benchmarks/bench_hf.py --lengths 512 2048 --repeats 3",
    )
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths N (512 2048 4096)")
    parser.add_argument("--repeats", type=int, help="timed runs per case (median; 3)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--eager-share",
        type=float,
        default=0.5,
        help="run eager + output_attentions only where it needs at most this share of "
        "the memory available (0.5)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 2 small layers, N = 32, 64"
    )
    args = parser.parse_args(argv)
    lengths = args.lengths or ([32, 64] if args.quick else [512, 2048, 4096])
    repeats = args.repeats or (1 if args.quick else 3)
    if min(lengths) < 1 or repeats < 1:
        parser.error("--lengths and --repeats must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.quick)
    config = model.config
    print(
        f"torch {torch.__version__}, qkv {qkv.__version__}, "
        f"{torch.get_num_threads()} threads; {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads, hidden {config.hidden_size}, float32, B = 1; "
        f"median of {repeats}",
        file=sys.stderr,
    )
    results = [r for n in lengths for r in measure(model, n, repeats, eager_share=args.eager_share)]
    print(table(results))
    print("x sdpa: the case's time (peak memory) / sdpa's, at the same N", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
