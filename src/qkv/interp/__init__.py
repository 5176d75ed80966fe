"""qkv inside the tools of interpretability: TransformerLens and nnsight without eager.

``use_qkv(model)`` switches the attention of a model loaded by TransformerLens 4
(``TransformerBridge``), nnsight (``LanguageModel``) or transformers to qkv's: torch's SDPA,
O(N) memory, exact to float32 rounding. The tool's hooks and edits keep working, and any
head's exact pattern comes from :func:`qkv.tracing` (``qkv.tracing(model=bridge)`` names the
bridge's layers ``"blocks.0.attn"``), recomputed for the heads and query rows selected. On a
bridge, ``hook_pattern`` and ``hook_attn_scores`` fire only when hooked, with those rows.
See docs/interventions.md, "Inside TransformerLens and nnsight". Needs
``pip install 'qkv[interp]'``.

Example:
    >>> import torch, qkv
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(
    ...     vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...     num_attention_heads=4, num_key_value_heads=2)).eval()
    >>> switch = qkv.interp.use_qkv(model)
    >>> with torch.no_grad(), qkv.tracing(model=model, heads=3, queries=-1) as t:
    ...     _ = model(torch.tensor([[1, 2, 3]]))
    >>> t["weights"].value.shape                 # (B, heads kept, rows kept, keys)
    (1, 1, 1, 3)
    >>> switch.restore()
"""

from __future__ import annotations

from qkv.interp._lens import LENS_IMPLEMENTATION
from qkv.interp._switch import QkvAttention, use_qkv

__all__ = ["LENS_IMPLEMENTATION", "QkvAttention", "use_qkv"]
