"""The models qkv trains: associative recall, an attention classifier, a bag-of-words baseline.

Shape legend: B batch, L tokens per sequence (padded to the longest of the batch), V
vocabulary size, E embedding (model) width, C classes.

Every model takes ``(tokens (B, L) int64, lengths (B,) int64)`` and returns logits (B, C);
the tokens after ``lengths[b]`` are padding (id 0). :func:`build_model` rebuilds a model
from the JSON config that :meth:`config` returns, which is what a checkpoint stores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qkv.nn import MultiHeadAttention, TransformerBlock

__all__ = [
    "MODEL_KINDS",
    "AttentionClassifier",
    "AttentionPooling",
    "BagOfWords",
    "RecallModel",
    "build_model",
]


class RecallModel(nn.Module):
    """Associative recall: embeddings, qkv transformer blocks, a readout at the query.

    ``k1 v1 k2 v2 ... kP vP q`` → the value of the key ``q``. Each position's input is its
    token's embedding plus a learned linear map of the *next* token's embedding (a width-2
    convolution, as the short convolutions of H3 and Based): a key's position then carries
    its value, and one attention layer can answer by having the query attend to its key.
    ``next_token=False`` leaves attention alone to move each value to its key (two layers
    needed, and it sits on a long plateau near 28% accuracy: see docs/training.md).

    Args:
        vocab_size: V, keys and values.
        num_classes: C, the value tokens (the answers).
        d_model: E. num_heads: H (E / H must be even: RoPE). layers: the blocks.
        next_token: add the next token's embedding (see above).
        dropout: in the blocks.

    Example:
        >>> model = RecallModel(36, 10, d_model=32, num_heads=2)
        >>> tokens = torch.randint(0, 36, (4, 17))                  # (B, L)
        >>> model(tokens, torch.full((4,), 17)).shape               # (B, C)
        torch.Size([4, 10])
    """

    kind = "recall"

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        *,
        d_model: int = 64,
        num_heads: int = 4,
        layers: int = 1,
        next_token: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.settings = {
            "vocab_size": vocab_size,
            "num_classes": num_classes,
            "d_model": d_model,
            "num_heads": num_heads,
            "layers": layers,
            "next_token": next_token,
            "dropout": dropout,
        }
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.next_token = nn.Linear(d_model, d_model, bias=False) if next_token else None
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, num_heads, dropout=dropout, positional="rope")
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.readout = nn.Linear(d_model, num_classes)

    def config(self) -> dict[str, Any]:
        """The settings that rebuild this model (:func:`build_model`)."""
        return {"kind": self.kind, **self.settings}

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids and (B,) lengths → (B, C) logits, read at position lengths − 1."""
        x = self.embedding(tokens)  # (B, L, E)
        if self.next_token is not None:
            after = torch.cat((x[:, 1:], torch.zeros_like(x[:, :1])), dim=1)  # (B, L, E)
            real = torch.arange(x.shape[1], device=x.device) + 1 < lengths[:, None]  # (B, L)
            x = x + self.next_token(after) * real[..., None]
        for block in self.blocks:
            x = block(x, key_padding_lengths=lengths)
        query = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # (B, E)
        logits: torch.Tensor = self.readout(self.norm(query))
        return logits


class AttentionPooling(nn.Module):
    """One learned query attends over the words: a weighted average of the word vectors.

    ``q`` (1, E) is a parameter; the keys and values are the words. The attention is a
    :class:`qkv.nn.MultiHeadAttention` (its own W_q, W_k, W_v), so a trace shows which words
    the classifier looks at.

    Example:
        >>> pool = AttentionPooling(8, num_heads=1)
        >>> pool(torch.randn(2, 5, 8), torch.tensor([5, 3])).shape     # (B, E)
        torch.Size([2, 8])
    """

    def __init__(self, embed_dim: int, *, num_heads: int = 1) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, embed_dim) * embed_dim**-0.5)
        self.attn = MultiHeadAttention(embed_dim, num_heads)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L, E) words and (B,) lengths → (B, E)."""
        query = self.query.expand(x.shape[0], 1, x.shape[2])  # (B, 1, E)
        pooled: torch.Tensor = self.attn(query, x, key_padding_lengths=lengths)  # (B, 1, E)
        return pooled[:, 0]


class AttentionClassifier(nn.Module):
    """Text classification: embeddings, a qkv self-attention block, attention pooling, a head.

    The self-attention (a pre-norm :class:`qkv.nn.TransformerBlock` with RoPE, so word order
    counts) lets each word look at the others ("not" before "great"); the pooling attention
    picks the words that decide; a linear layer gives the class scores.

    Args:
        vocab_size: V (id 0 is padding).
        num_classes: C.
        embedding_dim: E, the width of the embeddings and of the attention.
        num_heads: H of the self-attention (E / H must be even).
        dropout: in the block.

    Example:
        >>> model = AttentionClassifier(50, 2, embedding_dim=16, num_heads=2)
        >>> model(torch.randint(1, 50, (3, 7)), torch.tensor([7, 4, 2])).shape    # (B, C)
        torch.Size([3, 2])
    """

    kind = "attention"

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        *,
        embedding_dim: int = 32,
        num_heads: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.settings = {
            "vocab_size": vocab_size,
            "num_classes": num_classes,
            "embedding_dim": embedding_dim,
            "num_heads": num_heads,
            "dropout": dropout,
        }
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.block = TransformerBlock(embedding_dim, num_heads, dropout=dropout, positional="rope")
        self.pool = AttentionPooling(embedding_dim)
        self.norm = nn.LayerNorm(embedding_dim)
        self.head = nn.Linear(embedding_dim, num_classes)

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.settings}

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids and (B,) lengths → (B, C) logits."""
        x = self.embedding(tokens)  # (B, L, E)
        x = self.block(x, key_padding_lengths=lengths)  # (B, L, E)
        logits: torch.Tensor = self.head(self.norm(self.pool(x, lengths)))  # (B, C)
        return logits


class BagOfWords(nn.Module):
    """The baseline: the mean of the word embeddings, then a linear layer. It sees which
    words occur, not their order.

    Example:
        >>> model = BagOfWords(50, 2, embedding_dim=16)
        >>> model(torch.randint(1, 50, (3, 7)), torch.tensor([7, 4, 2])).shape
        torch.Size([3, 2])
    """

    kind = "bag-of-words"

    def __init__(self, vocab_size: int, num_classes: int, *, embedding_dim: int = 32) -> None:
        super().__init__()
        self.settings = {
            "vocab_size": vocab_size,
            "num_classes": num_classes,
            "embedding_dim": embedding_dim,
        }
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.head = nn.Linear(embedding_dim, num_classes)

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.settings}

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (B, L, E)
        real = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]  # (B, L)
        mean = (x * real[..., None]).sum(dim=1) / lengths[:, None].clamp(min=1)  # (B, E)
        logits: torch.Tensor = self.head(mean)
        return logits


MODEL_KINDS: dict[str, type[nn.Module]] = {
    RecallModel.kind: RecallModel,
    AttentionClassifier.kind: AttentionClassifier,
    BagOfWords.kind: BagOfWords,
}
"""The models by the ``kind`` their config names."""


def build_model(config: dict[str, Any]) -> nn.Module:
    """A new model from a config saved by ``model.config()`` (weights initialised anew).

    Raises:
        ValueError: an unknown kind or settings the model does not take.

    Example:
        >>> model = BagOfWords(10, 3, embedding_dim=4)
        >>> type(build_model(model.config())).__name__
        'BagOfWords'
    """
    settings = dict(config)
    kind = settings.pop("kind", None)
    cls = MODEL_KINDS.get(str(kind))
    if cls is None:
        raise ValueError(
            f"unknown model kind {kind!r}; this qkv knows {', '.join(MODEL_KINDS)}. "
            "Hint: the checkpoint was written by another version of qkv."
        )
    vocab_size, num_classes = settings.pop("vocab_size"), settings.pop("num_classes")
    try:
        return cls(vocab_size, num_classes, **settings)
    except TypeError as error:
        raise ValueError(f"the {kind} model does not take these settings: {error}") from None
