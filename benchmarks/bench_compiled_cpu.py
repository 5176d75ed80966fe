"""Compiled FlexAttention's forward with qkv's tiled backward on CPU (issue 27 §1), against
the tiled kernel and SDPA with a dense mask, measured in one run, interleaved.

    .venv/bin/python benchmarks/bench_compiled_cpu.py [--length 4096] [--rounds 7]

For each structured mask (a causal window of 512 keys; 16 causal documents packed in one
row), B = 1, H = 8, D = 64, float32: the forward (no gradient) and the forward + backward,
each peer timed once per round, rounds interleaved, the median printed with its ratio to
the tiled kernel. The first call of each compiled path (its compile) is timed apart. The
forward also times torch's own compiled FlexAttention given qkv's block mask
(``torch-flex``: what ``flex`` and ``auto`` are held to).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import qkv
from qkv import masks
from qkv.bench._measure import compiled_flex, flex_block_mask
from qkv.bench._suite import torch_mask_mod
from qkv.kernels._compiled_forward import COMPILED, REPEATS, VERDICT_SAMPLES

B, H, D = 1, 8, 64


def _rule(kind: str, length: int) -> masks.Mask:
    if kind == "window 512":
        return masks.sliding_window(511)
    ids = np.repeat(np.arange(16), -(-length // 16))[:length]
    return masks.document(ids) & masks.causal()


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _peers(kind: str, rule: masks.Mask, length: int, grad: bool) -> dict[str, Callable[[], Any]]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, length, D, generator=gen).requires_grad_(grad) for _ in range(3))
    dense = rule.dense(length, length, xp=_torch_xp())  # (1, 1, N, N), built before

    def call(backend: str) -> Callable[[], Any]:
        def run() -> Any:
            out = qkv.scaled_dot_product_attention(q, k, v, mask=rule, backend=backend)
            if grad:
                out.sum().backward()
            return out

        return run

    def sdpa() -> Any:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        if grad:
            out.sum().backward()  # type: ignore[no-untyped-call]
        return out

    peers = {"tiled": call("tiled"), "flex": call("flex"), "auto": call("auto"), "sdpa-dense": sdpa}
    if not grad:  # torch's own compiled FlexAttention, given qkv's block mask (no CPU backward)
        mask_mod = torch_mask_mod("window" if kind == "window 512" else "documents", length)
        block_mask = flex_block_mask(rule, mask_mod, length)
        compiled = compiled_flex()

        def torch_flex() -> Any:
            return compiled(q, k, v, block_mask=block_mask)

        peers["torch-flex"] = torch_flex
    return peers


def _torch_xp() -> Any:
    import array_api_compat.torch as torch_xp

    return torch_xp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, N = {args.length}")
    print(f"{'case':<14}{'pass':<9}{'peer':<12}{'median ms':>10}{'/ tiled':>9}{'compile s':>11}")
    for kind in ("window 512", "16 documents"):
        rule = _rule(kind, args.length)
        for grad in (False, True):
            peers = _peers(kind, rule, args.length, grad)
            compile_s: dict[str, float] = {}
            for name, run in list(peers.items()):  # first calls: compiles, auto's repeats
                before = dict(COMPILED.seconds)
                try:
                    for _ in range(REPEATS + VERDICT_SAMPLES + 1 if name == "auto" else 1):
                        run()
                except Exception as error:  # torch's own compile of a mask_mod can fail
                    del peers[name]
                    print(f"{kind:<14}{'forward':<9}{name:<12} failed: {str(error)[:60]}")
                    continue
                new = set(COMPILED.seconds) - set(before)
                if new:
                    compile_s[name] = sum(COMPILED.seconds[key] for key in new)
            times: dict[str, list[float]] = {name: [] for name in peers}
            for _ in range(args.rounds):
                for name, run in peers.items():
                    times[name].append(_timed(run))
            base = statistics.median(times["tiled"])
            for name, values in times.items():
                median = statistics.median(values)
                compiled = f"{compile_s[name]:.1f}" if name in compile_s else ""
                print(
                    f"{kind:<14}{'fwd+bwd' if grad else 'forward':<9}{name:<12}"
                    f"{median * 1e3:>10.1f}{median / base:>9.2f}{compiled:>11}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
