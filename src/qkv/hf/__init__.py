"""Hugging Face transformers models traced exactly: ``qkv.tracing(model=hf_model, ...)``.

Importing this package registers qkv's attention function and its mask function with
transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` under the name ``"qkv"``,
and tells :func:`qkv.tracing` how to adapt a transformers model: inside the block the model's
attention implementation is ``"qkv"`` (restored afterwards, also on an error), its attention
modules are named by their module path, and each call runs qkv's attention on the model's own
Q (after RoPE), K and V, so the selected layers, heads and query rows are recorded step by step.
:func:`qkv.tracing` imports it by itself when it is given a transformers model.

Example:
    >>> import torch, qkv
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
    ...                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(config).eval()
    >>> with torch.no_grad(), qkv.tracing(model=model, layers=-1, heads=0, queries=-1) as t:
    ...     _ = model(torch.tensor([[1, 2, 3, 4]]))
    >>> t.layer_names(), t["weights"].value.shape
    (['model.layers.1.self_attn'], (1, 1, 1, 4))
"""

from __future__ import annotations

from qkv.hf._adapter import (
    IMPLEMENTATION,
    attention_modules,
    qkv_attention_forward,
    qkv_mask,
    routed,
)

__all__ = ["IMPLEMENTATION", "attention_modules", "qkv_attention_forward", "qkv_mask", "routed"]
