"""The formulas of Q, K and V in a Hugging Face trace say what the model computed.

A model's own Q and K are rotated by position in the RoPE families, its projections may
add a bias, and some families scale Q themselves: the trace writes
``Q = RoPE(X·W_q + b_q)`` or ``Q = (X·W_q + b_q) / √d_k`` where the model did that, in every
format (the LaTeX and Markdown renderers used to write ``Q = X W_q`` for every trace). Each
formula is checked against the model itself: the recorded rows equal what the model's own
modules compute from the layer's input X (at position 0 for the rotated ones, where RoPE
rotates by an angle of 0 and leaves only its own scaling, YaRN's in gpt-oss).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf

import qkv
from qkv import render
from tests.hf.test_hf_tracing import PADDING, _configs, _family, _inputs

ROPE = ("Q = RoPE(X·W_q)", "K = RoPE(X·W_k)", "V = X·W_v")
ROPE_BIAS = ("Q = RoPE(X·W_q + b_q)", "K = RoPE(X·W_k + b_k)", "V = X·W_v + b_v")
BIAS = ("Q = X·W_q + b_q", "K = X·W_k + b_k", "V = X·W_v + b_v")
EXPECTED: dict[str, dict[str, tuple[str, str, str]]] = {
    "llama (GQA)": {"self": ROPE},
    "mistral (sliding window)": {"self": ROPE},
    "qwen2 (sliding window)": {"self": ROPE_BIAS},
    "gemma2 (softcap)": {"self": ROPE},
    "gpt_oss (sinks)": {"self": ROPE_BIAS},
    "gpt2": {"self": BIAS},
    "bert": {"self": BIAS},
    "t5 (position bias, cross-attention)": {
        "self": ("Q = X·W_q", "K = X·W_k", "V = X·W_v"),
        "cross": ("Q = X·W_q", "K = Y·W_k", "V = Y·W_v"),
    },
    "bart (cross-attention)": {
        "self": BIAS,
        "cross": ("Q = X·W_q + b_q", "K = Y·W_k + b_k", "V = Y·W_v + b_v"),
    },
    "whisper (cross-attention)": {  # no bias in k_proj; Q scaled by 1/√d_k before attention
        "self": ("Q = (X·W_q + b_q) / √d_k", "K = X·W_k", "V = X·W_v + b_v"),
        "cross": ("Q = (X·W_q + b_q) / √d_k", "K = Y·W_k", "V = Y·W_v + b_v"),
    },
    "vit": {"self": BIAS},
}
_CROSS = ("encoder_attn", "EncDecAttention")


def _projections(module: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """X·W + b of Q, K and V as the module's own projections compute them, (B, L, width)."""
    fused = getattr(module, "c_attn", None)
    if fused is not None:  # GPT-2: one projection, then split in three
        return dict(zip("QKV", fused(x).chunk(3, dim=-1), strict=True))
    names = {
        "Q": ("q_proj", "query", "q"),
        "K": ("k_proj", "key", "k"),
        "V": ("v_proj", "value", "v"),
    }
    found = {}
    for letter, options in names.items():
        projection = next(getattr(module, n) for n in options if hasattr(module, n))
        found[letter] = projection(x)
    return found


def _trace_with_inputs(model: Any, kind: str) -> tuple[qkv.Trace, dict[str, torch.Tensor]]:
    """The trace of every layer (query row 0 kept) and each attention module's input X."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for path, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and not any(
            other.startswith(path + ".") and type(m).__name__.endswith("Attention")
            for other, m in model.named_modules()
        ):

            def keep(_: Any, args: Any, kwargs: Any, path: str = path) -> None:
                inputs[path] = args[0] if args else kwargs["hidden_states"]

            hooks.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad(), qkv.tracing(model=model, queries=[0]) as trace:
            model(**_inputs(kind, PADDING["right"]))
    finally:
        for hook in hooks:
            hook.remove()
    return trace, inputs


@pytest.mark.parametrize("family", list(EXPECTED))
def test_each_formula_is_what_the_model_computed(family: str) -> None:
    model = _family(family)
    kind = _configs()[family][2]
    trace, inputs = _trace_with_inputs(model, kind)
    modules = dict(model.named_modules())
    for call in trace.calls:
        assert call.layer is not None
        cross = any(word in call.layer for word in _CROSS)
        expected = EXPECTED[family]["cross" if cross else "self"]
        assert tuple(call[name].formula for name in "QKV") == expected, call.layer
        if cross:  # K and V come from the encoder's output Y: checked by their formula only
            continue
        module = modules[call.layer]
        made = _projections(module, inputs[call.layer])
        if "/ √d_k" in expected[0]:
            made["Q"] = made["Q"] * module.scaling
        rotary = next((m for m in model.modules() if "Rotary" in type(m).__name__), None)
        rotary_scale = float(getattr(rotary, "attention_scaling", 1.0))
        for name in "QKV":
            step = call[name]
            b, heads, _, d = step.value.shape
            whole = made[name].reshape(b, -1, heads, d).transpose(1, 2)  # (B, heads, L, D)
            if step.index and "query" in step.index:
                whole = whole[:, :, step.index["query"]]
            if "RoPE" in step.formula:  # position 0 is rotated by an angle of 0
                whole = whole[:, :, :1] * rotary_scale
                got = torch.from_numpy(step.value[:, :, :1])
            else:
                got = torch.from_numpy(step.value)
            torch.testing.assert_close(got, whole, atol=1e-6, rtol=0, msg=f"{call.layer} {name}")


def test_markdown_and_latex_write_the_model_formula_not_x_w_q() -> None:
    model = _family("qwen2 (sliding window)")
    with torch.no_grad(), qkv.tracing(model=model, layers=0, heads=[3], queries=[2]) as trace:
        model(**_inputs("text", PADDING["right"]))
    markdown, latex = render.markdown(trace), render.latex(trace)
    assert r"$Q = \operatorname{RoPE}(X W_q + b_q)$" in markdown
    assert r"$V = X W_v + b_v$" in markdown
    assert r"Q = \operatorname{RoPE}(X W_q + b_q)" in latex
    assert "Q = RoPE(X·W_q + b_q)" in render.text(trace)
    for text in (markdown, latex):
        assert "Q = X W_q$" not in text and "Q = X W_q\n" not in text


def test_a_norm_after_the_projection_is_named_and_one_not_understood_leaves_the_letter() -> None:
    config = tf.Qwen3Config(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Qwen3Model(config).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad(), qkv.tracing(model=model, queries=[0]) as trace:
        model(input_ids=ids)
    assert [trace[name].formula for name in "QKV"] == [
        "Q = RoPE(norm(X·W_q))", "K = RoPE(norm(X·W_k))", "V = X·W_v",
    ]  # fmt: skip
    assert r"\operatorname{RoPE}(\operatorname{norm}(X W_q))" in render.latex(trace)
    # a normalisation qkv does not know of: no formula is claimed, only the letter
    attention = model.layers[0].self_attn
    attention.extra_layernorm = torch.nn.LayerNorm(8)
    with torch.no_grad(), qkv.tracing(model=model, queries=[0]) as trace:
        model(input_ids=ids)
    assert [trace[name].formula for name in "QKV"] == ["Q", "K", "V"]
    assert "$Q$" in render.markdown(trace)
