"""Packing against padding for a batch of mixed lengths, and auto's own cost per call
(issue 27 §2, §3), peers in one run, interleaved.

    .venv/bin/python benchmarks/bench_packing.py [--rounds 7] [--threads 1]

Packing: 16 causal sequences of lengths drawn in [128, 1024] (seed 0), H = 8, D = 64,
float32, forward + backward: ``qkv.varlen_attention`` on the packed tokens against the same
batch padded to the longest, through qkv (``key_padding_lengths``-style mask rule, auto) and
torch's SDPA with a dense (B, 1, L, L) boolean mask. Time (median) and the memory a call adds
(peak resident set, measured apart from the timings).

Auto's cost: dense and causal forward at N = 1024 (B = 1, H = 8, D = 64), torch's SDPA
called directly against ``qkv.scaled_dot_product_attention`` (auto, which runs SDPA there),
and the dispatch alone (``explain_dispatch``, which decides the same way and computes
nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import qkv
from qkv import masks
from qkv.bench._memory import peak_memory
from qkv.kernels._compiled_forward import AUTO_COMPILE_VARIABLE

H, D = 8, 64


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _interleaved(peers: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    for run in peers.values():
        run()  # warm
    times: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(rounds):
        for name, run in peers.items():
            times[name].append(_timed(run))
    return {name: statistics.median(values) for name, values in times.items()}


def packing(rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 1025, (16,), generator=gen).tolist()
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = [torch.randn(total, H, D, generator=gen).requires_grad_(True) for _ in range(3)]
    padded = [torch.zeros(len(lengths), H, longest, D) for _ in range(3)]
    for source, target in zip(packed, padded, strict=True):
        for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
            target[b, :, :n] = source.detach()[start : start + n].transpose(0, 1)
    padded = [x.requires_grad_(True) for x in padded]
    rule = masks.key_padding(lengths) & masks.causal()
    dense = rule.dense(longest, longest, batch=len(lengths), xp=_torch_xp())  # (B, 1, L, L)

    def backward(out: torch.Tensor) -> None:
        out.sum().backward()  # type: ignore[no-untyped-call]

    pq, pk, pv = packed
    dq, dk, dv = padded

    def varlen() -> None:
        backward(qkv.varlen_attention(pq, pk, pv, cu, cu, longest, longest, is_causal=True))

    def padded_qkv() -> None:
        backward(qkv.scaled_dot_product_attention(dq, dk, dv, mask=rule))

    def padded_torch() -> None:
        backward(torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, attn_mask=dense))

    peers = {
        "packed (varlen)": varlen,
        "padded, qkv": padded_qkv,
        "padded, torch SDPA": padded_torch,
    }
    medians = _interleaved(peers, rounds)
    print(f"\npacking: 16 causal sequences, {total} tokens (longest {longest}), fwd + bwd")
    print(f"{'peer':<20}{'median ms':>10}{'ratio':>8}{'peak MiB':>10}")
    base = medians["packed (varlen)"]
    for name, run in peers.items():
        added, _ = peak_memory(run)
        ms, ratio = medians[name] * 1e3, medians[name] / base
        print(f"{name:<20}{ms:>10.1f}{ratio:>8.2f}{added / 2**20:>10.0f}")


def overhead(rounds: int) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 1024, D, generator=gen) for _ in range(3))
    print("\nauto's cost, forward, N = 1024 (B = 1, H = 8, D = 64)")
    print(f"{'mask':<8}{'sdpa ms':>9}{'auto ms':>9}{'auto/sdpa':>10}{'dispatch µs':>13}")
    for causal in (False, True):

        def direct(causal: bool = causal) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def auto(causal: bool = causal) -> Any:
            return qkv.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def dispatch(causal: bool = causal) -> Any:
            return qkv.explain_dispatch(q, k, v, is_causal=causal)

        medians = _interleaved({"sdpa": direct, "auto": auto}, rounds * 15)  # ~10 ms each
        decide = statistics.median(_timed(dispatch) for _ in range(200))
        ratio = medians["auto"] / medians["sdpa"]
        print(
            f"{'causal' if causal else 'dense':<8}{medians['sdpa'] * 1e3:>9.2f}"
            f"{medians['auto'] * 1e3:>9.2f}{ratio:>10.3f}{decide * 1e6:>13.0f}"
        )


def _torch_xp() -> Any:
    import array_api_compat.torch as torch_xp

    return torch_xp


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="PyTorch threads (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # The kernels as auto picks them without compiling (the compiled path on CPU has its own
    # script, bench_compiled_cpu.py): a compilation must not land inside a timed round.
    os.environ[AUTO_COMPILE_VARIABLE] = "0"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    overhead(args.rounds)
    packing(args.rounds)


if __name__ == "__main__":
    main()
