"""``qkv.nn`` modules on packed sequences (``cu_seqlens``, issue 27 §3): a packed row equals
each sequence run alone (outputs and parameter gradients), RoPE positions restart in each
sequence; what packing refuses, in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qkv import masks
from qkv.nn import MultiHeadAttention, TransformerBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [5, 9, 1, 7]
CU = torch.tensor([0, 5, 14, 15, 22])


def _alone_and_packed(module: torch.nn.Module, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, sum(LENGTHS), 32, generator=gen, dtype=torch.float64)
    packed = module(x, is_causal=causal, cu_seqlens=CU)
    pieces = torch.split(x, LENGTHS, dim=1)
    alone = torch.cat([module(piece, is_causal=causal) for piece in pieces], dim=1)
    return packed, alone


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("positional", [None, "rope", "alibi"])
def test_a_packed_row_equals_each_sequence_alone(causal: bool, positional: Any) -> None:
    torch.manual_seed(1)
    attn = MultiHeadAttention(32, 4, num_kv_heads=2, positional=positional).double()
    packed, alone = _alone_and_packed(attn, causal)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    grads = []
    for out in (packed, alone):
        attn.zero_grad()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        grads.append([p.grad.clone() for p in attn.parameters() if p.grad is not None])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_a_transformer_block_takes_cu_seqlens() -> None:
    torch.manual_seed(2)
    block = TransformerBlock(32, 4, positional="rope").double().eval()
    packed, alone = _alone_and_packed(block, True)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_a_rule_combines_with_packing_in_packed_positions() -> None:
    torch.manual_seed(3)
    attn = MultiHeadAttention(32, 4).double()
    x = torch.randn(1, 22, 32, dtype=torch.float64)
    window = masks.sliding_window(2)
    packed = attn(x, mask=window, cu_seqlens=CU)
    first = attn(x[:, :5], mask=window)
    torch.testing.assert_close(packed[:, :5], first, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"x": torch.randn(2, 22, 32)},
            r"takes a query of batch 1, \(1, T, E\), got \(2, 22, 32\)",
        ),
        ({"key_padding_lengths": [22]}, r"takes no key_padding_lengths"),
        ({"mask": torch.ones(22, 22, dtype=torch.bool)}, r"takes a mask only as a qkv.masks rule"),
        (
            {"cu_seqlens": [0, 5, 21]},
            r"MultiHeadAttention: cu_seqlens ends at 21 but query has 22 tokens",
        ),
    ],
)
def test_packing_refuses_what_does_not_fit(change: dict[str, Any], match: str) -> None:
    attn = MultiHeadAttention(32, 4)
    arguments: dict[str, Any] = {"x": torch.randn(1, 22, 32), "cu_seqlens": CU}
    arguments.update(change)
    x = arguments.pop("x")
    with pytest.raises(ValueError, match=match):
        attn(x, **arguments)
