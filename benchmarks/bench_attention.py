"""The attention kernels against their peers: the suite of ``qkv bench``, with every knob.

``qkv bench`` runs the sections below with fixed settings and writes docs/benchmarks.md; this
script runs them with any settings and prints the tables (add ``--write`` to update the page).
The measurements themselves live in the package ``qkv.bench`` (so that ``qkv bench`` works
from an installed package); see ``qkv.bench._measure`` for how time and GFLOP/s are measured,
and ``qkv.bench._memory`` for peak memory.

Sections: dense (dense and causal forward at each length, every peer), masks (causal, sliding
window and packed documents against torch.compile(flex_attention), its compile time apart,
and SDPA, at 4096 and --mask-length, with peak memory), backward (forward + backward, dense
and causal, against SDPA flash at --train-length), long (causal forward + backward at one
long length, with peak memory), trace (the cost of the public entry over the kernel),
decode (one KV-cache decoding step against recomputing). A last table, targets, reads the
performance targets from the ratios of the same run.

Usage:
    python benchmarks/bench_attention.py                            # the default run
    python benchmarks/bench_attention.py --quick
    python benchmarks/bench_attention.py --only long --long-length 65536
    python benchmarks/bench_attention.py --only masks --mask-length 32768 --threads 2
    python benchmarks/bench_attention.py --only backward --train-length 8192
    python benchmarks/bench_attention.py --lengths 2048 8192 --repeats 7 --write
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qkv.cli import main as qkv_main


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", default=None)
    parser.add_argument("--lengths", nargs="+", type=int)
    parser.add_argument("--mask-length", type=int)
    parser.add_argument("--long-length", type=int)
    parser.add_argument("--decode-length", type=int)
    parser.add_argument("--train-length", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from qkv.bench import _suite

    base = _suite.Settings.quick_run() if args.quick else _suite.Settings()
    changes = {
        "lengths": tuple(args.lengths) if args.lengths else None,
        "mask_length": args.mask_length,
        "long_length": args.long_length,
        "decode_length": args.decode_length,
        "train_length": args.train_length,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    settings = _suite.Settings(
        **{**base.__dict__, **{k: v for k, v in changes.items() if v is not None}}
    )
    # qkv bench takes its settings from Settings.quick_run: hand it these.
    _suite.Settings.quick_run = classmethod(lambda cls: settings)  # type: ignore[method-assign,assignment]
    command = ["bench", "--quick"]
    if args.only:
        command += ["--only", *args.only]
    # a --quick run of qkv bench writes only where --output says
    command += ["--output", "docs/benchmarks.md"] if args.write else ["--no-write"]
    return qkv_main(command)


if __name__ == "__main__":
    raise SystemExit(main())
