"""Every mask rule and score modifier qkv ships, as named cases for the FlexAttention tests
(on CPU in tests/kernels, on CUDA in tests/cuda).

The lengths are not multiples of FlexAttention's 128-block, so the last blocks are ragged;
documents and padding differ per batch element where the rule allows it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from qkv import masks
from qkv.masks import Mask, ScoreMod
from tests.support.mask_cases import drawn

BATCH, HEADS, KV_HEADS = 2, 4, 2


def _documents(length: int) -> list[int]:
    """Three packed documents of uneven lengths."""
    first, second = length // 3, length // 3 + length // 4
    return [0] * first + [1] * (second - first) + [2] * (length - second)


def mask_cases(q_len: int, kv_len: int) -> dict[str, Mask]:
    """Named masks for (B = 2, H = 4, Lq, Lk); with Lq ≠ Lk only those that allow it: one
    drawn instance of every rule of the registry (``rule <name>``, from
    tests/support/mask_cases.py), then cases chosen for FlexAttention's blocks of 64."""
    square = q_len == kv_len

    def stripes(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv // 64) % 2 == 0

    rng = random.Random(f"{q_len} {kv_len}")
    cases = {f"rule {name}": rule for name, rule in drawn(rng, BATCH, q_len, kv_len).items()}
    cases |= {
        "causal": masks.causal(),
        "causal-bottom-right": masks.causal("bottom-right"),
        "window": masks.sliding_window(70),
        "window-both": masks.sliding_window(40, 25),
        "key-padding": masks.key_padding([kv_len - 37, kv_len]),
        "prefix-lm": masks.prefix_lm(50),
        "prefix-lm-per-batch": masks.prefix_lm([20, 90]),
        "full": masks.full(),
        "function-with-hint": masks.from_function(
            stripes,
            "stripes",
            blocks=lambda b, h, q0, q1, k0, k1: (
                ((k0 // 64) % 2 == 0) | (k1 - k0 > 64),
                ((k0 // 64) % 2 == 0) & ((k1 - 1) // 64 == k0 // 64),
            ),
        ),
        "function-no-hint": masks.from_function(lambda b, h, q, kv: (q + kv) % 3 != 1, "mod3"),
        "window-or-padding": masks.sliding_window(30) | masks.key_padding([9, 17]),
        "not-causal": ~masks.causal(),
    }
    if square:
        ids = _documents(q_len)
        per_batch = torch.tensor([ids, ids[::-1]])
        cases["documents-causal"] = masks.document(ids) & masks.causal()
        cases["documents-per-batch"] = masks.document(per_batch)
    return cases


def score_cases(heads: int = HEADS) -> dict[str, ScoreMod | Callable[..., Any]]:
    """Named score modifiers: qkv's own and a plain function."""
    return {
        "alibi": masks.alibi(heads),
        "alibi-top-left": masks.alibi(heads, alignment="top-left"),
        "softcap": masks.softcap(4.0),
        "alibi-then-softcap": masks.alibi(heads).then(masks.softcap(8.0)),
        "function": masks.score_function(lambda s, b, h, q, kv: s * 0.5 + (h - 1) * 0.25, "f"),
        "plain": lambda s, b, h, q, kv: torch.where((q - kv) % 5 == 0, s + 1.0, s),
    }


def inputs(
    q_len: int,
    kv_len: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dim: int = 16,
    seed: int = 0,
    kv_heads: int = KV_HEADS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, Lq, D), k and v (B, Hkv, Lk, D): GQA by default (H = 4, Hkv = 2)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, q_len, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(BATCH, kv_heads, kv_len, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(BATCH, kv_heads, kv_len, dim, generator=generator, dtype=torch.float64)
    return tuple(x.to(dtype=dtype, device=device) for x in (q, k, v))  # type: ignore[return-value]
