"""FlexAttention's own examples, ported to ``qkv.flex_attention`` (issue 14, item 3).

Sources (read, not copied; the code below is written for qkv):

- pytorch/pytorch, ``test/inductor/test_flex_attention.py``: the score modifiers it runs every
  kernel with (``_causal``, ``_rel_bias``, ``_generate_alibi_bias``, a tanh soft-cap), its
  checks against an eager float64 "golden" call, ``test_GQA``, the fully masked rows test
  (output 0, log-sum-exp −inf) and the ``return_lse`` tests (natural log);
- pytorch-labs/attention-gym, ``attn_gym/masks`` (``causal``, ``sliding_window``,
  ``document_mask``, ``prefix_lm``) and ``attn_gym/mods`` (``alibi``, ``softcapping``), and
  the FlexAttention blog post's learned relative-position bias (a learnable table indexed by
  q_idx − kv_idx).

Oracles: torch's own ``flex_attention`` in eager mode (it runs the forward on CPU) for the
output and ``return_lse``; for gradients, which torch refuses on CPU ("FlexAttention does not
support backward on CPU"), autograd through a dense float64 softmax built from the same
``mask_mod`` (``torch.nn.attention.flex_attention.create_mask``) and ``score_mod``.
"""

from __future__ import annotations

import doctest
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    create_mask,
    noop_mask,
)
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import qkv
from qkv import masks

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:return_lse is deprecated"),
]

DOCS = Path(__file__).resolve().parents[2] / "docs"
F64 = torch.float64
B, H, L, D = 2, 4, 300, 16  # L not a multiple of any block size: ragged last blocks

# -- the examples people use with FlexAttention (masks and score modifiers) --------------------

MaskMod = Callable[[Any, Any, Any, Any], Any]
ScoreModFn = Callable[[Any, Any, Any, Any, Any], Any]


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def sliding_window(window: int) -> MaskMod:
    def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return mod


def documents(ids: torch.Tensor) -> MaskMod:
    """Packed causal documents; ``ids`` (B, L), one document number per position."""

    def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    return mod


def prefix_lm(prefix: int) -> MaskMod:
    def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return mod


def alibi(heads: int) -> ScoreModFn:
    def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        slope = torch.exp2(-((h + 1) * 8.0 / heads))
        return score + (kv_idx - q_idx) * slope

    return mod


def softcap(cap: float) -> ScoreModFn:
    def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    return mod


def relative_bias(table: torch.Tensor, length: int) -> ScoreModFn:
    """A bias looked up by relative position: table[q_idx − kv_idx + length − 1]."""

    def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + table[q_idx - kv_idx + length - 1]

    return mod


def _doc_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (batch, length), generator=gen).sort(-1).values


CASES: dict[str, tuple[MaskMod | None, ScoreModFn | None]] = {
    "causal": (causal, None),
    "sliding_window": (sliding_window(37), None),
    "document": (documents(_doc_ids(B, L)), None),
    "prefix_lm": (prefix_lm(50), None),
    "alibi_causal": (causal, alibi(H)),
    "softcap": (None, softcap(2.0)),
    "relative_bias_window": (
        sliding_window(64),
        relative_bias(torch.linspace(-1, 1, 2 * L - 1, dtype=F64), L),
    ),
}


def _inputs(
    batch: int = B, heads: int = H, length: int = L, kv_heads: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape_q = (batch, heads, length, D)
    shape_kv = (batch, kv_heads or heads, length, D)
    q = torch.randn(shape_q, generator=gen, dtype=F64)
    k = torch.randn(shape_kv, generator=gen, dtype=F64)
    v = torch.randn(shape_kv, generator=gen, dtype=F64)
    return q, k, v


def _block_mask(mod: MaskMod | None, batch: int, length: int, block: int = 64) -> Any:
    if mod is None:
        return None
    return create_block_mask(mod, batch, None, length, length, device="cpu", BLOCK_SIZE=block)


def dense_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_mod: MaskMod | None,
    score_mod: ScoreModFn | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the whole (Lq, Lk) matrix, autograd through every step."""
    batch, heads, lq, dim = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(dim) if scale is None else scale)
    if score_mod is not None:
        idx = [torch.arange(n).view(*(-1 if i == j else 1 for j in range(4))) for i, n in
               enumerate((batch, heads, lq, k.shape[2]))]  # fmt: skip
        scores = score_mod(scores, *idx).expand_as(scores)
    if mask_mod is not None:
        allowed = create_mask(mask_mod, batch, heads, lq, k.shape[2], device="cpu")
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return weights @ v, lse


# -- forward and return_lse against torch's flex_attention ------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_lse_equal_torch_flex(name: str) -> None:
    """test_flex_attention.py runs each score_mod / mask against an eager float64 golden
    call; here torch's own eager flex_attention is that golden, output and lse."""
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    block_mask = _block_mask(mask_mod, B, L)
    out, lse = qkv.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    want, want_lse = torch_flex(q, k, v, score_mod, block_mask, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    assert lse.dtype == want_lse.dtype == F64


def test_lse_is_natural_log_and_fully_masked_rows_give_zero_and_minus_inf() -> None:
    """test_flex_attention.py (fully masked rows): output 0, lse −inf, never NaN; the lse is
    the natural log-sum-exp (torch converts from its internal log2)."""

    def upper(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx > q_idx) & (q_idx < 100)  # rows 100.. see nothing

    q, k, v = _inputs()
    block_mask = _block_mask(upper, B, L)
    out, lse = qkv.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    want, want_lse = torch_flex(q, k, v, block_mask=block_mask, return_lse=True)
    assert not out.isnan().any()
    assert bool((out[:, :, 100:] == 0).all()) and bool(torch.isneginf(lse[:, :, 100:]).all())
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    for i in range(5):  # row i sees keys i+1 ..: the natural log of its sum of exp
        torch.testing.assert_close(
            lse[:, :, i], torch.logsumexp(scores[:, :, i, i + 1 :], -1), rtol=1e-12, atol=0
        )


def test_half_precision_lse_is_float32_as_torch_gives_it() -> None:
    q, k, v = (x.to(torch.bfloat16) for x in _inputs(length=64))
    block_mask = _block_mask(causal, B, 64)
    out, lse = qkv.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    want, want_lse = torch_flex(q, k, v, block_mask=block_mask, return_lse=True)
    assert (out.dtype, lse.dtype) == (want.dtype, want_lse.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_scale_and_gqa_follow_torch() -> None:
    """test_flex_attention.py test_GQA: 8 query heads over 2 key/value heads with
    enable_gqa=True; without it, different head counts are refused, as torch refuses."""
    q, k, v = _inputs(heads=8, kv_heads=2)
    block_mask = _block_mask(sliding_window(20), B, L)
    out = qkv.flex_attention(q, k, v, alibi(8), block_mask, scale=0.3, enable_gqa=True)
    want = torch_flex(q, k, v, alibi(8), block_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        qkv.flex_attention(q, k, v)


def test_block_mask_blocks_are_obeyed_as_compiled_flex_obeys_them() -> None:
    """A BlockMask from kv blocks alone (``BlockMask.from_kv_blocks``, no mask_mod): compiled
    flex_attention attends exactly the listed blocks (torch's eager CPU path reads only the
    mask_mod and attends everything). qkv follows the compiled semantics: the oracle is
    the dense softmax over the blocks' pairs."""
    length = 3 * 128  # 3 × 3 blocks of 128: row 0 sees block 0, row 1 blocks 0-1, row 2 block 2
    num = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0, 0], [0, 1, 0], [2, 0, 0]]]], dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(length, length))
    blocks = block_mask.to_dense()[0, 0].bool()

    def listed(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return blocks[q_idx // 128, kv_idx // 128]

    q, k, v = _inputs(batch=1, heads=2, length=length)
    out, lse = qkv.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    want, want_lse = dense_oracle(q, k, v, listed, None)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


def test_qkv_mask_gives_what_the_equal_block_mask_gives() -> None:
    q, k, v = _inputs()
    ids = _doc_ids(B, L)
    rule = masks.document(ids) & masks.causal()
    out = qkv.flex_attention(q, k, v, block_mask=rule)
    want = torch_flex(q, k, v, block_mask=_block_mask(documents(ids), B, L))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert qkv.flex_attention is qkv.kernels.flex_attention


def test_wrong_block_mask_is_a_one_line_error_with_a_hint() -> None:
    q, k, v = _inputs(length=64)
    with pytest.raises(ValueError, match=r"block_mask was made for .*Hint: create_block_mask"):
        qkv.flex_attention(q, k, v, block_mask=_block_mask(causal, B, 128))
    with pytest.raises(TypeError, match="block_mask must be a torch BlockMask"):
        qkv.flex_attention(q, k, v, block_mask=torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query must be a floating-point torch\.Tensor"):
        qkv.flex_attention(q[0], k, v)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    length=st.integers(1, 200),
    window=st.integers(0, 80),
    block=st.sampled_from([16, 32, 128]),
)
def test_window_property_against_dense_oracle(
    batch: int, heads: tuple[int, int], length: int, window: int, block: int
) -> None:
    """Any shape, window and BlockMask block size: the float64 dense softmax."""
    q, k, v = _inputs(batch, heads[0], length, heads[1])
    mod = sliding_window(window)
    block_mask = _block_mask(mod, batch, length, block)
    out, lse = qkv.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    want, want_lse = dense_oracle(q, k, v, mod, None)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


# -- gradients on CPU (torch refuses them) -----------------------------------------------------


def test_torch_refuses_the_cpu_backward_that_qkv_gives() -> None:
    q, k, v = (x.requires_grad_() for x in _inputs(length=32))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        torch_flex(q, k, v).sum().backward()
    qkv.flex_attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_float64_oracle(name: str) -> None:
    """dQ, dK, dV and the gradient through the lse, for each ported example."""
    mask_mod, score_mod = CASES[name]
    q, k, v = (x.requires_grad_() for x in _inputs(length=150))
    block_mask = _block_mask(mask_mod, B, 150, block=32)
    out, lse = qkv.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    want, want_lse = dense_oracle(q, k, v, mask_mod, score_mod)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=F64)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=F64)
    finite = torch.isfinite(want_lse)
    got = torch.autograd.grad(
        (out * grad_out).sum() + (lse[finite] * grad_lse[finite]).sum(), (q, k, v)
    )
    expected = torch.autograd.grad(
        (want * grad_out).sum() + (want_lse[finite] * grad_lse[finite]).sum(), (q, k, v)
    )
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


def test_learned_relative_bias_trains_on_cpu() -> None:
    """The blog post's learned bias: a learnable table indexed by q_idx − kv_idx, under a
    BlockMask (causal documents). Its gradient equals the float64 oracle's, and a few steps
    of gradient descent on it lower the loss. Needs gradients for the tensors a score_mod
    captures (issue 14, item 2)."""
    length = 96
    ids = _doc_ids(1, length, seed=3)
    mask_mod = documents(ids)
    block_mask = _block_mask(mask_mod, 1, length, block=32)
    q, k, v = _inputs(batch=1, heads=2, length=length, seed=4)
    true_table = -0.1 * (torch.arange(2 * length - 1, dtype=F64) - (length - 1)).abs()
    target = dense_oracle(q, k, v, mask_mod, relative_bias(true_table, length))[0]
    table = torch.zeros(2 * length - 1, dtype=F64, requires_grad=True)
    score_mod = relative_bias(table, length)

    out = qkv.flex_attention(q, k, v, score_mod, block_mask)
    loss = (out - target).square().sum()
    (grad,) = torch.autograd.grad(loss, table)
    want_out = dense_oracle(q, k, v, mask_mod, score_mod)[0]
    (want,) = torch.autograd.grad((want_out - target).square().sum(), table)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)

    optimizer = torch.optim.SGD([table], lr=0.01)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (qkv.flex_attention(q, k, v, score_mod, block_mask) - target).square().sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_flex_guide_examples_run() -> None:
    """docs/flex.md: its examples run and print what the page shows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = doctest.testfile(
            str(DOCS / "flex.md"),
            module_relative=False,
            optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
        )
    assert result.attempted >= 5
    assert result.failed == 0


def test_noop_block_mask_attends_everything() -> None:
    q, k, v = _inputs(length=64)
    block_mask = create_block_mask(noop_mask, None, None, 64, 64, device="cpu")
    torch.testing.assert_close(
        qkv.flex_attention(q, k, v, block_mask=block_mask),
        torch_flex(q, k, v),
        rtol=1e-10,
        atol=1e-10,
    )
