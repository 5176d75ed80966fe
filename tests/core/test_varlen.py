"""``qkv.varlen_attention``: what it checks (one line each), and its edge cases. Its results
against flash-attn's expectations: tests/peers/test_varlen_flash_port.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv

CU = torch.tensor([0, 3, 8], dtype=torch.int32)
Q = torch.randn(8, 4, 16)
K = V = torch.randn(8, 2, 16)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"query": torch.randn(1, 8, 4, 16)},
            r"query must be a tensor \(total, heads, dim\), got shape \(1, 8, 4, 16\)",
        ),
        (
            {"value": torch.randn(7, 2, 16)},
            r"key \(8, 2, 16\) and value \(7, 2, 16\) must have the same tokens",
        ),
        (
            {"key": torch.randn(8, 3, 16), "value": torch.randn(8, 3, 16)},
            r"key/value heads \(3\) must divide the query heads \(4\)",
        ),
        (
            {"cu_seqlens_q": torch.tensor([1, 3, 8])},
            r"cu_seqlens_q must start at 0 and never decrease, got \[1, 3, 8\]",
        ),
        (
            {"cu_seqlens_k": torch.tensor([0, 5, 3, 8])},
            r"cu_seqlens_k must start at 0 and never decrease",
        ),
        (
            {"cu_seqlens_q": torch.tensor([0, 3, 7])},
            r"cu_seqlens_q ends at 7 but query has 8 tokens",
        ),
        (
            {"cu_seqlens_q": torch.tensor([0.0, 8.0])},
            r"cu_seqlens_q must be integers of shape \(B \+ 1,\), got float32",
        ),
        ({"cu_seqlens_k": torch.tensor([0, 8])}, r"cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
        (
            {"max_seqlen_q": 4},
            r"max_seqlen_q must be an integer ≥ the longest sequence's queries \(5\), got 4",
        ),
        ({"window_size": (3, -2)}, r"window_size must be two integers \(left, right\)"),
    ],
)
def test_bad_input_says_what_is_wrong(change: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {
        "query": Q,
        "key": K,
        "value": V,
        "cu_seqlens_q": CU,
        "cu_seqlens_k": CU,
        "max_seqlen_q": 5,
        "max_seqlen_k": 5,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        qkv.varlen_attention(**arguments)


def test_sequences_without_keys_or_queries() -> None:
    """An empty key sequence gives its queries zeros; an empty query sequence gives no rows;
    no tokens at all gives an empty result."""
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    k = v = torch.randn(4, 2, 8, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 2, 5])
    cu_k = torch.tensor([0, 0, 3, 4])
    out = qkv.varlen_attention(q, k, v, cu_q, cu_k, 3, 3)
    assert torch.equal(out[:2], torch.zeros(2, 2, 8, dtype=torch.float64))
    alone = qkv.scaled_dot_product_attention(
        q[2:].transpose(0, 1), k[3:].transpose(0, 1), v[3:].transpose(0, 1)
    )
    torch.testing.assert_close(out[2:], alone.transpose(0, 1))
    none = qkv.varlen_attention(
        q[:0], k[:0], v[:0], torch.tensor([0, 0]), torch.tensor([0, 0]), 0, 0
    )
    assert tuple(none.shape) == (0, 2, 8)


def test_packing_skips_the_blocks_between_sequences() -> None:
    """Internally the document rule: the tiled kernel's plan leaves cross-sequence blocks
    empty, so 16 sequences of 256 cost what 16 separate calls cost, not one of 4096²."""
    lengths = [256] * 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = k = v = torch.randn(4096, 1, 16)
    report = qkv.explain_dispatch(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask=qkv.attention._packed.packed_rule(cu.tolist(), cu.tolist(), None, 0),
    )
    assert report.backend == "tiled" and "empty blocks are skipped" in dict(report.reasons)["tiled"]
    out = qkv.varlen_attention(q, k, v, cu, cu, 256, 256, is_causal=True)
    first = qkv.scaled_dot_product_attention(
        q[:256].transpose(0, 1), k[:256].transpose(0, 1), v[:256].transpose(0, 1), is_causal=True
    )
    torch.testing.assert_close(out[:256], first.transpose(0, 1), rtol=1e-5, atol=1e-5)
