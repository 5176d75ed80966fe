"""qkv.nn.MultiHeadAttention: torch parity (outputs and gradients), GQA, causality, errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import qkv
from qkv import masks
from qkv.nn import MultiHeadAttention, TransformerBlock, masks_from_torch


def close(actual: object, expected: object, tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@dataclass(frozen=True)
class Config:
    """The settings of a torch.nn.MultiheadAttention."""

    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    kdim: int | None = None
    vdim: int | None = None

    def __str__(self) -> str:
        return "-".join(f"{k}={v}" for k, v in vars(self).items())


def _pair(config: Config) -> tuple[torch.nn.MultiheadAttention, MultiHeadAttention]:
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(
        12,
        3,
        bias=config.bias,
        add_bias_kv=config.add_bias_kv,
        add_zero_attn=config.add_zero_attn,
        kdim=config.kdim,
        vdim=config.vdim,
        batch_first=True,
    )
    with torch.no_grad():  # non-zero biases, so that a missed bias shows
        for name, p in theirs.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.5)
    return theirs, MultiHeadAttention.from_torch(theirs)


def _torch_masks(b: int, lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's True = ignore masks that leave every query at least one key."""
    g = torch.Generator().manual_seed(1)
    attn_mask = torch.rand(lq, lk, generator=g) < 0.3
    attn_mask[:, 0] = False
    key_padding = torch.zeros(b, lk, dtype=torch.bool)
    key_padding[0, lk - 2 :] = True  # the last two keys of element 0 are padding
    return attn_mask, key_padding


CONFIGS = [
    Config(),
    Config(bias=False),
    Config(add_bias_kv=True),
    Config(add_zero_attn=True),
    Config(add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=7),
    Config(bias=False, kdim=5, vdim=7),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("with_masks", [False, True], ids=["no-mask", "masks"])
def test_from_torch_outputs_and_gradients(config: Config, with_masks: bool) -> None:
    theirs, ours = _pair(config)
    b, lq, lk = 2, 5, 6
    g = torch.Generator().manual_seed(2)
    query = torch.randn(b, lq, 12, generator=g)
    key = torch.randn(b, lk, config.kdim or 12, generator=g)
    value = torch.randn(b, lk, config.vdim or 12, generator=g)
    attn_mask, key_padding = _torch_masks(b, lq, lk) if with_masks else (None, None)
    upstream = torch.randn(b, lq, 12, generator=g)

    inputs_t = [t.clone().requires_grad_() for t in (query, key, value)]
    out_t, _ = theirs(*inputs_t, attn_mask=attn_mask, key_padding_mask=key_padding,
                      need_weights=False)  # fmt: skip
    (out_t * upstream).sum().backward()
    inputs_q = [t.clone().requires_grad_() for t in (query, key, value)]
    out_q = ours(*inputs_q, mask=masks_from_torch(attn_mask, key_padding))
    (out_q * upstream).sum().backward()

    close(out_q, out_t)
    _same_gradients(theirs, ours, config, inputs_q, inputs_t)


def _same_gradients(
    theirs: torch.nn.MultiheadAttention,
    ours: MultiHeadAttention,
    config: Config,
    inputs_q: list[torch.Tensor],
    inputs_t: list[torch.Tensor],
) -> None:
    """The gradients of the inputs and of every weight agree (after a backward pass of each)."""
    for mine, theirs_input in zip(inputs_q, inputs_t, strict=True):
        close(mine.grad, theirs_input.grad)
    projections = (ours.q_proj, ours.k_proj, ours.v_proj)
    if theirs.in_proj_weight is not None:
        grads_t = theirs.in_proj_weight.grad.chunk(3)  # type: ignore[union-attr]
    else:
        grads_t = tuple(getattr(theirs, f"{n}_proj_weight").grad for n in "qkv")
    for linear, grad in zip(projections, grads_t, strict=True):
        close(linear.weight.grad, grad)
    close(ours.out_proj.weight.grad, theirs.out_proj.weight.grad)
    if config.bias:
        assert theirs.in_proj_bias is not None and theirs.in_proj_bias.grad is not None
        for linear, grad in zip(projections, theirs.in_proj_bias.grad.chunk(3), strict=True):
            assert linear.bias is not None
            close(linear.bias.grad, grad)
    if config.add_bias_kv:
        assert ours.bias_k is not None and ours.bias_v is not None
        assert theirs.bias_k is not None and theirs.bias_v is not None
        close(ours.bias_k.grad, theirs.bias_k.grad)
        close(ours.bias_v.grad, theirs.bias_v.grad)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_a_float_mask_is_added_to_the_scores_as_torch_adds_it(config: Config) -> None:
    """torch.nn.MultiheadAttention takes a float attn_mask and adds it to the scaled scores
    (torch's test_nn.py::test_multihead_attn_3d_attn_mask and the float-mask cases of
    test_multihead_attention); qkv.nn takes the same tensor as ``mask=``, with key padding
    and the extra key rows of add_bias_kv / add_zero_attn (which get a bias of 0)."""
    theirs, ours = _pair(config)
    b, lq, lk = 2, 5, 6
    g = torch.Generator().manual_seed(7)
    query = torch.randn(b, lq, 12, generator=g)
    key = torch.randn(b, lk, config.kdim or 12, generator=g)
    value = torch.randn(b, lk, config.vdim or 12, generator=g)
    additive = 2 * torch.randn(lq, lk, generator=g)  # any real numbers, and −inf
    additive[torch.rand(lq, lk, generator=g) < 0.3] = -torch.inf
    additive[:, 0] = 0.5  # every query keeps a key
    key_padding = torch.zeros(b, lk)
    key_padding[1, lk - 2 :] = -torch.inf  # the last two keys of element 1 are padding
    upstream = torch.randn(b, lq, 12, generator=g)

    inputs_t = [t.clone().requires_grad_() for t in (query, key, value)]
    out_t, _ = theirs(*inputs_t, attn_mask=additive, key_padding_mask=key_padding,
                      need_weights=False)  # fmt: skip
    (out_t * upstream).sum().backward()
    inputs_q = [t.clone().requires_grad_() for t in (query, key, value)]
    out_q = ours(*inputs_q, mask=additive, key_padding_lengths=[lk, lk - 2])
    (out_q * upstream).sum().backward()

    close(out_q, out_t)
    _same_gradients(theirs, ours, config, inputs_q, inputs_t)
    with torch.no_grad():  # per head, (B·H, Lq, Lk) in torch, (B, H, Lq, Lk) in qkv
        per_head = torch.randn(b * 3, lq, lk, generator=g)
        expected, weights_t = theirs(query, key, value, attn_mask=per_head,
                                     average_attn_weights=False)  # fmt: skip
        got, weights_q = ours(query, key, value, mask=per_head.view(b, 3, lq, lk),
                              need_weights=True)  # fmt: skip
    close(got, expected)
    close(weights_q, weights_t)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=["plain", "all-options"])
def test_from_torch_weights_per_head(config: Config) -> None:
    theirs, ours = _pair(config)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 12, generator=g)
    key = torch.randn(2, 4, config.kdim or 12, generator=g)
    value = torch.randn(2, 4, config.vdim or 12, generator=g)
    attn_mask, key_padding = _torch_masks(2, 4, 4)
    out_t, weights_t = theirs(x, key, value, attn_mask=attn_mask, key_padding_mask=key_padding,
                              average_attn_weights=False)  # fmt: skip
    out_q, weights_q = ours(x, key, value, mask=masks_from_torch(attn_mask, key_padding),
                            need_weights=True)  # fmt: skip
    close(out_q, out_t)
    close(weights_q, weights_t)


def test_from_torch_additive_and_per_head_masks_and_float64() -> None:
    torch.manual_seed(4)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention.from_torch(theirs)
    assert ours.q_proj.weight.dtype == torch.float64
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    allowed = torch.rand(3 * 2, 5, 5) < 0.6
    allowed[..., 0] = True
    additive = torch.zeros(3 * 2, 5, 5, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    expected, _ = theirs(x, x, x, attn_mask=additive, need_weights=False)
    got = ours(x, mask=masks_from_torch(additive, num_heads=2))
    close(got, expected, 1e-12)


def test_from_torch_sequence_first_module_with_transposed_inputs() -> None:
    torch.manual_seed(5)
    theirs = torch.nn.MultiheadAttention(8, 2)  # (L, B, E) inputs
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(4, 2, 8)
    expected, _ = theirs(x, x, x, need_weights=False)
    close(ours(x.transpose(0, 1)).transpose(0, 1), expected)


def test_masks_from_torch_errors() -> None:
    with pytest.raises(ValueError, match=r"attn_mask holds values other than 0 and −inf"):
        masks_from_torch(torch.tensor([[0.0, 0.5]]))
    with pytest.raises(ValueError, match=r"give num_heads \(H\) that divides 6"):
        masks_from_torch(torch.zeros(6, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, Lk\), got \(3,\)"):
        masks_from_torch(key_padding_mask=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"attn_mask must be boolean .* got torch.int64"):
        masks_from_torch(torch.zeros(2, 2, dtype=torch.long))
    assert masks_from_torch() is None
    with pytest.raises(TypeError, match=r"from_torch expects a torch.nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def _module(num_kv_heads: int = 4, positional: str | None = None) -> MultiHeadAttention:
    torch.manual_seed(6)
    return MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, positional=positional).double()


def test_gqa_equals_explicitly_repeated_keys_and_values() -> None:
    gqa = _module(num_kv_heads=2, positional="rope")
    full = _module(num_kv_heads=4, positional="rope")
    with torch.no_grad():  # query head h uses key/value head h // 2: repeat each kv head twice
        for name in ("k_proj", "v_proj"):
            small, big = getattr(gqa, name), getattr(full, name)
            big.weight.copy_(small.weight.view(2, 4, 16).repeat_interleave(2, dim=0).view(16, 16))
            big.bias.copy_(small.bias.view(2, 4).repeat_interleave(2, dim=0).view(16))
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    close(gqa(x, is_causal=True), full(x, is_causal=True), 1e-12)
    mqa = _module(num_kv_heads=1)
    assert mqa.k_proj.weight.shape == (4, 16) and mqa(x).shape == (2, 7, 16)


@pytest.mark.parametrize("positional", [None, "rope", "rope-interleaved", "alibi"])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_causal_gradient_of_output_i_reaches_exactly_inputs_up_to_i(
    positional: str | None, num_kv_heads: int
) -> None:
    attn = _module(num_kv_heads=num_kv_heads, positional=positional)
    length = 6
    x = torch.randn(1, length, 16, dtype=torch.float64, requires_grad=True)
    out = attn(x, is_causal=True)
    for i in range(length):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        reached = grad[0].abs().sum(dim=-1) > 0
        assert reached.tolist() == [j <= i for j in range(length)], i


def test_self_cross_and_options_shapes() -> None:
    attn = MultiHeadAttention(8, 2, kdim=3, vdim=5, head_dim=6)
    query, key, value = torch.randn(2, 4, 8), torch.randn(2, 9, 3), torch.randn(2, 9, 5)
    out, weights = attn(query, key, value, need_weights=True)
    assert out.shape == (2, 4, 8) and weights.shape == (2, 2, 4, 9)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 4))
    assert attn.W_q.shape == (8, 12) and attn.W_k.shape == (3, 12) and attn.W_o.shape == (12, 8)
    assert "head_dim=6" in repr(attn)


def test_key_padding_lengths_and_masks_match_explicit_masks() -> None:
    attn = _module()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    lengths = [3, 5]
    dense = (torch.arange(5) < torch.tensor(lengths)[:, None])[:, None, None, :]
    expected = attn(x, mask=dense & torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(attn(x, key_padding_lengths=lengths, is_causal=True), expected)
    rule = masks.causal() & masks.key_padding(lengths)
    torch.testing.assert_close(attn(x, mask=rule), expected)
    torch.testing.assert_close(attn(x, mask=masks.causal(), key_padding_lengths=lengths), expected)


def test_alibi_module_equals_core_with_alibi_bias() -> None:
    attn = _module(positional="alibi")
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    q = attn.q_proj(x).view(1, 5, 4, 4).transpose(1, 2)
    k = attn.k_proj(x).view(1, 5, 4, 4).transpose(1, 2)
    v = attn.v_proj(x).view(1, 5, 4, 4).transpose(1, 2)
    bias = torch.from_numpy(qkv.positional.alibi_bias(4, 5))
    context = qkv.scaled_dot_product_attention(q, k, v, bias=bias, is_causal=True)
    expected = attn.out_proj(context.transpose(1, 2).reshape(1, 5, 16))
    torch.testing.assert_close(attn(x, is_causal=True), expected)


def test_long_alibi_runs_block_by_block_with_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attn = _module(positional="alibi")
    x = torch.randn(1, 9, 16, dtype=torch.float64, requires_grad=True)
    dense = attn(x, is_causal=True)
    (grad_dense,) = torch.autograd.grad(dense.square().sum(), x)
    monkeypatch.setattr(qkv.attention._options, "DENSE_MASK_LIMIT", 10)  # as if it were long
    seen = []
    real = qkv.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((kwargs["bias"], kwargs["score_mod"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(qkv.nn._mha, "scaled_dot_product_attention", spy)
    blockwise = attn(x, is_causal=True)
    (grad_blockwise,) = torch.autograd.grad(blockwise.square().sum(), x)
    assert seen[0][0] is None and seen[0][1] is not None  # a score_mod, no (H, Lq, Lk) array
    close(blockwise, dense, 1e-12)
    close(grad_blockwise, grad_dense, 1e-12)


def test_dropout_only_while_training() -> None:
    attn = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(1, 6, 8)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    attn.train()
    torch.manual_seed(0)
    first = attn(x)
    assert not torch.allclose(first, attn(x))


def test_transformer_block_is_pre_norm_residual_and_trains() -> None:
    torch.manual_seed(7)
    block = TransformerBlock(16, 4, num_kv_heads=2, positional="rope", mlp_dim=32)
    x = torch.randn(2, 6, 16)
    attended = x + block.attn(block.attn_norm(x), is_causal=True)
    expected = attended + block.mlp(block.mlp_norm(attended))
    torch.testing.assert_close(block(x, is_causal=True), expected)
    optimiser = torch.optim.SGD(block.parameters(), lr=0.1)
    target = torch.randn(2, 6, 16)
    losses = []
    for _ in range(5):
        loss = ((block(x, is_causal=True) - target) ** 2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"embed_dim": 10, "num_heads": 3}, ValueError,
         r"embed_dim must be divisible by num_heads .* embed_dim=10, num_heads=3\. "
         r"Hint: choose num_heads among \[1, 2, 5, 10\]"),
        ({"embed_dim": 8, "num_heads": 4, "num_kv_heads": 3}, ValueError,
         r"num_kv_heads must divide num_heads: num_heads=4, num_kv_heads=3"),
        ({"embed_dim": 0, "num_heads": 1}, ValueError, r"embed_dim must be a positive integer"),
        ({"embed_dim": 8, "num_heads": 2, "head_dim": 3, "positional": "rope"}, ValueError,
         r"needs an even head_dim .* got head_dim=3"),
        ({"embed_dim": 8, "num_heads": 2, "positional": "sinusoidal"}, ValueError,
         r"positional must be None, one of .* got 'sinusoidal'\. Hint: sinusoidal positions"),
        ({"embed_dim": 8, "num_heads": 2, "dropout": 1.0}, ValueError,
         r"dropout must be a probability in \[0, 1\), got 1\.0"),
        ({"embed_dim": 8, "num_heads": 2, "positional": qkv.positional.ALiBi(slopes=(0.5,))},
         ValueError, r"ALiBi slopes must give one slope per head \(2\), got 1"),
    ],
)  # fmt: skip
def test_constructor_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    embed_dim, num_heads = kwargs.pop("embed_dim"), kwargs.pop("num_heads")
    with pytest.raises(error, match=match):
        MultiHeadAttention(embed_dim, num_heads, **kwargs)


def test_forward_errors() -> None:
    attn = MultiHeadAttention(8, 2, kdim=4)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"query must have shape \(B, L, embed_dim=8\), got "
                       r"\(3, 8\)\. Hint: add a batch axis: query\[None\]"):  # fmt: skip
        attn(x[0])
    with pytest.raises(ValueError, match=r"key must have shape \(B, L, kdim=4\), got \(2, 3, 8\)"):
        attn(x)
    with pytest.raises(TypeError, match=r"query must be floating point, got torch.int64"):
        MultiHeadAttention(8, 2)(torch.zeros(1, 2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key and value must have the same batch and length"):
        attn(x, torch.randn(2, 4, 4), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"query and key must have the same batch size B"):
        attn(x, torch.randn(1, 4, 4), torch.randn(1, 4, 8))
    self_attn = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"mask must have shape \(Lq, Lk\) or \(B, H, Lq, Lk\)"
                       r".*Hint: a \(B, Lq, Lk\) mask becomes mask\[:, None\]"):  # fmt: skip
        self_attn(x, mask=torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be a boolean tensor .* got list"):
        self_attn(x, mask=[[True]])
    with pytest.raises(TypeError, match=r"mask must be boolean \(True = may attend\) or "
                       r"floating point .* got torch.int64\. Hint: .*mask.bool\(\)"):  # fmt: skip
        self_attn(x, mask=torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key_padding_lengths must be 2 integers .* got "
                       r"torch.float32 of shape \(2,\)"):  # fmt: skip
        self_attn(x, key_padding_lengths=torch.tensor([1.0, 2.0]))
