"""Decoding at the memory limit, and packed prefill (issue 38 §3): peers in one run,
interleaved, medians and spreads.

    .venv/bin/python benchmarks/bench_decode.py [--lengths 4096 16384 65536] [--rounds 9]
        [--threads 2] [--no-flex] [--quick]

Decode: one query token, 32 query heads and 8 key/value heads of 128 (GQA), float32, a cache
of N tokens. ``cache-read`` sums the same K and V once (the floor a step bound by memory
cannot beat); ``split-kv`` is ``qkv.flash_attn.flash_attn_with_kvcache`` on the contiguous
cache (B, N, Hkv, D) and ``split-kv-paged`` on pages of 256 under a shuffled block table
(both run qkv's split-KV kernel); ``sdpa`` is torch's SDPA with ``enable_gqa`` on (B, Hkv,
N, D); ``flex-compiled-paged`` is torch's compiled ``flex_attention`` on the same pages
(torch's ``PagedAttention`` block mask; compile time apart). Targets: split-kv ≤ 1.3 ×
cache-read, ≤ 1.0 × sdpa; split-kv-paged ≤ 1.0 × flex-compiled-paged.

Packed prefill: 8 causal documents of different lengths, N tokens in all (at most 8192),
8 heads of 64: ``flash_attn_varlen_func`` against one SDPA call per document (the
hand-written fallback) and SDPA on the batch padded to the longest.

The same rows are the ``decode`` section of ``qkv bench`` (``qkv.bench._decode``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkv.bench._decode import gqa_rows, packed_rows
from qkv.bench._measure import load_average
from qkv.bench._results import Row

TARGETS = (  # (peer, reference, goal)
    ("split-kv", "cache-read", 1.3),
    ("split-kv", "sdpa", 1.0),
    ("split-kv-paged", "flex-compiled-paged", 1.0),
)


def _print(rows: list[Row], reference: str) -> None:
    base = {r.length: r.seconds for r in rows if r.peer == reference}
    print(f"{'N':>6}  {'peer':<20} {'ms':>9} {'spread':>7} {'ratio':>6}  note")
    for row in rows:
        ms = "–" if row.seconds is None else f"{1e3 * row.seconds:9.2f}"
        ref = base.get(row.length)
        ratio = "" if row.seconds is None or not ref else f"{row.seconds / ref:6.2f}"
        spread = "" if row.spread is None else f"{100 * row.spread:6.0f}%"
        note = row.note
        if row.compile_seconds is not None:
            note = f"compiled in {row.compile_seconds:.1f} s " + note
        print(f"{row.length:>6}  {row.peer:<20} {ms:>9} {spread:>7} {ratio:>6}  {note}")


def _targets(rows: list[Row]) -> None:
    print("\ntargets (same run):")
    for peer, reference, goal in TARGETS:
        for length in sorted({r.length for r in rows}):
            of = {r.peer: r.seconds for r in rows if r.length == length}
            mine, theirs = of.get(peer), of.get(reference)
            if mine is None or theirs is None:
                continue
            ratio = mine / theirs
            met = "yes" if ratio <= goal else "no"
            print(f"  N={length:>6}  {peer} ÷ {reference}: {ratio:.2f} (goal ≤ {goal}) {met}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-flex", action="store_true", help="leave out compiled Flex")
    parser.add_argument("--quick", action="store_true", help="N = 1024, 3 rounds, no Flex")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds, args.no_flex = [1024], 3, True
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads, load before "
        f"{load_average()}"
    )
    start = time.perf_counter()
    decode: list[Row] = []
    for length in args.lengths:
        decode.extend(gqa_rows(length, args.rounds, flex=not args.no_flex))
    print("\nDecode step, GQA 32/8 heads of 128, float32 (ratio: time / cache-read)")
    _print(decode, "cache-read")
    _targets(decode)
    packed: list[Row] = []
    for length in sorted({min(n, 8192) for n in args.lengths}):
        packed.extend(packed_rows(length, args.rounds))
    print("\nPacked causal prefill, 8 documents, 8 heads of 64 (ratio: time / sdpa-loop)")
    _print(packed, "sdpa-loop")
    spreads = [r.spread for r in decode + packed if r.spread is not None]
    print(
        f"\nload after {load_average()}; median spread {100 * statistics.median(spreads):.0f}%; "
        f"{time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
