"""``qkv.varlen_attention`` against flash-attn's expectations for ``flash_attn_varlen_func``.

Ported from Dao-AILab/flash-attention ``tests/test_flash_attn.py`` (read, not copied):

- ``test_flash_attn_varlen_output``: batches of 4 sequences whose lengths are drawn at
  random below (seqlen_q, seqlen_k) (``generate_random_padding_mask(mode="random")``:
  between max(1, seqlen − 20) and seqlen), causal or not, a random local window or none,
  MHA / GQA / MQA (``mha_type``), softcap 0 or 50 (with q scaled by it, as there);
- ``test_flash_attn_varlen_causal``: causal, (seqlen_q, seqlen_k) swapped or not, so that a
  sequence has more queries than keys (rows that see no key give zeros);

each compared, output and dq, dk, dv, with the readable reference run on every sequence
alone (flash-attn's ``attention_ref`` with padding; here in float64, where qkv's paths agree
to rounding: tolerance 1e-10 instead of flash-attn's "2× PyTorch's float16 error").
Causality and the window are aligned to each sequence's end, as in flash-attn ≥ 2.1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv
from qkv import masks
from tests.support.backends import backend_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-10


def _lengths(gen: torch.Generator, longest: int, batch: int) -> list[int]:
    """flash-attn's ``generate_random_padding_mask(mode="random")`` lengths."""
    return torch.randint(max(1, longest - 20), longest + 1, (batch,), generator=gen).tolist()


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths_q: list[int],
    lengths_k: list[int],
    *,
    causal: bool,
    window: tuple[int, int],
    score_mod: Any,
) -> torch.Tensor:
    """Each sequence alone on the reference, (total_q, H, Dv): flash-attn's attention_ref."""
    heads = q.shape[1]
    outs, start_q, start_k = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        qs = q[start_q : start_q + lq].transpose(0, 1)  # (H, lq, D)
        ks, vs = (x[start_k : start_k + lk].transpose(0, 1) for x in (k, v))  # (Hkv, lk, ·)
        start_q, start_k = start_q + lq, start_k + lk
        left, right = window
        if causal:
            right = 0 if right < 0 else min(right, 0)
        mask = None
        if left >= 0 or right >= 0:
            mask = masks.sliding_window(
                left if left >= 0 else lk + lq,
                right if right >= 0 else lk + lq,
                alignment="bottom-right",
            )
        if lk == 0:
            outs.append(q.new_zeros(lq, heads, v.shape[2]))
            continue
        out = qkv.scaled_dot_product_attention(
            qs, ks, vs, mask=mask, score_mod=score_mod, enable_gqa=True, backend="reference"
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _compare(
    backend: str,
    lengths_q: list[int],
    lengths_k: list[int],
    heads: tuple[int, int],
    d: int,
    *,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    nheads, nheads_k = heads
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, nheads, d, generator=gen, dtype=torch.float64)
    if softcap > 0:
        q = q * softcap  # flash-attn: "Ensure the values of qk are at least within softcap range"
    k, v = (torch.randn(total_k, nheads_k, d, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    score_mod = masks.softcap(softcap) if softcap > 0 else None
    try:
        out = qkv.varlen_attention(
            q,
            k,
            v,
            _cu(lengths_q),
            _cu(lengths_k),
            max(lengths_q),
            max(lengths_k),
            is_causal=causal,
            window_size=window,
            score_mod=score_mod,
            backend=backend,
        )
    except ValueError as refused:  # a backend that cannot run it (sdpa: no score_mod)
        if "cannot run this call" not in str(refused):
            raise
        pytest.skip(str(refused))
    want = _per_sequence(
        q, k, v, lengths_q, lengths_k, causal=causal, window=window, score_mod=score_mod
    )
    torch.testing.assert_close(out, want, rtol=0, atol=TOL)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g)
    expected = torch.autograd.grad(want, (q, k, v), g)
    for a, b, name in zip(got, expected, ("dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL * max(1.0, softcap), msg=name)


BACKENDS = backend_names(reference=False)  # auto runs one of them; flex takes no float64 on CPU


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 50.0])
@pytest.mark.parametrize(
    ("seqlen_q", "seqlen_k", "mha_type"),  # flash-attn crosses them; here each pair one type
    [
        (1, 147, "mha"),
        (113, 203, "gqa"),
        (128, 217, "mqa"),
        (108, 256, "gqa"),
        (256, 128, "mha"),
    ],
)
def test_flash_attn_varlen_output(
    seqlen_q: int,
    seqlen_k: int,
    softcap: float,
    causal: bool,
    local: bool,
    mha_type: str,
    backend: str,
) -> None:
    gen = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
    nheads = 6 if softcap == 0.0 else 4
    nheads_k = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 2)
    window = (-1, -1)
    if local:
        left, right = torch.randint(0, seqlen_k, (2,), generator=gen).tolist()
        window = (left, right)
    _compare(
        backend,
        _lengths(gen, seqlen_q, 4),
        _lengths(gen, seqlen_k, 4),
        (nheads, nheads_k),
        32,
        causal=causal,
        window=window,
        softcap=softcap,
        seed=seqlen_q + seqlen_k,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("swap_sq_sk", [False, True])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(1, 239), (3, 799), (127, 513), (113, 203)])
def test_flash_attn_varlen_causal(
    seqlen_q: int, seqlen_k: int, local: bool, swap_sq_sk: bool, backend: str
) -> None:
    if swap_sq_sk:
        seqlen_q, seqlen_k = seqlen_k, seqlen_q
    gen = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
    window = (-1, -1)
    if local:
        left, right = torch.randint(0, seqlen_k, (2,), generator=gen).tolist()
        window = (left, right)
    _compare(
        backend,
        _lengths(gen, seqlen_q, 8),
        _lengths(gen, seqlen_k, 8),
        (3, 3),
        16,
        causal=True,
        window=window,
        softcap=0.0,
        seed=seqlen_q + seqlen_k,
    )
