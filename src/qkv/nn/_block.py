"""``TransformerBlock``: pre-norm attention and MLP, each added back to the residual stream.

    x = x + dropout(attention(LayerNorm(x)))
    x = x + dropout(MLP(LayerNorm(x)))        MLP: Linear(E, F) → GELU → Linear(F, E)

Shape legend: B batch, L length, E embed_dim, F the MLP's hidden width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from qkv.masks import Mask
from qkv.nn._cache import KVCache
from qkv.nn._mha import MultiHeadAttention
from qkv.nn._paged import PagedKVCache
from qkv.positional import ALiBi, RoPE

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: self-attention then an MLP, both residual.

    Args:
        embed_dim: E.
        num_heads: H. num_kv_heads: Hkv (GQA/MQA; default H).
        mlp_dim: F, the MLP's hidden width (default 4·E).
        dropout: dropout on the attention weights and on both residual branches.
        bias: biases in the projections and the MLP.
        positional: as in :class:`MultiHeadAttention` (``"rope"``, ``"alibi"``, ...).
        sinks: learn one attention-sink logit per head (:class:`MultiHeadAttention`).

    Example:
        >>> import torch
        >>> block = TransformerBlock(32, num_heads=4, positional="rope")
        >>> block(torch.randn(2, 7, 32), is_causal=True).shape      # (B, L, E)
        torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        mlp_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        positional: str | RoPE | ALiBi | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            bias=bias,
            dropout=dropout,
            positional=positional,
            sinks=sinks,
        )
        hidden = 4 * embed_dim if mlp_dim is None else mlp_dim
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(
                f"mlp_dim must be a positive integer, got {mlp_dim!r}. "
                "Hint: the usual width is 4 · embed_dim (the default)."
            )
        self.attn_norm = nn.LayerNorm(embed_dim)
        self.mlp_norm = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, hidden, bias=bias),
            nn.GELU(),
            nn.Linear(hidden, embed_dim, bias=bias),
        )
        self.residual_dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | Mask | None = None,
        key_padding_lengths: torch.Tensor | Sequence[int] | None = None,
        is_causal: bool = False,
        cache: KVCache | PagedKVCache | None = None,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """(B, L, E) → (B, L, E). The options are those of :meth:`MultiHeadAttention.forward`
        (``cu_seqlens``: packed sequences in x of shape (1, T, E))."""
        attended = self.attn(
            self.attn_norm(x),
            mask=mask,
            key_padding_lengths=key_padding_lengths,
            is_causal=is_causal,
            cache=cache,
            cu_seqlens=cu_seqlens,
        )
        x = x + self.residual_dropout(attended)
        out: torch.Tensor = x + self.residual_dropout(self.mlp(self.mlp_norm(x)))
        return out
