"""``qkv check --module FILE.py:ClassName``: attention classes in the conventions of the
courses that ask for them (issue 26, item 4).

Each class below is written here in the shape a course asks for (constructor, layer names,
forward), not copied from the course: CS231n's ``MultiHeadAttention(embed_dim, num_heads,
dropout)`` with ``key``, ``query``, ``value``, ``proj`` and ``forward(query, key, value,
attn_mask)``; CS224n's ``CausalSelfAttention(config)`` with a ``mask`` buffer; the Annotated
Transformer's ``MultiHeadedAttention(h, d_model)`` with four ``linears``; *LLMs from
Scratch*'s ``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads)`` with
``W_query``, ``W_key``, ``W_value``, ``out_proj``; nanoGPT's fused ``c_attn``; the UvA
tutorial's fused ``qkv_proj`` laid out per head; and a grouped-query class.
"""

from __future__ import annotations

import json
import math
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from qkv.check import FunctionError, check_module
from qkv.cli import main


def heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, length, width = x.shape
    return x.view(b, length, h, width // h).transpose(1, 2)  # (B, h, L, d)


def merge(c: torch.Tensor) -> torch.Tensor:
    b, h, length, d = c.shape
    return c.transpose(1, 2).reshape(b, length, h * d)


class CS231nStyle(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.key = nn.Linear(embed_dim, embed_dim)
        self.query = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_drop = nn.Dropout(dropout)
        self.n_head = num_heads
        self.scale_by_model = False

    def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
        h = self.n_head
        q, k, v = heads(self.query(query), h), heads(self.key(key), h), heads(self.value(value), h)
        d = q.shape[-1] * (h if self.scale_by_model else 1)
        s = q @ k.transpose(-2, -1) / math.sqrt(d)
        if attn_mask is not None:
            s = s.masked_fill(attn_mask == 0, float("-inf"))
        return self.proj(merge(self.attn_drop(torch.softmax(s, dim=-1)) @ v))


class CS231nByModelWidth(CS231nStyle):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.1) -> None:
        super().__init__(embed_dim, num_heads, dropout)
        self.scale_by_model = True  # sqrt(embed_dim) where sqrt(head_dim) is meant


class CS224nStyle(nn.Module):
    """minGPT's layout: one config object, a causal mask buffer."""

    mask: torch.Tensor

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_drop = nn.Dropout(config.attn_pdrop)
        size = config.block_size
        self.register_buffer("mask", torch.tril(torch.ones(size, size)).view(1, 1, size, size))
        self.n_head = config.n_head
        self.dropout_in_forward = False

    def forward(self, x: Any) -> Any:
        length = x.shape[1]
        q, k, v = (heads(f(x), self.n_head) for f in (self.query, self.key, self.value))
        s = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])
        s = s.masked_fill(self.mask[:, :, :length, :length] == 0, float("-inf"))
        w = torch.softmax(s, dim=-1)
        w = F.dropout(w, 0.1) if self.dropout_in_forward else self.attn_drop(w)
        return self.proj(merge(w @ v))


class CS224nDropoutLeftOn(CS224nStyle):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.dropout_in_forward = True  # F.dropout trains unless told training=self.training


class AnnotatedStyle(nn.Module):
    def __init__(self, h: int, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query: Any, key: Any, value: Any, mask: Any = None) -> Any:
        if mask is not None:
            mask = mask.unsqueeze(1)
        inputs = (query, key, value)
        q, k, v = (heads(lin(x), self.h) for lin, x in zip(self.linears, inputs, strict=False))
        s = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            s = s.masked_fill(mask == 0, -1e9)
        return self.linears[-1](merge(self.dropout(s.softmax(dim=-1)) @ v))


class FromScratchStyle(nn.Module):
    mask: torch.Tensor

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
        qkv_bias: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout: nn.Dropout = nn.Dropout(dropout)
        ones = torch.ones(context_length, context_length)
        self.register_buffer("mask", torch.triu(ones, diagonal=1))
        self.split_by_view = False

    def forward(self, x: Any) -> Any:
        b, n, _ = x.shape
        if self.split_by_view:  # (b, heads, n, d) straight from (b, n, heads·d): no transpose
            q, k, v = (
                f(x).view(b, self.num_heads, n, self.head_dim)
                for f in (self.W_query, self.W_key, self.W_value)
            )
        else:
            q, k, v = (
                heads(f(x), self.num_heads) for f in (self.W_query, self.W_key, self.W_value)
            )
        s = q @ k.transpose(2, 3)
        s.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        w = self.dropout(torch.softmax(s / k.shape[-1] ** 0.5, dim=-1))
        c = w @ v
        if self.split_by_view:
            return self.out_proj(c.reshape(b, n, -1))
        return self.out_proj(merge(c))


class FromScratchViewNoTranspose(FromScratchStyle):
    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int
    ) -> None:
        super().__init__(d_in, d_out, context_length, dropout, num_heads)
        self.split_by_view = True


class NanoGPTCausalSelfAttention(nn.Module):
    """Causal by its name: no mask buffer, is_causal=True."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: Any) -> Any:
        q, k, v = (heads(t, self.n_head) for t in self.c_attn(x).split(self.n_embd, dim=2))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.c_proj(merge(y))


class UvAStyle(nn.Module):
    """One fused layer, each head's q, k, v side by side."""

    def __init__(self, input_dim: int, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv_proj = nn.Linear(input_dim, 3 * embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Any, mask: Any = None) -> Any:
        b, n, _ = x.shape
        qkv = self.qkv_proj(x).reshape(b, n, self.num_heads, 3 * self.head_dim).permute(0, 2, 1, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            s = s.masked_fill(mask == 0, -9e15)
        c = torch.softmax(s, dim=-1) @ v
        return self.o_proj(c.permute(0, 2, 1, 3).reshape(b, n, self.embed_dim))


class GroupedStyle(nn.Module):
    """Causal by its mask buffer (1 above the diagonal = masked)."""

    def __init__(self, d_in: int, num_heads: int, num_kv_groups: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.ones(16, 16), diagonal=1))
        self.num_heads, self.groups = num_heads, num_kv_groups
        self.head_dim = d_in // num_heads
        self.W_query = nn.Linear(d_in, d_in, bias=False)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d_in, d_in, bias=False)
        self.tiled = False

    def forward(self, x: Any) -> Any:
        q = heads(self.W_query(x), self.num_heads)
        k, v = heads(self.W_key(x), self.groups), heads(self.W_value(x), self.groups)
        n = self.num_heads // self.groups
        if self.tiled:
            k, v = k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1)
        else:
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        return self.out_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class GroupedTiled(GroupedStyle):
    def __init__(self, d_in: int, num_heads: int, num_kv_groups: int) -> None:
        super().__init__(d_in, num_heads, num_kv_groups)
        self.tiled = True


RIGHT = [
    (CS231nStyle, False),
    (CS224nStyle, True),
    (AnnotatedStyle, False),
    (FromScratchStyle, True),
    (NanoGPTCausalSelfAttention, True),
    (UvAStyle, False),
    (GroupedStyle, True),
]


@pytest.mark.parametrize(("cls", "causal"), RIGHT, ids=[c.__name__ for c, _ in RIGHT])
def test_a_right_class_in_each_course_convention_passes(cls: type, causal: bool) -> None:
    report = check_module(cls)
    # a fully masked row of NaN (masked_fill with -inf) is a note, not a mistake
    assert report.ok and {f.diagnosis for f in report.findings} <= {"masked-row-nan"}, report.text()
    assert report.kind.endswith("causal") == causal


SLIPS = [
    (CS231nByModelWidth, "scaled-by-dmodel"),
    (CS224nDropoutLeftOn, "dropout-at-inference"),
    (FromScratchViewNoTranspose, "heads-split-without-transpose"),
    (GroupedTiled, "kv-heads-wrong-order"),
]


@pytest.mark.parametrize(("cls", "code"), SLIPS, ids=[c.__name__ for c, _ in SLIPS])
def test_a_slip_in_a_class_is_named_like_in_a_function(cls: type, code: str) -> None:
    report = check_module(cls)
    assert [f.diagnosis for f in report.findings if f.wrong] == [code], report.text()


class EncoderSelfAttention(nn.Module):
    """Not causal, and no mask parameter."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x: Any) -> Any:
        q, k, v = (heads(f(x), self.n_heads) for f in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(merge(F.scaled_dot_product_attention(q, k, v)))


def test_kind_causal_or_not_overrides_what_the_class_says() -> None:
    assert check_module(EncoderSelfAttention).ok
    report = check_module(EncoderSelfAttention, causal=True)
    assert [f.diagnosis for f in report.findings] == ["mask-ignored"]
    assert check_module(FromScratchStyle, causal=False).findings[0].diagnosis == "unrecognised"
    assert check_module(AnnotatedStyle, causal=True).ok  # its mask parameter gets the rule


class NeedsVocabulary(nn.Module):
    def __init__(self, d_model: int, vocabulary: Any) -> None:
        super().__init__()


class RotaryForward(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v, self.o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x: Any, cos: Any, sin: Any) -> Any:
        return x


class NoLinear(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d_model, d_model))

    def forward(self, x: Any) -> Any:
        return x @ self.w


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (NeedsVocabulary, "its constructor takes 'vocabulary', which qkv does not know"),
        (RotaryForward, r"cannot call RotaryForward\.forward\(x, cos, sin\)"),
        (NoLinear, "has no nn.Linear layer"),
        (types.SimpleNamespace, "is not an nn.Module class"),
    ],
    ids=["constructor", "forward", "projections", "not-a-module"],
)
def test_a_class_qkv_cannot_drive_is_one_line(cls: Any, message: str) -> None:
    with pytest.raises(FunctionError, match=message) as caught:
        check_module(cls)
    assert "\n" not in str(caught.value) and "Hint" in str(caught.value)


def test_cli_module_runs_the_file_in_its_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "attention.py"
    path.write_text(
        textwrap.dedent(
            """
            import math
            import torch
            from torch import nn

            class MultiHeadAttention(nn.Module):
                def __init__(self, d_in, d_out, context_length, dropout, num_heads):
                    super().__init__()
                    self.h = num_heads
                    self.W_query = nn.Linear(d_in, d_out, bias=False)
                    self.W_key = nn.Linear(d_in, d_out, bias=False)
                    self.W_value = nn.Linear(d_in, d_out, bias=False)
                    self.out_proj = nn.Linear(d_out, d_out)
                    ones = torch.ones(context_length, context_length)
                    self.register_buffer("mask", torch.triu(ones, diagonal=0))  # 1 meant

                def forward(self, x):
                    b, n, e = x.shape
                    q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2)
                               for f in (self.W_query, self.W_key, self.W_value))
                    s = q @ k.transpose(2, 3) / math.sqrt(k.shape[-1])
                    s = s.masked_fill(self.mask.bool()[:n, :n], -torch.inf)
                    c = torch.softmax(s, dim=-1) @ v
                    return self.out_proj(c.transpose(1, 2).reshape(b, n, e))

            print(MultiHeadAttention(4, 4, 8, 0.0, 2)(torch.zeros(1, 3, 4)).shape)
            """
        ),
        encoding="utf-8",
    )
    target = f"{path}:MultiHeadAttention"
    assert main(["check", "--module", target]) == 1
    out = capsys.readouterr().out
    assert "causal-off-by-one" in out and "W_query, W_key, W_value, out_proj" in out
    assert main(["check", "--module", target, "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["diagnosis"] for f in data["findings"]] == ["causal-off-by-one"]
    assert main(["check", "--module", f"{path}:nothing"]) == 2
    assert "no class named 'nothing'" in capsys.readouterr().err
    assert main(["check", "--module", target, "--function", target]) == 2
    assert "not both" in capsys.readouterr().err
    # options of --function that a class does not take are one line, not silently dropped
    assert main(["check", "--module", target, "--num-kv-heads", "2", "--batched"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--num-kv-heads, --batched do not go with --module" in err


class FusedForwardRaises(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)

    def forward(self, x: Any) -> Any:
        raise RuntimeError("not written yet")


def test_a_class_whose_forward_raises_is_one_line() -> None:
    with pytest.raises(FunctionError, match=r"raised RuntimeError: not written yet"):
        check_module(FusedForwardRaises)


# issue 35, item 2: masks, cross-attention, projections by use, a single head ------------


class MaskNotAssigned(CS231nStyle):
    """CS231n's class whose masked_fill result is dropped (not assigned back)."""

    def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
        h = self.n_head
        q, k, v = heads(self.query(query), h), heads(self.key(key), h), heads(self.value(value), h)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if attn_mask is not None:
            s.masked_fill(attn_mask == 0, float("-inf"))  # slip: a new tensor, thrown away
        return self.proj(merge(self.attn_drop(torch.softmax(s, dim=-1)) @ v))


class MaskFilledWith(CS231nStyle):
    fill = 0.0

    def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
        h = self.n_head
        q, k, v = heads(self.query(query), h), heads(self.key(key), h), heads(self.value(value), h)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if attn_mask is not None:
            s = s.masked_fill(attn_mask == 0, self.fill)
        return self.proj(merge(self.attn_drop(torch.softmax(s, dim=-1)) @ v))


class MaskFilledWithZero(MaskFilledWith):
    fill = 0.0


class MaskFilledWithTiny(MaskFilledWith):
    fill = 1e-9


class MaskFilledWithPlusInf(MaskFilledWith):
    fill = float("inf")


class CausalCross(nn.Module):
    """A decoder's causal attention that takes the keys and values apart (cross-attention),
    its triangular buffer sliced at the top-left corner, or (slip) at the bottom-right."""

    tril: torch.Tensor
    bottom_right = False

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.h = num_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.register_buffer("tril", torch.tril(torch.ones(16, 16)))

    def forward(self, query: Any, key: Any, value: Any) -> Any:
        t, s_len = query.shape[1], key.shape[1]
        q, k = heads(self.q_proj(query), self.h), heads(self.k_proj(key), self.h)
        v = heads(self.v_proj(value), self.h)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        rows = slice(s_len - t, s_len) if self.bottom_right else slice(0, t)
        s = s.masked_fill(self.tril[rows, :s_len] == 0, float("-inf"))
        return self.out_proj(merge(torch.softmax(s, dim=-1) @ v))


class CausalCrossBottomRight(CausalCross):
    bottom_right = True


class KarpathyHead(nn.Module):
    """One head, no output projection; C ** -0.5 (the model's width) or the head's size."""

    tril: torch.Tensor
    by_width = False

    def __init__(self, n_embd: int, head_size: int, block_size: int) -> None:
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x: Any) -> Any:
        _, t, c = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * (c if self.by_width else k.shape[-1]) ** -0.5
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return torch.softmax(wei, dim=-1) @ self.value(x)


class KarpathyHeadByWidth(KarpathyHead):
    by_width = True


class QKNoTranspose(CS231nStyle):
    def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
        h = self.n_head
        q, k, v = heads(self.query(query), h), heads(self.key(key), h), heads(self.value(value), h)
        s = q @ k / math.sqrt(q.shape[-1])  # slip: runs only where L = d_head
        if attn_mask is not None:
            s = s.masked_fill(attn_mask == 0, float("-inf"))
        return self.proj(merge(torch.softmax(s, dim=-1) @ v))


MODULE_SLIPS = [
    (MaskNotAssigned, "mask-not-applied"),
    (MaskFilledWithZero, "mask-filled-with-zero"),
    (MaskFilledWithTiny, "mask-filled-with-zero"),
    (MaskFilledWithPlusInf, "mask-filled-with-inf"),
    (CausalCrossBottomRight, "cross-mask-misaligned"),
    (KarpathyHeadByWidth, "head-scaled-by-width"),
    (QKNoTranspose, "qk-not-transposed"),
]


@pytest.mark.parametrize(("cls", "code"), MODULE_SLIPS, ids=[c.__name__ for c, _ in MODULE_SLIPS])
def test_the_mask_cross_attention_and_head_slips_of_a_class_are_named(cls: type, code: str) -> None:
    report = check_module(cls)
    assert [f.diagnosis for f in report.findings if f.wrong] == [code], report.text()
    [finding] = [f for f in report.findings if f.wrong]
    assert len(finding.message) < 400 and "Hint" not in finding.message


def test_a_class_that_takes_a_mask_is_probed_with_one_and_cross_attention() -> None:
    report = check_module(CS231nStyle)
    assert "mask bool, True = may attend" in report.about
    assert report.with_mask
    assert check_module(CausalCross).ok


def test_the_mask_convention_is_found_by_probing() -> None:
    class Additive(CS231nStyle):
        def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
            h = self.n_head
            q, k = heads(self.query(query), h), heads(self.key(key), h)
            v = heads(self.value(value), h)
            s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            return self.proj(merge(torch.softmax(s + attn_mask, dim=-1) @ v))

    class TrueMeansMasked(CS231nStyle):
        def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
            h = self.n_head
            q, k = heads(self.query(query), h), heads(self.key(key), h)
            v = heads(self.value(value), h)
            s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if attn_mask is not None:
                s = s.masked_fill(attn_mask, float("-inf"))
            return self.proj(merge(torch.softmax(s, dim=-1) @ v))

    additive = check_module(Additive)
    assert additive.ok and "0 or −inf" in additive.about, additive.text()
    masked = check_module(TrueMeansMasked)
    assert masked.ok and "True = masked" in masked.about, masked.text()
    # the Annotated Transformer unsqueezes the mask for the heads: (1, Lq, Lk)
    assert "(1, Lq, Lk)" in check_module(AnnotatedStyle).about


class OddNames(nn.Module):
    """Layers named for nothing qkv knows, a constructor of dim_in, dim_out."""

    def __init__(self, dim_in: int, dim_out: int, num_heads: int) -> None:
        super().__init__()
        self.h = num_heads
        self.a, self.b = nn.Linear(dim_in, dim_out), nn.Linear(dim_in, dim_out)
        self.c, self.linear = nn.Linear(dim_in, dim_out), nn.Linear(dim_out, dim_out)

    def forward(self, x: Any) -> Any:
        q, k, v = heads(self.a(x), self.h), heads(self.b(x), self.h), heads(self.c(x), self.h)
        return self.linear(merge(F.scaled_dot_product_attention(q, k, v)))


class Positional(nn.Module):
    def __init__(self, width: int, count: int) -> None:
        super().__init__()
        self.h = count
        self.query, self.key = nn.Linear(width, width), nn.Linear(width, width)
        self.value, self.linear = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: Any) -> Any:
        q, k = heads(self.query(x), self.h), heads(self.key(x), self.h)
        v = heads(self.value(x), self.h)
        return self.linear(merge(F.scaled_dot_product_attention(q, k, v)))


def test_projections_are_found_by_their_use_whatever_their_names() -> None:
    report = check_module(OddNames)
    assert report.ok, report.text()
    assert report.about.endswith("projections a, b, c, linear")
    assert check_module(Positional).ok


def test_a_single_head_is_checked_as_one_head_with_kind_attention() -> None:
    report = check_module(KarpathyHead, kind="attention")
    assert report.ok and report.kind == "module: attention, one head, causal", report.text()
    with pytest.raises(FunctionError, match="single head without an output projection"):
        check_module(KarpathyHead, kind="multi-head")
    with pytest.raises(FunctionError, match="kind attention is a single head"):
        check_module(CS231nStyle, kind="attention")


def test_the_adapter_imports_nothing_of_qkv() -> None:
    """It runs in the student's process, where qkv cannot be imported (issue 35, item 1)."""
    import ast

    import qkv.check._module_adapt as adapt

    tree = ast.parse(Path(adapt.__file__).read_text(encoding="utf-8"))
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name.split(".")[0] == "qkv"], imported


def test_a_class_file_gets_mask_and_cross_attention_probes_in_the_sandbox(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The probing decisions are the judge's: the class runs in the student's process and
    its adapter's scalar fields say what it takes (issue 35, item 2)."""
    path = tmp_path / "layers.py"
    path.write_text(
        textwrap.dedent(
            """
            import math
            import torch
            from torch import nn

            N_EMBD = 32

            class Cross(nn.Module):
                def __init__(self, d_model, num_heads):
                    super().__init__()
                    self.h, self.d = num_heads, d_model // num_heads
                    self.kv_layer = nn.Linear(d_model, 2 * d_model)
                    self.q_layer = nn.Linear(d_model, d_model)
                    self.linear_layer = nn.Linear(d_model, d_model)

                def forward(self, x, y, mask=None):
                    b, s, e = x.shape
                    t = y.shape[1]
                    kv = self.kv_layer(x).reshape(b, s, self.h, 2 * self.d).permute(0, 2, 1, 3)
                    k, v = kv.chunk(2, dim=-1)
                    q = self.q_layer(y).reshape(b, t, self.h, self.d).permute(0, 2, 1, 3)
                    scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
                    if mask is not None:
                        scores = scores.masked_fill(mask == 0, float("inf"))  # slip: +inf
                    c = torch.softmax(scores, dim=-1) @ v
                    return self.linear_layer(c.permute(0, 2, 1, 3).reshape(b, t, e))

            class Head(nn.Module):
                def __init__(self, head_size):
                    super().__init__()
                    self.key = nn.Linear(N_EMBD, head_size, bias=False)
                    self.query = nn.Linear(N_EMBD, head_size, bias=False)
                    self.value = nn.Linear(N_EMBD, head_size, bias=False)

                def forward(self, x):
                    k, q = self.key(x), self.query(x)
                    wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
                    return torch.softmax(wei, dim=-1) @ self.value(x)
            """
        ),
        encoding="utf-8",
    )
    assert main(["check", "--module", f"{path}:Cross", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["diagnosis"] for f in data["findings"]] == ["mask-filled-with-inf"]
    assert main(["check", "--module", f"{path}:Head", "--kind", "attention"]) == 0
    out = capsys.readouterr().out
    assert "attention, one head" in out and "No mistake found" in out
    assert main(["check", "--module", f"{path}:Cross", "--kind", "attention"]) == 2
    assert "kind attention is a single head" in capsys.readouterr().err
