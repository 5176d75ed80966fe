"""qkv.edits.logit_attribution and score_terms against hand computations without qkv.

The oracle of the attribution is direct logit attribution written out in float64, as
TransformerLens computes it (``ActivationCache.stack_head_results`` with
``logit_attrs``/``apply_ln_to_stack``, transformer_lens/ActivationCache.py): the model runs
on transformers' own eager attention, a pre-hook on each output projection keeps its input
(the heads' contexts side by side) and a hook on the final norm its input (the residual);
each head's output ``c_h · W_O[h]`` is centered for a LayerNorm, divided by the scale of the
whole residual, and dotted with ``γ ⊙ (W_U[answer] − W_U[wrong])``. The oracle of the score
split is the eager score ``q · k / √d`` of a Hugging Face attention function written here.
The peer, TransformerLens 4.3 on the same weights, is compared too.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import qkv
from qkv.edits import ablate, logit_attribution, score_terms
from tests.hf.test_hf_tracing import _configs as hf_configs
from tests.support.hf_models import _configs, save_tiny

IDS = torch.tensor([[4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]])
ANSWER, WRONG = (9, 12), (10, 10)


def _model(family: str, dtype: torch.dtype) -> Any:
    """A tiny causal LM of ``family`` (tests/support/hf_models.py; tests/hf's for the
    others), seeded, in ``dtype``."""
    if family in ("gpt2", "llama"):
        config, cls = _configs()[family]
    else:
        config = hf_configs()[family][0]
        cls = tf.AutoModelForCausalLM.from_config
    torch.manual_seed(0)
    model = cls(config)
    return model.eval().to(dtype)


def _hand(model: Any, ids: torch.Tensor, answer: tuple[int, ...], wrong: tuple[int, ...]) -> Any:
    """(B, layers, heads) direct logit attribution at the last position, float64, from
    eager attention written here (:func:`_keep_qk`: transformers' own takes the softmax in
    float32) and the model's weights."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation(EAGER)
    gpt2 = eager.config.model_type == "gpt2"
    blocks = eager.transformer.h if gpt2 else eager.model.layers
    norm = eager.transformer.ln_f if gpt2 else eager.model.norm
    seen: dict[Any, torch.Tensor] = {}
    handles = [norm.register_forward_pre_hook(lambda _, a: seen.update(x=a[0]))]
    for i, block in enumerate(blocks):
        projection = block.attn.c_proj if gpt2 else block.self_attn.o_proj
        keep = projection.register_forward_pre_hook(lambda _, a, i=i: seen.update({i: a[0]}))
        handles.append(keep)
    with torch.no_grad():
        eager(ids)
    for handle in handles:
        handle.remove()
    x = seen["x"][:, -1].double()  # (B, E): the whole residual at the last position
    if gpt2:  # LayerNorm: centered, s = √(var + ε)
        centered = x - x.mean(-1, keepdim=True)
        s = (centered.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    else:  # RMSNorm: s = √(mean(x²) + ε)
        s = (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    w_u = eager.lm_head.weight.double()
    direction = (w_u[list(answer)] - w_u[list(wrong)]) * norm.weight.double()  # (B, E)
    heads = eager.config.num_attention_heads
    out = torch.zeros(x.shape[0], len(blocks), heads, dtype=torch.float64)
    for i, block in enumerate(blocks):
        concat = seen[i][:, -1].double()  # (B, H·D)
        size = concat.shape[-1] // heads
        if gpt2:  # Conv1D: x @ W, W (H·D, E)
            rows = block.attn.c_proj.weight.double()
        else:  # Linear: x @ W.T, W (E, H·D)
            rows = block.self_attn.o_proj.weight.double().T
        for h in range(heads):
            o = concat[:, h * size : (h + 1) * size] @ rows[h * size : (h + 1) * size]
            if gpt2:
                o = o - o.mean(-1, keepdim=True)
            out[:, i, h] = (o * direction).sum(-1) / s[:, 0]
    return out


_SEEN: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}


def _keep_qk(
    module: Any, query: Any, key: Any, value: Any, mask: Any, scaling: Any = None, **_: Any
) -> tuple[torch.Tensor, None]:
    """Eager attention (no dropout, GQA by repeating K and V) that keeps Q, K and the scale
    of each call: the oracle's scores."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    _SEEN[id(module)] = (query, key, scale)
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask[..., : k.shape[-2]]
    return (scores.softmax(-1) @ v).transpose(1, 2).contiguous(), None


EAGER = "qkv_test_keep_qk"
tf.AttentionInterface.register(EAGER, _keep_qk)
AttentionMaskInterface.register(EAGER, eager_mask)


def _rms(self: Any, x: torch.Tensor) -> Any:
    """LlamaRMSNorm's forward in the dtype of its input."""
    return self.weight * (x * (x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).rsqrt())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_attribution_equals_the_hand_computation(
    family: str, dtype: torch.dtype, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-2 (LayerNorm, Conv1D) and Llama (GQA, RMSNorm): every head of every layer, per
    prompt, one answer and one wrong token per prompt; the model stays on SDPA.

    transformers' LlamaRMSNorm rounds to float32 even in a float64 model, which makes two
    float64 runs differ by 1e-8; here it computes in the model's dtype, so that float64 is
    compared with float64."""
    monkeypatch.setattr(tf.models.llama.modeling_llama.LlamaRMSNorm, "forward", _rms)
    model = _model(family, dtype)
    found = logit_attribution(model, IDS, list(ANSWER), wrong=list(WRONG))
    expected = _hand(model, IDS, ANSWER, WRONG)
    assert found.by_prompt.shape == (2, 2, 4) and found.values.shape == (2, 4)
    assert (found.by_prompt - expected).abs().max() <= tolerance
    assert (found.values - expected.mean(0)).abs().max() <= tolerance
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        logits = model(IDS).logits[:, -1].double()
    diff = logits[[0, 1], list(ANSWER)] - logits[[0, 1], list(WRONG)]
    assert (found.logit - diff).abs().max() <= tolerance * 10
    assert torch.equal(found.rest, found.logit - found.by_prompt.sum((1, 2)))
    assert "TransformerLens" in found.folding and "(no bias)" in found.folding
    assert ("centered" in found.folding) == (family == "gpt2")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_attribution_equals_transformer_lens_logit_attrs(family: str, tmp_path: Path) -> None:
    """The peer itself: TransformerLens 4.3's bridge on the same saved weights (its final
    norm's γ drawn, so that the folding matters), ``enable_compatibility_mode()`` (which
    folds the final norm into W_U as HookedTransformer did), then
    ``cache.logit_attrs(cache.stack_head_results(layer=-1, pos_slice=-1), ...)``, the
    attribution of its "Exploratory analysis" demo. Equal within 1e-5 in float32."""
    from transformer_lens.model_bridge import TransformerBridge

    folder = save_tiny(family, tmp_path / family)
    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    norm = model.transformer.ln_f if family == "gpt2" else model.model.norm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(5))
    model.save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu")
    bridge.enable_compatibility_mode()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(IDS)
        stack: Any = cache.stack_head_results(layer=-1, pos_slice=-1)  # (layers·heads, B, E)
        theirs = cache.logit_attrs(
            stack, tokens=torch.tensor(ANSWER), incorrect_tokens=torch.tensor(WRONG), pos_slice=-1
        )
    ours = logit_attribution(model, IDS, list(ANSWER), wrong=list(WRONG))
    theirs = theirs.reshape(2, 4, 2).permute(2, 0, 1).double()  # (B, layers, heads)
    assert (ours.by_prompt - theirs).abs().max() <= 1e-5
    assert ours.by_prompt.abs().max() > 1e-3


@pytest.mark.parametrize("family", ["mistral (sliding window)", "qwen2 (sliding window)"])
def test_attribution_of_other_families_of_the_list(family: str) -> None:
    model = _model(family, torch.float64)
    found = logit_attribution(model, IDS[:, :5], 7)
    assert found.values.shape == (2, 4) and bool(torch.isfinite(found.values).all())
    assert model.config.model_type in qkv.edits.FAMILIES


class Residual(nn.Module):
    """A qkv.nn model: embeddings, attention layers added to the residual, a final norm
    (``norm``) and an unembedding."""

    def __init__(self, norm: nn.Module, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(
            qkv.nn.MultiHeadAttention(16, num_heads=4, num_kv_heads=2) for _ in range(layers)
        )
        self.norm, self.unembed = norm, nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor) -> Any:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, is_causal=True)
        return self.unembed(self.norm(x))


def test_without_a_norm_a_last_layer_head_moves_the_logit_by_its_attribution() -> None:
    """What a user reads the number as: with no final norm and nothing after the last
    layer, ablating one of its heads lowers the logit by exactly that head's value."""
    torch.manual_seed(0)
    model = Residual(nn.Identity()).double().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    found = logit_attribution(model, ids, 7, norm=model.norm, unembed=model.unembed)
    with torch.no_grad():
        before = float(model(ids)[0, -1, 7])
        for head in range(4):
            with qkv.intervene(model, ablate(-1, head)):
                after = float(model(ids)[0, -1, 7])
            assert before - after == pytest.approx(float(found.values[1, head]), abs=1e-12)
    assert "no final norm" in found.folding


def test_attribution_reads_the_edited_heads_inside_intervene() -> None:
    model = _model("llama", torch.float64)
    with qkv.intervene(model, ablate(1, 2)):
        found = logit_attribution(model, IDS, 9)
    plain = logit_attribution(model, IDS, 9)
    assert float(found.values[1, 2]) == 0.0 and float(plain.values[1, 2]) != 0.0
    # the heads below write the same vectors: only the final norm's scale changed, by one
    # factor per prompt
    ratio = found.by_prompt[:, 0] / plain.by_prompt[:, 0]
    assert (ratio - ratio[:, :1]).abs().max() <= 1e-12 and (ratio - 1).abs().max() > 1e-3


def test_rms_norm_and_layer_norm_of_a_qkv_nn_model_equal_their_formula() -> None:
    """The folding of torch's own norms, written out: LayerNorm centers, RMSNorm does not."""
    torch.manual_seed(1)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    norms: tuple[Any, ...] = (nn.LayerNorm(16), nn.RMSNorm(16, eps=1e-6))
    for norm in norms:
        model = Residual(norm, layers=1).double().eval()
        seen: dict[str, torch.Tensor] = {}
        projection: Any = model.blocks[0].out_proj
        with torch.no_grad():
            norm.weight.normal_()
            norm.register_forward_pre_hook(lambda _, a, seen=seen: seen.update(x=a[0]))
            projection.register_forward_pre_hook(lambda _, a, seen=seen: seen.update(c=a[0]))
            model(ids)
        x, concat = seen["x"][0, -1], seen["c"][0, -1]
        layer = isinstance(norm, nn.LayerNorm)
        centered = x - x.mean() if layer else x
        s = (centered.pow(2).mean() + norm.eps).sqrt()
        direction = (model.unembed.weight[11] * norm.weight).detach()
        found = logit_attribution(model, ids, 11, norm=norm, unembed=model.unembed)
        for h in range(4):
            o = concat[h * 4 : (h + 1) * 4] @ projection.weight.detach().T[h * 4 : (h + 1) * 4]
            o = o - o.mean() if layer else o
            assert float(found.values[0, h]) == pytest.approx(float(o @ direction / s), abs=1e-12)


def test_attribution_refuses_what_it_cannot_fold() -> None:
    where = r"^logit_attribution\(model, inputs, answer\): "
    model = _model("llama", torch.float32)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match=where + r"position -1 is padding in prompt 1\. Hint"):
        logit_attribution(model, {"input_ids": IDS, "attention_mask": mask}, 9)
    with pytest.raises(ValueError, match="token id 99 is not in the vocabulary of 27"):
        logit_attribution(model, IDS, 99)
    with pytest.raises(ValueError, match="gives 3 token ids for a batch of 2"):
        logit_attribution(model, IDS, [1, 2, 3])
    with pytest.raises(TypeError, match="answer must be a token id"):
        logit_attribution(model, IDS, "mat")  # type: ignore[arg-type]
    gemma = _model("gemma2 (softcap)", torch.float32)
    with pytest.raises(ValueError, match=where + "a gemma2 model; qkv folds the final norm of"):
        logit_attribution(gemma, IDS, 9)
    bare = Residual(nn.Identity())
    with pytest.raises(ValueError, match="give its norm= and unembed="):
        logit_attribution(bare, IDS, 9)

    class OnePlusRMSNorm(nn.Module):  # Gemma's: (1 + weight) · x / rms(x)
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.zeros(16)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (1 + self.weight) * x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()

    odd = Residual(OnePlusRMSNorm())
    with pytest.raises(ValueError, match="the final norm does not compute what qkv folds"):
        logit_attribution(odd, IDS, 9, norm=odd.norm, unembed=odd.unembed)
    with pytest.raises(ValueError, match="which qkv does not fold"):
        logit_attribution(odd, IDS, 9, norm=nn.GroupNorm(1, 16), unembed=odd.unembed)


# -- score_terms --------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "layer", "head"), [("gpt2", 1, 2), ("llama", 1, 3)])
def test_score_terms_sum_to_the_eager_score(family: str, layer: int, head: int) -> None:
    """The terms of every key sum to the score ``q · k / √d`` the model's own attention
    computes (after RoPE for Llama, through head 3's key/value head 1 under GQA)."""
    model = _model(family, torch.float64)
    split = score_terms(model, IDS, layer, head, -2)
    other = copy.deepcopy(model)
    other.set_attn_implementation(EAGER)
    with torch.no_grad():
        other(IDS)
    module = (other.transformer.h if family == "gpt2" else other.model.layers)[layer]
    q, k, scale = _SEEN[id(module.attn if family == "gpt2" else module.self_attn)]
    kv = head // (q.shape[1] // k.shape[1])
    expected = (q[:, head, -2, None, :] * k[:, kv]).sum(-1) * scale  # (B, Lk)
    assert split.terms.shape == (2, 6, 8) and split.kv_head == kv and split.query == 4
    assert (split.terms.sum(-1) - expected).abs().max() <= 1e-12
    assert torch.equal(split.score, split.terms.sum(-1))
    assert (split.traced.double() - expected).abs().max() <= 1e-12
    assert (split.pairs().sum(-1) - expected).abs().max() <= 1e-12
    assert split.pairs("interleaved").shape == (2, 6, 4)


def test_score_terms_of_a_qkv_nn_layer_with_rope() -> None:
    torch.manual_seed(2)
    attn = qkv.nn.MultiHeadAttention(16, num_heads=4, num_kv_heads=2, positional="rope")
    attn = attn.double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    split = score_terms(attn, (x,), 0, 1, -1)
    with qkv.tracing(heads=1, queries=-1) as trace:
        attn(x)
    assert (
        split.terms.sum(-1) - torch.from_numpy(trace["scaled"].value[:, 0, 0])
    ).abs().max() <= 1e-12
    assert torch.equal(score_terms(attn, (x,), 0, -3, -1).terms, split.terms)  # from the end
    with pytest.raises(ValueError, match=r"^score_terms\(.*\): layer 'MultiHeadAttention' has "
                       r"4 query heads\. Hint"):  # fmt: skip
        score_terms(attn, (x,), 0, 4, -1)
    with pytest.raises(TypeError, match="head must be a query head index"):
        score_terms(attn, (x,), 0, 1.0, -1)  # type: ignore[arg-type]
