"""Activation patching of every head: qkv's sweep against a forward per head, TransformerLens
and nnsight, on the same model, measured in the same run.

A GPT-2 causal language model of 12 layers and 12 heads with a small width (hidden size 96,
head size 8, vocabulary 512; random weights built from its config: nothing is downloaded;
float32, B = 1) is swept over the same clean and corrupt prompts of N tokens (one token
changed), metric logit[3] − logit[7] at the last token. The sweeps:

- ``qkv.patching``: the clean and corrupt prompts run once each; each layer's 12 heads run as
  one batch (one head per batch row) from the kept input of that layer's block: only the
  layers above run. Every head on torch's SDPA kernel.
- ``qkv, a forward per head``: ``qkv.intervene`` with one patch, the whole model per head
  (what ``qkv.patching`` did before: the same edits, no reuse).
- ``eager + hooks``: ``attn_implementation="eager"``, the clean contexts captured by a forward
  pre-hook on each ``c_proj``, then one forward per head with a pre-hook writing its slice.
- ``TransformerLens``: ``TransformerBridge.boot_transformers`` on the model saved to a folder,
  ``run_with_cache`` on the clean prompt, then
  ``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` (a forward per head on
  ``hook_z``; the bridge forces eager attention).
- ``nnsight``: ``LanguageModel`` on the same model, the clean ``c_proj`` inputs saved in one
  trace, then one trace per head writing that head's slice.

``--by position`` patches one head at one position at a time, at 4 positions (the token
before the changed one, the changed one, one between it and the end, the last):
``qkv.edits.position_patching``, TransformerLens's ``generic_activation_patch`` on ``z``
with those (layer, pos, head) rows, and the nnsight loop writing one position.

TransformerLens and nnsight are measured when they can be imported (``pip install
'qkv[interp]'``). Every table is checked against qkv's (to 1e-4). Time: the whole sweep (the
clean run and the cache included), the median of the repeats, the sweeps alternating; each
sweep runs once on 8 tokens first. The sweeps live in ``qkv.edits._timing``, which ``qkv
bench``'s patching section runs too.

Usage:
    python benchmarks/bench_patching.py                 # N = 128, 512, 1024
    python benchmarks/bench_patching.py --quick         # a smoke run: 2 layers, N = 16
    python benchmarks/bench_patching.py --lengths 256 --repeats 3 --threads 2
    python benchmarks/bench_patching.py --clock cpu     # CPU seconds, on a shared machine
    python benchmarks/bench_patching.py --by position   # a head at one position at a time
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from qkv.edits._timing import BY, QKV, build, forwards, measure, sweeps, warm

HEADER = "| N | sweep | forwards | time (s) | x qkv |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, N = 16")
    parser.add_argument("--lengths", type=int, nargs="+", help="N (default 128 512 1024)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each sweep (median)")
    parser.add_argument("--threads", type=int, default=0, help="PyTorch threads (0: default)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this process's CPU time (on a machine shared with other jobs)",
    )
    parser.add_argument(
        "--only", nargs="+", metavar="SWEEP", help="measure these sweeps only (and qkv's)"
    )
    parser.add_argument(
        "--by",
        choices=BY,
        default="head",
        help="a head at all positions, at one at a time (4), or its path to a later head's keys",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [16] if args.quick else (args.lengths or [128, 512, 1024])
    model = build(args.quick)
    found = sweeps(model, args.only, args.by)
    config = model.config
    print(
        f"GPT-2, {config.n_layer} layers x {config.n_head} heads, hidden {config.n_embd}, "
        f"float32, B=1\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.clock} clock, by {args.by}"
    )
    print(HEADER)
    print("|---|---|---|---|---|")
    warm(model, found)
    for length in lengths:
        try:
            repeats = 1 if args.quick else args.repeats
            seconds = measure(model, found, length, repeats, args.clock)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        for name, median in seconds.items():
            ratio = median / seconds[QKV]
            runs = forwards(model, name, args.by)
            print(f"| {length} | {name} | {runs} | {median:.3f} | {ratio:.2f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
