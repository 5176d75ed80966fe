"""The hand-written oracle of every edit: the model's own ``eager`` attention, with a forward
pre-hook on each edited layer's output projection that edits the same slice of its input.

Head h's context is the slice ``[..., h·D:(h+1)·D]`` of the output projection's input (B, L,
H·D). A weight edit needs the layer's values and weights: the eager attention function is
written out here (``"qkv_test_oracle"``, with transformers' ``eager_mask``) and keeps the
``value`` (B, Hkv, Lk, D) and the ``weights`` (B, H, Lq, Lk) of each call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers as tf
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from qkv.hf import attention_modules
from tests.support.edit_cases import HeadView, edited

ORACLE = "qkv_test_oracle"
_SEEN: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _oracle_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention written out, as the families' ``eager_attention_forward`` computes
    it but with the softmax in the inputs' dtype (theirs is in float32, which is no float64
    oracle): GQA by repeating K and V, T5's position bias, Gemma 2's softcap, gpt-oss's
    sinks, the additive mask."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ k.transpose(-1, -2) * scale  # (B, H, Lq, Lk)
    if kw.get("position_bias") is not None:
        scores = scores + kw["position_bias"]
    if kw.get("softcap") is not None:
        scores = torch.tanh(scores / kw["softcap"]) * kw["softcap"]
    if mask is not None:
        scores = scores + mask[..., : k.shape[-2]]
    sinks = kw.get("s_aux", getattr(module, "sinks", None))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    _SEEN[id(module)] = (value, weights)
    return (weights @ v).transpose(1, 2).contiguous(), weights


def _oracle_mask(**kwargs: Any) -> Any:
    """transformers' ``eager_mask`` with half float32's lowest number for a blocked key
    (float64's ``finfo.min`` plus a negative score overflows to -inf: a padding row of all
    -inf gives NaN weights, which reach every token through the next layer's values, as in
    eager's own float64 result with padding)."""
    mask = eager_mask(**kwargs)
    return None if mask is None else mask.clamp(min=torch.finfo(torch.float32).min / 2)


tf.AttentionInterface.register(ORACLE, _oracle_attention)
AttentionMaskInterface.register(ORACLE, _oracle_mask)


@dataclass
class OracleEdit:
    """One edit as the oracle applies it. ``kind``: a variant of
    ``tests/support/edit_cases.py`` (zero, mean, scale, context, weights, row, ...)."""

    kind: str
    layer: int
    head: int
    value: Any = None  # mean (D,), factor, source (B, L, D) / (B, H?, L, Lk), row weights
    query: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def out_projection(model: Any, path: str, module: Any) -> Any:
    """The module whose input is the concatenation of the heads' contexts."""
    for name in ("o_proj", "c_proj", "o", "out_proj"):
        if isinstance(getattr(module, name, None), torch.nn.Module):
            return getattr(module, name)
    parent = model.get_submodule(path.rsplit(".", 1)[0])
    return parent.output.dense  # BERT, ViT: the attention's output block


@contextmanager
def eager(model: Any) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation(ORACLE)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def oracle(model: Any, *edits: OracleEdit) -> Iterator[None]:
    """The model on eager attention with the edits applied by pre-hooks."""
    modules = attention_modules(model)
    handles = []
    for edit in edits:
        path, module = modules[edit.layer]
        handles.append(
            out_projection(model, path, module).register_forward_pre_hook(_hook(module, edit))
        )
    try:
        with eager(model):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _hook(module: Any, edit: OracleEdit) -> Any:
    def hook(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        concat = args[0].clone()  # (B, L, H·D)
        value, weights = _SEEN[id(module)]
        heads, kv_heads = weights.shape[1], value.shape[1]
        d = concat.shape[-1] // heads
        part = slice(edit.head * d, (edit.head + 1) * d)
        v = value[:, edit.head // (heads // kv_heads)]  # (B, Lk, D)
        q_len, kv_len = concat.shape[1], v.shape[1]
        first = kv_len - q_len if edit.extra.get("queries_last") else 0
        view = HeadView(concat[..., part], v, first)
        concat[..., part] = edited(edit.kind, view, edit.value, edit.query)
        return (concat, *args[1:])

    return hook


def record_eager(model: Any, run: Any, layer: int, head: int) -> tuple[Any, Any]:
    """The eager run's (B, L, D) context and (B, L, Lk) weights of one head."""
    path, module = attention_modules(model)[layer]
    seen: dict[str, Any] = {}

    def keep(_: Any, args: tuple[Any, ...]) -> None:
        concat = args[0]
        weights = _SEEN[id(module)][1]
        d = concat.shape[-1] // weights.shape[1]
        seen["context"] = concat[..., head * d : (head + 1) * d].detach().clone()
        seen["weights"] = weights[:, head].detach().clone()

    handle = out_projection(model, path, module).register_forward_pre_hook(keep)
    try:
        with eager(model), torch.no_grad():
            run()
    finally:
        handle.remove()
    return seen["context"], seen["weights"]
