"""qkv as the attention of a TransformerLens 4 ``TransformerBridge``, its hooks kept.

TransformerLens's bridge recomputes attention itself, eagerly, to fire ``hook_attn_scores``
and ``hook_pattern``: a (B, H, N, N) matrix per layer on every forward. Here each attention
bridge hands its Q (after RoPE), K and V to qkv's attention (torch's SDPA, GQA without
repeating K and V), and the two pattern hooks fire only when something is attached to
them, with the rows qkv recomputes on its reference for the heads and query rows asked
(those a :func:`qkv.tracing` block selects for the layer; every head and row without one):
O(rows · N) where eager is O(H · N²). Every other hook fires where TransformerLens fires it,
on the same tensor, and what a hook returns flows on: an edit of ``hook_q``, ``hook_z``,
``hook_result``, ``hook_rot_q`` ... changes the output as it does on the eager bridge, and
an edited pattern or score row recomputes that row of the head's context (weights · V).

Two kinds of bridge are switched, each at a seam TransformerLens defines:

- ``JointQKVAttentionBridge`` (GPT-2's fused ``c_attn``): its ``_reconstruct_attention``,
  which receives Q, K and V from the bridge's own split projections (``hook_q/k/v`` fired).
- ``PositionEmbeddingsAttentionBridge`` (Llama, Mistral, Qwen2, ...): its ``forward``
  delegates to the Hugging Face attention module (whose projections are the bridge's
  ``LinearBridge`` s), which calls the attention function registered as
  :data:`LENS_IMPLEMENTATION`; that function fires ``hook_rot_q``/``hook_rot_k`` on the rotated
  Q and K, then runs qkv.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from qkv.attention import scaled_dot_product_attention
from qkv.hf import qkv_attention_forward, qkv_mask
from qkv.hf._adapter import call_options
from qkv.trace import Trace, current_trace

__all__ = ["LENS_IMPLEMENTATION", "attention_bridges", "lens_attention", "switch_bridge"]

LENS_IMPLEMENTATION = "qkv_lens"
"""The transformers attention implementation of a switched bridge's Hugging Face model:
qkv's attention with TransformerLens's hooks (registered with its mask function by
:func:`register`)."""

_BRIDGES: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
"""The attention bridge of each switched Hugging Face attention module."""

_SEAMS = {
    "JointQKVAttentionBridge": "_reconstruct_attention",
    "PositionEmbeddingsAttentionBridge": "forward",
}
"""The bridge classes qkv switches, and the method of each that it replaces."""


def _torch() -> Any:
    import torch

    return torch


def attention_bridges(bridge: Any) -> list[tuple[str, Any]]:
    """The attention bridges of a ``TransformerBridge``, by path (``"blocks.0.attn"``).

    Raises:
        ValueError: one of them is of a class qkv does not switch (naming it and those it
            does), or the bridge has none.
    """
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    paths: dict[int, tuple[str, Any]] = {}
    for path, module in bridge.named_modules(remove_duplicate=False):
        if isinstance(module, AttentionBridge) and "_original_component" not in path:
            known = paths.get(id(module))
            if known is None or len(path) < len(known[0]):
                paths[id(module)] = (path, module)
    found = list(paths.values())
    for path, module in found:
        if type(module).__name__ not in _SEAMS:
            raise ValueError(
                f"use_qkv: TransformerLens attention {path!r} is a {type(module).__name__}, "
                "which qkv "
                f"does not switch. Hint: qkv switches {', '.join(_SEAMS)} (GPT-2, Llama and "
                "their kin); run this model with TransformerLens's own attention."
            )
    if not found:
        raise ValueError(
            f"use_qkv: the {type(bridge).__name__} has no TransformerLens attention bridge. "
            "Hint: load the model with TransformerBridge.boot_transformers(folder)."
        )
    return found


def _check_config(bridge: Any) -> None:
    """Refuse the split-input modes, which fork the residual per head before Q, K and V."""
    config = bridge.config
    for flag in ("use_split_qkv_input", "use_attn_in"):
        if getattr(config, flag, False):
            raise ValueError(
                f"qkv attention in TransformerLens: cfg.{flag} is set, which qkv's attention "
                "does not reproduce. Hint: switch it off, or restore TransformerLens's "
                "attention first (use_qkv(...).restore())."
            )


def _hooked(*points: Any) -> bool:
    """Whether any of these ``HookPoint`` s has a forward hook attached."""
    return any(bool(getattr(p, "fwd_hooks", None) or p._forward_hooks) for p in points)


def lens_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """transformers' attention function for :data:`LENS_IMPLEMENTATION`: qkv's attention
    (:func:`qkv.hf.qkv_attention_forward`), with the TransformerLens hooks of ``module``'s
    bridge fired around it (``hook_rot_q``/``hook_rot_k`` before, the pattern hooks after).

    query (B, H, Lq, D) after RoPE, key and value (B, Hkv, Lk, D); returns the output
    (B, Lq, H, D) and the weights when transformers collects them, else None.
    """
    found = _BRIDGES.get(module)
    bridge = found() if found is not None else None
    if bridge is not None and hasattr(bridge, "hook_rot_q"):
        query, key = bridge.hook_rot_q(query), bridge.hook_rot_k(key)
    output, weights = qkv_attention_forward(
        module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
    )
    if bridge is not None and _hooked(bridge.hook_attn_scores, bridge.hook_pattern):
        output = _pattern_hooks(
            bridge, module, (query, key, value), attention_mask, output, scaling, kwargs
        )
    return output, weights


def _selected(module: Any, heads: int, rows: int) -> tuple[list[int], list[int]]:
    """The heads and query rows whose pattern the hooks see: those an enclosing
    :func:`qkv.tracing` block records for this layer, else all."""
    trace = current_trace()
    if trace is None or not trace.records_layer(trace.layer_name(module)):
        return list(range(heads)), list(range(rows))
    return (
        trace.selection("head", heads) or list(range(heads)),
        trace.selection("query", rows) or list(range(rows)),
    )


def _pattern_hooks(
    bridge: Any,
    module: Any,
    qkv: tuple[Any, Any, Any],
    mask: Any,
    output: Any,
    scale: float | None,
    kwargs: dict[str, Any],
) -> Any:
    """Fire ``hook_attn_scores`` (the masked scores, before softmax) and ``hook_pattern``
    on the (B, heads, rows, Lk) rows qkv recomputes on its reference; where a hook returns
    other numbers, the head's context rows become ``pattern · V`` (softmax of the returned
    scores first), written into ``output`` (B, Lq, H, D). The call's options (mask, bias,
    softcap, sinks, from its ``kwargs``) are the Hugging Face adapter's
    (:func:`qkv.hf._adapter.call_options`), the same the output was computed with."""
    torch = _torch()
    query, key, value = qkv
    n_heads, q_len = int(query.shape[1]), int(query.shape[2])
    heads, rows = _selected(module, n_heads, q_len)
    group = n_heads // int(key.shape[1])
    kv_heads = torch.tensor([h // group for h in heads], device=query.device)
    picked = torch.tensor(heads, device=query.device)
    q, k, v = (
        query.detach().index_select(1, picked),
        key.detach().index_select(1, kv_heads),
        value.detach().index_select(1, kv_heads),
    )
    options = call_options(module, query, key, mask, scale, kwargs)  # the adapter's own
    for name in ("mask", "bias"):  # one per head (B, H, Lq, Lk): those of the heads kept
        given = options.get(name)
        if given is not None and given.ndim == 4 and given.shape[1] == n_heads > 1:
            options[name] = given.index_select(1, picked)
    if options["sinks"] is not None:
        options["sinks"] = options["sinks"].detach().index_select(0, picked)
    rows_of = Trace(queries=tuple(rows), record_steps=("scaled", "bias", "masked", "weights"))
    scaled_dot_product_attention(q, k, v, trace=rows_of, **options)
    step = next(s for s in ("masked", "bias", "scaled") if s in rows_of.names)
    rows = list((rows_of[step].index or {}).get("query", rows))  # fewer if memory is short
    masked_value = -torch.inf if bridge.compatibility_mode else torch.finfo(query.dtype).min
    scores = torch.from_numpy(rows_of[step].value).to(query.device, query.dtype)
    scores = scores.masked_fill(torch.isneginf(scores), masked_value)
    pattern = torch.from_numpy(rows_of["weights"].value).to(query.device, query.dtype)
    edited = False
    if _hooked(bridge.hook_attn_scores):
        given = scores.clone()
        returned = bridge.hook_attn_scores(scores)
        if _changed(returned, given):
            full = returned.float().masked_fill(returned <= masked_value, -torch.inf)
            pattern = torch.softmax(full, dim=-1).nan_to_num(0.0).to(query.dtype)
            edited = True
    given = pattern.clone()  # a hook may edit the tensor in place and return it
    returned = bridge.hook_pattern(pattern)
    if _changed(returned, given):
        pattern, edited = returned, True
    if not edited:
        return output
    context = pattern.to(value.dtype) @ value.index_select(1, kv_heads)  # (B, h, rows, D)
    output = output.clone()
    at = torch.tensor(rows, device=query.device)
    for i, head in enumerate(heads):
        output[:, at, head] = context[:, i]
    return output


def _changed(returned: Any, original: Any) -> bool:
    """Whether a hook returned other numbers than it was given."""
    torch = _torch()
    if returned is None:
        return False
    return not (returned.shape == original.shape and torch.equal(returned, original))


def _delegating_forward(bridge: Any) -> Callable[..., Any]:
    """A ``PositionEmbeddingsAttentionBridge.forward`` that fires the bridge's hooks and lets
    the Hugging Face attention module compute (its projections are the bridge's
    ``LinearBridge`` s; its attention function is :func:`lens_attention`)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        _check_config(bridge)
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        else:
            hidden, args = args[0], args[1:]
        hidden = bridge.hook_in(hidden)
        embeddings = kwargs.pop("position_embeddings", None)
        if embeddings is not None:
            embeddings = bridge._apply_position_embedding_hooks(embeddings)
        kwargs.setdefault("attention_mask", None)
        output = bridge.original_component(hidden, *args, position_embeddings=embeddings, **kwargs)
        return (bridge.hook_out(output[0]), *output[1:])

    return forward


def _reconstruct(bridge: Any) -> Callable[..., Any]:
    """A ``JointQKVAttentionBridge._reconstruct_attention`` on qkv: the bridge's own Q, K
    and V (B, N, H·D), split into heads, through :func:`lens_attention`, then its output
    projection (per head with ``cfg.use_attn_result``, firing ``hook_result``)."""

    def reconstruct(q: Any, k: Any, v: Any, **kwargs: Any) -> tuple[Any, Any]:
        _check_config(bridge)
        config = bridge.config
        n_heads = int(config.n_heads)
        n_kv = int(getattr(config, "n_key_value_heads", None) or n_heads)
        q, k, v, batch, seq, head_dim = bridge._reshape_qkv_to_heads(q, k, v, n_heads, n_kv)
        k, v = bridge._update_kv_cache(k, v, **kwargs)
        scale = head_dim**-0.5
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) and bridge._layer_idx:
            scale /= float(bridge._layer_idx + 1)
        if getattr(bridge, "_reorder_and_upcast_attn", False) and q.dtype != _torch().float32:
            raise ValueError(
                f"qkv attention in TransformerLens: reorder_and_upcast_attn with {q.dtype} "
                "weights is not reproduced. Hint: load the model in float32."
            )
        module = bridge.original_component
        context, weights = lens_attention(
            module, q, k, v, kwargs.get("attention_mask"), scaling=scale,
            is_causal=bool(getattr(module, "is_causal", True)),
        )  # fmt: skip
        flat = context.reshape(batch, seq, n_heads * head_dim)
        if getattr(config, "use_attn_result", False) and bridge.o.original_component is not None:
            z = bridge.o.hook_in(flat).view(batch, seq, n_heads, head_dim)
            return bridge._compute_per_head_result(z, n_heads, head_dim), weights
        return bridge._apply_output_projection(flat), weights

    return reconstruct


def _per_head_output(bridge: Any) -> Callable[..., Any]:
    """The output projection of a delegating bridge: TransformerLens's per-head result
    (``hook_z``, then ``hook_result`` on (B, N, H, E), summed) with ``cfg.use_attn_result``,
    else the ``LinearBridge`` as it is."""
    projection = bridge.o
    plain = type(projection).forward.__get__(projection)

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        config = bridge.config
        if not getattr(config, "use_attn_result", False):
            return plain(x, *args, **kwargs)
        n_heads = int(config.n_heads)
        z = projection.hook_in(x)
        z = z.view(*z.shape[:-1], n_heads, z.shape[-1] // n_heads)
        return bridge._compute_per_head_result(z, n_heads, z.shape[-1])

    return forward


def switch_bridge(bridge: Any) -> Callable[[], None]:
    """Switch every attention bridge of ``bridge`` to qkv (checked first, all or none);
    returns the function that switches them back."""
    found = attention_bridges(bridge)
    hf_model = bridge.original_model
    previous = hf_model.config._attn_implementation
    # TransformerLens asks transformers for every layer's (B, H, N, N) weights (its config's
    # output_attentions, and run_with_cache's); its own flag says the bridge forms the
    # pattern itself, which qkv's hooks do, for the rows asked
    asked = hf_model.config.output_attentions
    adapter = bridge.adapter
    own_flag = "supports_hf_output_attentions" in vars(adapter)
    flag = adapter.supports_hf_output_attentions
    register()
    hf_model.set_attn_implementation(LENS_IMPLEMENTATION)
    hf_model.config.output_attentions = False
    adapter.supports_hf_output_attentions = False
    undo: list[tuple[Any, str]] = []
    for _, attention in found:
        _BRIDGES[attention.original_component] = weakref.ref(attention)
        # object.__setattr__: a bridge hands attributes it does not own (``forward``) on
        # to the module it wraps
        if type(attention).__name__ == "JointQKVAttentionBridge":
            object.__setattr__(attention, "_reconstruct_attention", _reconstruct(attention))
            undo.append((attention, "_reconstruct_attention"))
        else:
            object.__setattr__(attention, "forward", _delegating_forward(attention))
            object.__setattr__(attention.o, "forward", _per_head_output(attention))
            undo += [(attention, "forward"), (attention.o, "forward")]

    def restore() -> None:
        for owner, name in undo:
            owner.__dict__.pop(name, None)
        for _, attention in found:
            _BRIDGES.pop(attention.original_component, None)
        hf_model.set_attn_implementation(previous)
        hf_model.config.output_attentions = asked
        if own_flag:
            adapter.supports_hf_output_attentions = flag
        else:
            del adapter.supports_hf_output_attentions

    return restore


def register() -> None:
    """Register :func:`lens_attention` and qkv's mask function with transformers under
    :data:`LENS_IMPLEMENTATION` (both, always together: transformers passes no mask to an
    implementation without a mask function)."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(LENS_IMPLEMENTATION, lens_attention)
    AttentionMaskInterface.register(LENS_IMPLEMENTATION, qkv_mask)
