"""Nested jagged tensors in ``qkv.scaled_dot_product_attention`` (issue 27 §3): each sequence
attends only to itself, forward and backward equal to the reference run on each sequence
alone; torch's own SDPA on the same jagged tensors agrees where it runs (CPU: no causal)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
]

LENGTHS_Q = [3, 7, 1, 12]
LENGTHS_K = [5, 7, 4, 9]


def _sequences(lengths: list[int], heads: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, heads, 8, generator=gen, dtype=torch.float64) for n in lengths]


def _jagged(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf (B, j, H, D), the (B, H, j, D) view attention takes)."""
    leaf = torch.nested.nested_tensor(sequences, layout=torch.jagged, requires_grad=True)
    return leaf, leaf.transpose(1, 2)


@pytest.mark.parametrize("alignment", ["top-left", "bottom-right"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_jagged_equals_each_sequence_alone(
    causal: bool, alignment: str, heads: int, kv_heads: int
) -> None:
    qs = _sequences(LENGTHS_Q, heads, 0)
    ks, vs = _sequences(LENGTHS_K, kv_heads, 1), _sequences(LENGTHS_K, kv_heads, 2)
    (q_leaf, q), (k_leaf, k), (v_leaf, v) = (_jagged(x) for x in (qs, ks, vs))
    options: dict[str, Any] = {
        "is_causal": causal,
        "causal_alignment": alignment,
        "enable_gqa": heads != kv_heads,
    }
    out = qkv.scaled_dot_product_attention(q, k, v, **options)
    assert out.is_nested and out.shape[0] == len(LENGTHS_Q) and out.shape[1] == heads
    tokens = out.transpose(1, 2).values()  # (total_q, H, D)
    grad = torch.randn(
        tokens.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    (tokens * grad).sum().backward()
    dense = [[x.clone().requires_grad_(True) for x in group] for group in (qs, ks, vs)]
    alone = [
        qkv.scaled_dot_product_attention(
            qi.transpose(0, 1),
            ki.transpose(0, 1),
            vi.transpose(0, 1),
            backend="reference",
            **options,
        ).transpose(0, 1)
        for qi, ki, vi in zip(*dense, strict=True)
    ]
    want = torch.cat(alone)
    torch.testing.assert_close(tokens, want, rtol=0, atol=1e-12)
    (want * grad).sum().backward()
    for leaf, group, name in zip((q_leaf, k_leaf, v_leaf), dense, "qkv", strict=True):
        grads = [x.grad for x in group]
        assert leaf.grad is not None and all(g is not None for g in grads)
        expected = torch.cat([g for g in grads if g is not None])
        torch.testing.assert_close(leaf.grad.values(), expected, rtol=0, atol=1e-12, msg=name)


def test_jagged_agrees_with_torchs_sdpa_on_jagged_tensors() -> None:
    """torch.nn.functional.scaled_dot_product_attention takes jagged tensors too (on CPU not
    with is_causal=True, which qkv takes)."""
    qs = [x.float() for x in _sequences(LENGTHS_Q, 2, 4)]
    q = torch.nested.nested_tensor(qs, layout=torch.jagged).transpose(1, 2)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    ours = qkv.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(
        ours.transpose(1, 2).values(), torch_out.transpose(1, 2).values(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"mask": torch.ones(3, 3, dtype=torch.bool)},
            r"mask= is an \(Lq, Lk\) array, which nested jagged inputs do not have",
        ),
        ({"return_weights": True}, r"return_weights=True with nested jagged inputs"),
        ({"key": torch.randn(4, 2, 12, 8)}, r"key must be a nested jagged tensor \(B, H, j, D\)"),
        ({"key": "fewer"}, r"must hold the same number of sequences"),
    ],
)
def test_jagged_inputs_that_do_not_fit_say_why(change: dict[str, Any], match: str) -> None:
    q = torch.nested.nested_tensor(
        [x.float() for x in _sequences(LENGTHS_Q, 2, 5)], layout=torch.jagged
    ).transpose(1, 2)
    arguments: dict[str, Any] = {"query": q, "key": q, "value": q}
    if change.get("key") == "fewer":
        fewer = torch.nested.nested_tensor(
            [x.float() for x in _sequences(LENGTHS_Q[:2], 2, 6)], layout=torch.jagged
        ).transpose(1, 2)
        change = {"key": fewer, "value": fewer}
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        qkv.scaled_dot_product_attention(**arguments)
