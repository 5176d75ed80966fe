"""Attention classes and functions in the style of real students' code (issue 35, item 2).

Each submission here is written for this corpus, in the interface and with the mistake (or
none) of an implementation seen in a public repository, cited beside it; none is copied.
Their truth is decided in ``test_real_classes.py`` by a float64 NumPy reference that does
not use qkv. This module never imports qkv.

What the real code showed, and what each submission keeps of it:

- constructors: ``Head(head_size)`` with a module-level ``n_embd``; ``Head(n_embd,
  head_size, block_size)``; ``Head(block_size, n_embd, head_size)``; ``MultiHeadAttention(
  num_heads, d_model)``; ``MultiHeadAttention(d_in, d_out, context_length, dropout,
  num_heads)``; ``MultiheadCrossAttention(d_model, num_heads)``; ``SelfAttention(
  embed_dim)``;
- layer names: ``key``/``query``/``value`` without an output projection; ``linears`` (four
  clones); ``kv_layer``/``q_layer``/``linear_layer``; ``W_q``/``W_k``/``W_v``;
  ``W_query``/``W_key``/``W_value``/``out_proj``;
- forward: ``forward(x)``, ``forward(x, mask=None)``, ``forward(query, key, value,
  mask=None)``, ``forward(x, y, mask=None)`` (x: keys and values, y: queries);
- masks: a triangular ``tril`` buffer (or a plain tensor attribute), ``mask == 0`` → −1e9
  (1 = may attend), a boolean mask applied with ``~mask`` (True = may attend), an additive
  mask added to the scores, the Annotated Transformer's ``mask.unsqueeze(1)``;
- mistakes: ``C ** -0.5`` (the model's width) in a single head, no scaling at all, the
  heads merged with a reshape without transposing back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

N_EMBD = 32  # a module-level width, as in Karpathy's lecture code
BLOCK_SIZE = 16


# Seen in Manikanta5112/custom_tiny_gpt, v2.py: Head(head_size) reading the global n_embd
# and block_size, scaled by C ** -0.5 where C is x's width (the model's), not the head's.
class GlobalWidthHead(nn.Module):
    tril: torch.Tensor

    def __init__(self, head_size: int) -> None:
        super().__init__()
        self.key = nn.Linear(N_EMBD, head_size, bias=False)
        self.query = nn.Linear(N_EMBD, head_size, bias=False)
        self.value = nn.Linear(N_EMBD, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(BLOCK_SIZE, BLOCK_SIZE)))

    def forward(self, x: Any) -> Any:
        _, t, c = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * c**-0.5
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


# Seen in sebastianvlad1/Transformer, head.py: Head(n_embd, head_size, block_size), the same
# C ** -0.5; here once with that slip and once right.
class WidthFirstHead(nn.Module):
    tril: torch.Tensor
    right = False

    def __init__(self, n_embd: int, head_size: int, block_size: int) -> None:
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x: Any) -> Any:
        _, t, c = x.shape
        k, q = self.key(x), self.query(x)
        scale = k.shape[-1] if self.right else c
        wei = q @ k.transpose(-2, -1) * scale**-0.5
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


class WidthFirstHeadRight(WidthFirstHead):
    right = True


# Seen in ryansenn/byteGPT, self_attention.py: Head(block_size, n_embd, head_size), its tril a
# plain tensor attribute (no buffer), and no scaling of the scores.
class UnscaledHead(nn.Module):
    def __init__(self, block_size: int, n_embd: int, head_size: int) -> None:
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.tril = torch.tril(torch.ones(block_size, block_size))

    def forward(self, x: Any) -> Any:
        t = x.shape[1]
        q, k = self.query(x), self.key(x)
        wei = q @ k.transpose(-2, -1)
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


# Seen in Nijikadesu/Transformer-From-Scratch, mechanism/multihead_cross_attention.py:
# forward(x, y, mask) with x the keys' and values' input and y the queries', a fused kv_layer
# laid out per head (k_h | v_h), a q_layer, an output layer named linear_layer, an additive
# mask; the heads merged with a reshape without transposing back.
class CrossAttention(nn.Module):
    merge_right = False

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.kv_layer = nn.Linear(d_model, 2 * d_model)
        self.q_layer = nn.Linear(d_model, d_model)
        self.linear_layer = nn.Linear(d_model, d_model)

    def forward(self, x: Any, y: Any, mask: Any = None) -> Any:
        b, s_len, _ = x.size()
        t_len = y.size(1)
        kv = self.kv_layer(x).reshape(b, s_len, self.num_heads, 2 * self.head_dim)
        k, v = kv.permute(0, 2, 1, 3).chunk(2, dim=-1)
        q = self.q_layer(y).reshape(b, t_len, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        values = F.softmax(scores, dim=-1) @ v  # (b, heads, t, d)
        if self.merge_right:
            values = values.permute(0, 2, 1, 3)
        return self.linear_layer(values.reshape(b, t_len, self.d_model))


class CrossAttentionRight(CrossAttention):
    merge_right = True


# Seen in hkt456/LLM, src/attention.py: LLMs from Scratch's MultiHeadAttention(d_in, d_out,
# context_length, dropout, num_heads, qkv_bias), causal by a triu buffer. Right.
class FromScratch(nn.Module):
    mask: torch.Tensor

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        ones = torch.ones(context_length, context_length)
        self.register_buffer("mask", torch.triu(ones, diagonal=1))

    def forward(self, x: Any) -> Any:
        b, n, _ = x.shape

        def split(t: Any) -> Any:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        keys, queries, values = split(self.W_key(x)), split(self.W_query(x)), split(self.W_value(x))
        scores = queries @ keys.transpose(2, 3)
        scores.masked_fill_(self.mask.bool()[:n, :n], float("-inf"))
        weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        context = (weights @ values).transpose(1, 2).contiguous().view(b, n, self.d_out)
        return self.out_proj(context)


# Seen in Neerabhy/Text_summarization, Multi_Head_Attention.py: the Annotated Transformer's
# MultiHeadAttention(num_heads, d_model) with four linears, mask.unsqueeze(1) for the heads
# and masked_fill(mask == 0, -1e9). Right.
class FourLinears(nn.Module):
    def __init__(self, num_heads: int, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.num_heads, self.d_key = num_heads, d_model // num_heads
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query: Any, key: Any, value: Any, mask: Any = None) -> Any:
        if mask is not None:
            mask = mask.unsqueeze(1)
        n = query.size(0)
        q, k, v = (
            lin(x).view(n, -1, self.num_heads, self.d_key).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value), strict=False)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_key)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        x = self.dropout(scores.softmax(dim=-1)) @ v
        x = x.transpose(1, 2).contiguous().view(n, -1, self.num_heads * self.d_key)
        return self.linears[-1](x)


# Seen in pigmeetsomebody/llm-notes, code/self_attention.py: SelfAttention(embed_dim), one
# head as wide as the model (W_q, W_k, W_v, no output projection), forward(x, mask=None),
# masked_fill(mask == 0, -1e9), returning (output, weights). Right.
class OneWideHead(nn.Module):
    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.W_q = nn.Linear(embed_dim, embed_dim)
        self.W_k = nn.Linear(embed_dim, embed_dim)
        self.W_v = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Any, mask: Any = None) -> Any:
        scores = self.W_q(x) @ self.W_k(x).transpose(-2, -1) / self.embed_dim**0.5
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        weights = F.softmax(scores, dim=-1)
        return weights @ self.W_v(x), weights


# The mask computed and dropped, `scores.masked_fill(mask == 0, -1e9)` without assigning it,
# was found by the code search in several files (a multi-head class with w_q, w_k, w_v and
# an output layer `combine`, forward(x, mask=None)); the index did not name their
# repositories.
class DroppedMask(nn.Module):
    def __init__(self, n_dim: int, n_head: int) -> None:
        super().__init__()
        self.n_dim, self.n_head = n_dim, n_head
        self.w_q, self.w_k = nn.Linear(n_dim, n_dim), nn.Linear(n_dim, n_dim)
        self.w_v, self.combine = nn.Linear(n_dim, n_dim), nn.Linear(n_dim, n_dim)

    def forward(self, x: Any, mask: Any = None) -> Any:
        b, t, d = x.shape
        q, k, v = (
            f(x).view(b, t, self.n_head, d // self.n_head).permute(0, 2, 1, 3)
            for f in (self.w_q, self.w_k, self.w_v)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_head)
        if mask is not None:
            scores.masked_fill(mask == 0, -1e9)
        out = F.softmax(scores, dim=-1) @ v
        return self.combine(out.permute(0, 2, 1, 3).reshape(b, t, d))


# Seen in CharGiway/assignment2-systems, cs336-basics/cs336_basics/nn/sdpa.py: CS336's
# scaled_dot_product_attention(Q, K, V, mask) with einsum and masked_fill(~mask, -inf)
# (True = may attend). Right.
def cs336_attention(Q: Any, K: Any, V: Any, mask: Any = None) -> Any:
    d_k = Q.shape[-1]
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("...qk,...kd->...qd", torch.softmax(scores, dim=-1), V)


@dataclass(frozen=True)
class Real:
    """A submission of the corpus: the class, how the reference reads its layers and calls
    it, and the code qkv must name (None: right).

    Attributes:
        cls: the class.
        code: the slip it makes, or None.
        q, k, v, o: its layers for Q, K, V and the output (o: '' for a single head); ``kv``
            a fused K|V layer laid out per head (then k and v are '').
        heads: the heads it is built with (1 for a single head).
        call: ``x`` (forward(x)), ``qkv`` (forward(q, k, v)), ``kv-q`` (forward(x_kv, y_q)).
        mask: how the reference gives a mask: '' none, ``keep01`` (1 = may attend, with
            the heads' axis added by the class or broadcast), ``additive``.
        causal: it applies the causal rule itself.
        kwargs: its constructor's arguments for the reference's build.
    """

    cls: type
    code: str | None
    q: str
    k: str
    v: str
    o: str
    heads: int
    call: str = "x"
    mask: str = ""
    causal: bool = False
    kv: str = ""
    kwargs: tuple[tuple[str, Any], ...] = ()


CLASSES = [
    Real(
        GlobalWidthHead,
        "head-scaled-by-width",
        "query",
        "key",
        "value",
        "",
        1,
        causal=True,
        kwargs=(("head_size", 8),),
    ),
    Real(
        WidthFirstHead,
        "head-scaled-by-width",
        "query",
        "key",
        "value",
        "",
        1,
        causal=True,
        kwargs=(("n_embd", 16), ("head_size", 8), ("block_size", 16)),
    ),
    Real(
        WidthFirstHeadRight,
        None,
        "query",
        "key",
        "value",
        "",
        1,
        causal=True,
        kwargs=(("n_embd", 16), ("head_size", 8), ("block_size", 16)),
    ),
    Real(
        UnscaledHead,
        "unscaled",
        "query",
        "key",
        "value",
        "",
        1,
        causal=True,
        kwargs=(("block_size", 16), ("n_embd", 16), ("head_size", 8)),
    ),
    Real(
        CrossAttention,
        "heads-merged-without-transpose",
        "q_layer",
        "",
        "",
        "linear_layer",
        4,
        call="kv-q",
        mask="additive",
        kv="kv_layer",
        kwargs=(("d_model", 16), ("num_heads", 4)),
    ),
    Real(
        CrossAttentionRight,
        None,
        "q_layer",
        "",
        "",
        "linear_layer",
        4,
        call="kv-q",
        mask="additive",
        kv="kv_layer",
        kwargs=(("d_model", 16), ("num_heads", 4)),
    ),
    Real(
        FromScratch,
        None,
        "W_query",
        "W_key",
        "W_value",
        "out_proj",
        4,
        causal=True,
        kwargs=(
            ("d_in", 16),
            ("d_out", 16),
            ("context_length", 16),
            ("dropout", 0.0),
            ("num_heads", 4),
        ),
    ),
    Real(
        FourLinears,
        None,
        "linears.0",
        "linears.1",
        "linears.2",
        "linears.3",
        4,
        call="qkv",
        mask="keep01",
        kwargs=(("num_heads", 4), ("d_model", 16)),
    ),
    Real(OneWideHead, None, "W_q", "W_k", "W_v", "", 1, mask="keep01", kwargs=(("embed_dim", 16),)),
    Real(
        DroppedMask,
        "mask-not-applied",
        "w_q",
        "w_k",
        "w_v",
        "combine",
        4,
        mask="keep01",
        kwargs=(("n_dim", 16), ("n_head", 4)),
    ),
]
"""Every class of the corpus with the code it must get."""
