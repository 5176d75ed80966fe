"""qkv.tracing(model=hf_model): transformers models run through qkv's attention, exactly.

Every family is a tiny random-weight model built from its config (nothing is downloaded);
its outputs and ``output_attentions`` weights inside ``qkv.tracing`` are compared with the
model's own ``eager`` implementation on the real (non-padding) tokens, to 1e-6 in float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import qkv
from qkv.hf import IMPLEMENTATION, attention_modules, qkv_attention_forward

_COMMON: dict[str, Any] = {
    "vocab_size": 60,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
_SEQ2SEQ: dict[str, Any] = {
    "vocab_size": 60,
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}


def _configs() -> dict[str, tuple[Any, Any, str]]:
    """Each family: its config, its model class and how it takes inputs."""
    return {
        "llama (GQA)": (
            tf.LlamaConfig(**_COMMON, num_key_value_heads=2),
            tf.LlamaModel,
            "text",
        ),
        "mistral (sliding window)": (
            tf.MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=3),
            tf.MistralModel,
            "text",
        ),
        "qwen2 (sliding window)": (
            tf.Qwen2Config(
                **_COMMON,
                num_key_value_heads=2,
                use_sliding_window=True,
                sliding_window=3,
                max_window_layers=0,
            ),
            tf.Qwen2Model,
            "text",
        ),
        "gemma2 (softcap)": (
            tf.Gemma2Config(
                **_COMMON,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=3,
                attn_logit_softcapping=2.0,
                query_pre_attn_scalar=8,
            ),
            tf.Gemma2Model,
            "text",
        ),
        "gpt_oss (sinks)": (
            tf.GptOssConfig(
                **_COMMON,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=3,
                num_local_experts=2,
                num_experts_per_tok=1,
            ),
            tf.GptOssModel,
            "text",
        ),
        "gpt2": (
            tf.GPT2Config(
                vocab_size=60,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=32,
                bos_token_id=0,
                eos_token_id=0,
            ),
            tf.GPT2Model,
            "text",
        ),
        "bert": (tf.BertConfig(**_COMMON, max_position_embeddings=32), tf.BertModel, "text"),
        "t5 (position bias, cross-attention)": (
            tf.T5Config(vocab_size=60, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
            tf.T5Model,
            "seq2seq",
        ),
        "bart (cross-attention)": (
            tf.BartConfig(**_SEQ2SEQ, max_position_embeddings=32),
            tf.BartModel,
            "seq2seq",
        ),
        "whisper (cross-attention)": (
            tf.WhisperConfig(
                **_SEQ2SEQ,
                num_mel_bins=8,
                max_source_positions=5,
                max_target_positions=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            ),
            tf.WhisperModel,
            "speech",
        ),
        "vit": (
            tf.ViTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                image_size=8,
                patch_size=4,
            ),
            tf.ViTModel,
            "vision",
        ),
    }


def _family(name: str) -> Any:
    """A tiny model of the family ``name``, in eval mode, with a fixed seed."""
    config, cls, _ = _configs()[name]
    torch.manual_seed(0)
    model = cls(config).eval()
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks)  # non-zero sinks, so that they matter
    return model


FAMILIES = list(_configs())
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
PADDING = {
    "right": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
    "left": torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]),
}


def _inputs(kind: str, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inputs of a family: token ids with their padding mask (also for the decoder of an
    encoder-decoder model), 5 frames of audio features or an image of 2x2 patches."""
    generator = torch.Generator().manual_seed(1)
    if kind == "text":
        return {"input_ids": IDS, "attention_mask": mask}
    decoder = {"decoder_input_ids": IDS, "decoder_attention_mask": mask}
    if kind == "seq2seq":
        return {"input_ids": IDS, "attention_mask": mask, **decoder}
    if kind == "speech":
        return {"input_features": torch.randn(2, 8, 10, generator=generator), **decoder}
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=generator)}


def _run(model: Any, kind: str, mask: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(**_inputs(kind, mask), output_attentions=True)


def _eager(model: Any, kind: str, mask: torch.Tensor) -> Any:
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return _run(model, kind, mask)
    finally:
        model.set_attn_implementation(previous)


def _real(rows: int, kind: str, mask: torch.Tensor) -> torch.Tensor:
    """Which of ``rows`` positions are real tokens: the padding mask for the token sequences,
    every position of audio frames and image patches."""
    if kind != "vision" and rows == mask.shape[1]:
        return mask.bool()
    return torch.ones(mask.shape[0], rows, dtype=torch.bool)


@pytest.mark.parametrize("padding", sorted(PADDING))
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_and_weights_equal_eager_on_real_tokens(family: str, padding: str) -> None:
    model = _family(family)
    kind = _configs()[family][2]
    mask = PADDING[padding]
    expected = _eager(model, kind, mask)
    before = model.config._attn_implementation
    with qkv.tracing(model=model, layers=-1, heads=1, queries=-1) as t:
        got = _run(model, kind, mask)
    for field in ("last_hidden_state", "encoder_last_hidden_state"):
        if getattr(expected, field, None) is not None:
            ours, theirs = getattr(got, field), getattr(expected, field)
            real = _real(ours.shape[1], kind, mask)
            assert (ours - theirs)[real].abs().max() <= 1e-6, field
    compared = 0
    for field in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        ours_all = getattr(got, field, None) or ()
        for ours, theirs in zip(ours_all, getattr(expected, field, None) or (), strict=True):
            real = _real(ours.shape[2], kind, mask)[:, None, :, None].expand_as(ours)
            assert (ours - theirs)[real].abs().max() <= 1e-6, field
            compared += 1
    assert compared == len(attention_modules(model))
    # the trace: the last attention module, head 1, the last query row of both sequences
    assert len(t.layer_names()) == 1
    assert len(t.calls) == 1
    weights = t["weights"]
    keys = weights.value.shape[-1]
    assert weights.value.shape == (2, 1, 1, keys)
    assert weights.index is not None and weights.index["head"] == [1]
    assert len(weights.index["query"]) == 1
    last = (getattr(expected, "cross_attentions", None) or expected.attentions)[-1][:, 1, -1]
    torch.testing.assert_close(torch.from_numpy(weights.value[:, 0, 0]), last, atol=1e-6, rtol=0)
    if "sliding window" in family:  # window 3: the last row sees keys 3, 4, 5 only
        assert (weights.value[0, 0, 0, :3] == 0).all() and (weights.value[0, 0, 0, 3:] > 0).all()
    assert t.meta["hf_calls"] == len(attention_modules(model))
    assert model.config._attn_implementation == before  # restored


def _causal_lm(family: str) -> Any:
    """The causal language model of a decoder family, with a fixed seed."""
    base = _family(family)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(base.config)
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks)
    return model


@pytest.mark.parametrize("family", ["llama (GQA)", "mistral (sliding window)", "gpt_oss (sinks)"])
def test_generate_with_a_cache_gives_the_same_tokens(family: str) -> None:
    """Greedy decoding inside qkv.tracing (one query per step after the prompt) equals eager."""
    model = _causal_lm(family).eval()
    ids, mask = IDS, PADDING["left"]
    with torch.no_grad(), qkv.tracing(model=model, layers=-1, heads=0, queries=-1) as t:
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, eager)
    assert t.meta["hf_calls"] == 8  # 4 forwards x 2 layers
    assert [c.meta["shapes"]["query"][2] for c in t.calls] == [6, 1, 1, 1]
    assert t.calls[-1].steps[-2].value.shape[:3] == (2, 1, 1)  # the last step: one row


@pytest.mark.parametrize("family", ["llama (GQA)", "gpt_oss (sinks)"])
def test_a_training_step_gives_the_gradients_of_eager(family: str) -> None:
    model = _causal_lm(family).train()
    with qkv.tracing(model=model, layers=0, heads=0, queries=-1):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_attn_implementation("eager")
    expected = model(IDS, labels=IDS).loss
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(grads)
    if "sinks" in family:
        assert any(name.endswith("sinks") for name in ours)
    for name, grad in grads.items():
        assert (ours[name] - grad).abs().max() <= 1e-6, name


def test_layers_are_named_by_module_path_and_selected() -> None:
    model = _family("llama (GQA)")
    with torch.no_grad(), qkv.tracing(model=model, layers="layers.0") as t:
        model(IDS)
    assert t.layer_names() == ["layers.0.self_attn"]
    assert t.meta["layers"]["layers.0.self_attn"]["num_kv_heads"] == 2
    no_layer = r"selects no attention module.*'layers\.1\.self_attn'"
    with pytest.raises(ValueError, match=no_layer), qkv.tracing(model=model, layers="decoder"):
        pass


def test_trace_holds_q_and_k_after_rope() -> None:
    """The trace's Q and K are the model's own, after the rotary embedding."""
    seen: dict[str, torch.Tensor] = {}

    def capture(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen["Q"], seen["K"] = query.detach().clone(), key.detach().clone()
        return qkv_attention_forward(module, query, key, *args, **kw)

    tf.AttentionInterface.register("qkv_test_capture", capture)
    AttentionMaskInterface.register("qkv_test_capture", eager_mask)
    model = _family("llama (GQA)")
    model.set_attn_implementation("qkv_test_capture")
    with torch.no_grad():
        model(IDS[:1])  # seen: layer 1's Q and K, as the model computed them
    model.set_attn_implementation("eager")
    with torch.no_grad(), qkv.tracing(model=model, layers=1, heads=3) as t:
        model(IDS[:1])
    torch.testing.assert_close(
        torch.from_numpy(t["Q"].value[:, 0]), seen["Q"][:, 3], atol=0, rtol=0
    )
    # query head 3 of 4 uses key/value head 1 of 2 (GQA)
    torch.testing.assert_close(
        torch.from_numpy(t["K"].value[:, 0]), seen["K"][:, 1], atol=0, rtol=0
    )


def test_implementation_is_restored_after_an_exception() -> None:
    model = _family("mistral (sliding window)")
    inside = []

    def fail() -> None:
        with qkv.tracing(model=model):
            inside.append(model.config._attn_implementation)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert inside == [IMPLEMENTATION]
    assert model.config._attn_implementation == "sdpa"


def test_a_causal_model_never_runs_silently_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its mask function transformers passes no mask: qkv refuses the call."""
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, IMPLEMENTATION)
    model = _family("llama (GQA)")
    unmasked = "llama: a causal attention call of 6 queries came without a mask"
    with pytest.raises(ValueError, match=unmasked), torch.no_grad(), qkv.tracing(model=model):
        model(IDS)
    assert model.config._attn_implementation == "sdpa"


def test_arguments_that_change_the_maths_are_refused() -> None:
    model = _family("llama (GQA)")
    attention = model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="'cu_seq_lens_q' changes the attention"):
        qkv_attention_forward(attention, q, k, v, allowed, cu_seq_lens_q=torch.tensor([0, 3]))
    bias = torch.zeros(1, 4, 3, 3)
    with pytest.raises(ValueError, match=r"softcap=1\.0 together with a position_bias"):
        qkv_attention_forward(attention, q, k, v, allowed, softcap=1.0, position_bias=bias)
    with pytest.raises(ValueError, match="sliding_window=2 came without a mask"):
        qkv_attention_forward(attention, q, k, v, None, sliding_window=2, is_causal=False)
    attention.train()
    with pytest.raises(ValueError, match=r"dropout 0\.1 while training"):
        qkv_attention_forward(attention, q, k, v, allowed, dropout=0.1)


def test_softcap_and_sinks_change_the_result() -> None:
    """softcap and s_aux are applied, not dropped: without them the output differs."""
    model = _family("llama (GQA)")
    attention = model.layers[0].self_attn
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 3, 8) * 3, torch.randn(1, 2, 3, 8) * 3, torch.randn(1, 2, 3, 8)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    plain, _ = qkv_attention_forward(attention, q, k, v, allowed, scaling=1.0)
    capped, _ = qkv_attention_forward(attention, q, k, v, allowed, scaling=1.0, softcap=1.0)
    sunk, _ = qkv_attention_forward(attention, q, k, v, allowed, scaling=1.0, s_aux=torch.ones(4))
    assert not torch.allclose(plain, capped) and not torch.allclose(plain, sunk)
    scores = torch.tanh(q @ k.repeat_interleave(2, dim=1).transpose(-1, -2))
    expected = torch.softmax(scores, dim=-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(capped, expected.transpose(1, 2), atol=1e-6, rtol=0)


WITHOUT_INTERFACE: dict[str, tuple[Any, Any]] = {
    "bloom": (tf.BloomModel, tf.BloomConfig(vocab_size=60, hidden_size=32, n_layer=1, n_head=4)),
    "gptj": (
        tf.GPTJModel,
        tf.GPTJConfig(vocab_size=60, n_embd=32, n_layer=1, n_head=4, rotary_dim=4),
    ),
    "falcon": (
        tf.FalconModel,
        tf.FalconConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4),
    ),
}


@pytest.mark.parametrize("family", sorted(WITHOUT_INTERFACE))
def test_a_family_without_the_interface_is_named(family: str) -> None:
    model_class, config = WITHOUT_INTERFACE[family]
    model = model_class(config)
    refused = rf"the {family} family \({model_class.__name__}\) does not call"
    with pytest.raises(ValueError, match=refused), qkv.tracing(model=model):
        pass


def test_a_model_that_never_calls_the_attention_function_is_an_error() -> None:
    """A family that bypasses the interface inside the block is named, not traced as empty."""
    model = _family("llama (GQA)")
    for layer in model.layers:
        layer.self_attn.forward = lambda hidden_states, **_: (hidden_states, None)
    bypassed = r"the llama model ran 1 time\(s\) but never called qkv's attention function"
    with pytest.raises(ValueError, match=bypassed), torch.no_grad(), qkv.tracing(model=model):
        model(IDS)
    assert model.config._attn_implementation == "sdpa"
