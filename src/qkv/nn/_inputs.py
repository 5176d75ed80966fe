"""Checks of ``qkv.nn.MultiHeadAttention``'s arguments: each error names the argument, what
was expected and what came, with a hint.

Shape legend: B batch, L sequence length, E / Ek / Ev the widths of query, key and value.
"""

from __future__ import annotations

from typing import Any

import torch

from qkv.masks import Mask
from qkv.nn._cache import LayerCache

__all__ = ["check_inputs", "check_packed", "divisors", "positive"]


def check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerCache | None,
    self_attention: bool,
    *,
    widths: tuple[int, int, int],
    weights_dtype: torch.dtype | None,
    extra_rows: bool,
) -> None:
    """The inputs of ``MultiHeadAttention.forward``: tensors (B, L, width) with the
    module's ``widths`` (E, Ek, Ev) and ``weights_dtype``, one batch size, one value per key;
    a cache only for self-attention and without torch's ``extra_rows`` (add_bias_kv,
    add_zero_attn)."""
    for name, x, width, what in (
        ("query", query, widths[0], "embed_dim"),
        ("key", key, widths[1], "kdim"),
        ("value", value, widths[2], "vdim"),
    ):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor of shape (B, L, {width}), got "
                f"{type(x).__name__}. Hint: torch.as_tensor(...)."
            )
        if x.ndim != 3 or x.shape[-1] != width:
            hint = (
                f"add a batch axis: {name}[None]"
                if x.ndim == 2
                else "qkv.nn is batch first: (B, L, features)"
            )
            raise ValueError(
                f"{name} must have shape (B, L, {what}={width}), got {tuple(x.shape)}. "
                f"Hint: {hint}."
            )
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}. Hint: {name}.float().")
        if weights_dtype is not None and x.dtype != weights_dtype:
            wanted = str(weights_dtype).removeprefix("torch.")
            raise TypeError(
                f"{name} is {str(x.dtype).removeprefix('torch.')} but the module's weights "
                f"are {wanted}: they must share one dtype. Hint: convert the module, e.g. "
                f"module.to({x.dtype}), or the input with {name}.to({weights_dtype})."
            )
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must have the same batch and length (B, Lk): key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}. Hint: one value per key."
        )
    if key.shape[0] != query.shape[0]:
        raise ValueError(
            f"query and key must have the same batch size B: query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}."
        )
    if cache is not None:
        if not isinstance(cache, LayerCache):
            raise TypeError(
                f"cache must be a qkv.nn.KVCache, got {type(cache).__name__}. "
                "Hint: cache = qkv.nn.KVCache(), or qkv.nn.PagedKVCache(...) for many sequences."
            )
        if not self_attention:
            raise ValueError(
                "cache works with self-attention only (key=None): it appends the new "
                "tokens' keys and values. Hint: for cross-attention, compute the keys of "
                "the fixed sequence once and pass it as key= without a cache."
            )
        if extra_rows:
            raise ValueError(
                "cache cannot be combined with add_bias_kv or add_zero_attn (modules "
                "converted from torch.nn.MultiheadAttention). Hint: convert a module "
                "without them to decode with a cache."
            )


def positive(value: Any, name: str, hint: str) -> int:
    """``value`` if it is a positive integer, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}. Hint: {hint}.")
    return value


def divisors(n: int) -> list[int]:
    """The divisors of n, for hints."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_packed(
    cu_seqlens: Any,
    query: torch.Tensor,
    self_attention: bool,
    mask: Any,
    lengths: Any,
    cache: Any,
    is_causal: bool,
) -> tuple[Mask, torch.Tensor]:
    """The rule of packed sequences (each attends only to itself, causal within it when
    asked) and each token's position within its sequence, (T,) (for RoPE), after the checks.

    While torch.compile traces, nothing is read: the offsets' values are checked when the
    graph runs (``qkv::packed_offsets``) and the rule and positions are tensor operations.
    """
    from qkv.attention._packed import offsets, packed_rule

    for wrong, needed, hint in _packing_refusals(query, self_attention, mask, lengths, cache):
        if wrong:
            raise ValueError(f"cu_seqlens (packed sequences) takes {needed}. Hint: {hint}.")
    tokens = int(query.shape[1])
    right = 0 if is_causal else None
    if torch.compiler.is_compiling():
        from qkv.attention._packed_graph import Sequences, graph_rule, traced_offsets

        cu = traced_offsets(
            cu_seqlens, "cu_seqlens", tokens, "query", "MultiHeadAttention", query.device
        )
        sequences = Sequences.of(cu, tokens)
        return graph_rule(sequences, sequences, None, right, "top-left"), sequences.place(
            "top-left"
        )
    starts = offsets(
        cu_seqlens, "cu_seqlens", tokens, "query", "MultiHeadAttention", device=query.device
    )
    rule = packed_rule(starts, starts, None, right, "top-left")
    lengths_of = torch.tensor(starts).diff()
    first = torch.repeat_interleave(torch.tensor(starts[:-1]), lengths_of)  # (T,)
    positions = (torch.arange(tokens) - first).to(query.device)  # (T,)
    return rule, positions


def _packing_refusals(
    query: torch.Tensor, self_attention: bool, mask: Any, lengths: Any, cache: Any
) -> tuple[tuple[bool, str, str], ...]:
    """(refused, what packing takes instead, the hint that fits) for each option."""
    mask_got = (
        f"{mask.dtype} tensor of shape {tuple(mask.shape)}"
        if hasattr(mask, "shape")
        else type(mask).__name__
    )
    return (
        (
            not self_attention,
            "self-attention only (key=None: key and value are the packed query), got a key",
            "for cross-attention between packed sequences, project the heads and call "
            "qkv.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
            "max_seqlen_k), which takes separate offsets for queries and keys",
        ),
        (
            cache is not None,
            "no KV cache (a cache holds one sequence per batch row)",
            "train or prefill packed without cache=; to decode sequences of different "
            "lengths together, give each a batch row of its own in a qkv.nn.PagedKVCache",
        ),
        (
            lengths is not None,
            "no key_padding_lengths (packed sequences have no padding: cu_seqlens gives "
            "their lengths)",
            "drop key_padding_lengths and pack the real tokens only: a sequence of n "
            "tokens adds n to the running total in cu_seqlens",
        ),
        (
            mask is not None and not isinstance(mask, Mask),
            f"a mask only as a qkv.masks rule in packed positions, got a {mask_got}",
            "a rule such as masks.sliding_window(128) applies within every sequence; a "
            "(T, T) boolean tensor of your own becomes one with "
            "masks.from_function(lambda b, h, q, kv: allowed[q, kv])",
        ),
        (
            query.shape[0] != 1,
            f"a query of batch 1, (1, T, E), got {tuple(query.shape)}",
            "pack the sequences into one row, query (1, T, E), cu_seqlens = [0, len_1, "
            "len_1 + len_2, ...]",
        ),
    )
