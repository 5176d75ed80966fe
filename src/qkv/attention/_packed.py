"""Packed sequences: the checks of their offsets and the mask rule of the packed tokens.

Sequences of different lengths packed one after another (FlashAttention's ``cu_seqlens``,
torch's nested jagged tensors) attend as one call over the packed tokens with the document
rule (a query sees only keys of its own sequence), so the tiled kernel skips every block
between two sequences; causality and a local window are measured within each sequence, from
its start (top-left) or its end (bottom-right, FlashAttention's choice when a sequence has
more keys than queries). Used by :func:`qkv.varlen_attention` and by
:func:`qkv.scaled_dot_product_attention` for jagged inputs.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from qkv._array import Array
from qkv.masks import Mask, document, from_function

__all__ = [
    "check_max",
    "check_offset_values",
    "check_offsets_tensor",
    "jagged_parts",
    "offsets",
    "packed_rule",
    "window",
]


def offsets(
    cu: Any,
    name: str,
    total: int,
    tokens: str,
    who: str = "varlen_attention",
    device: Any = None,
) -> list[int]:
    """The checked offsets of ``cu`` (read to the host once): a leading 0, never
    decreasing, ``total`` last; a tensor on ``device`` (query's) when one is given."""
    if hasattr(cu, "detach"):  # a tensor: where it lives is checked before it is read
        check_offsets_tensor(cu, name, who, device)
        cu = cu.detach().cpu()
    array = np.asarray(cu)
    if array.ndim != 1 or array.size < 2 or not np.issubdtype(array.dtype, np.integer):
        raise _not_offsets(name, who, f"{array.dtype} of shape {tuple(array.shape)}")
    values = [int(n) for n in array]
    check_offset_values(values, name, total, tokens, who)
    return values


def check_offsets_tensor(cu: Any, name: str, who: str, device: Any = None) -> None:
    """What can be checked of an offsets tensor without reading it (also while
    torch.compile traces): not on ``meta``, on ``device`` (query's, when given), integers of
    shape (B + 1,)."""
    if cu.device.type == "meta":
        raise ValueError(
            f"{who}: {name} is on the meta device, which holds no values to read the "
            f"sequences from. Hint: give real offsets, {name} = torch.tensor([0, 3, 8]) on "
            "the query's device."
        )
    if device is not None and cu.device != device:
        raise ValueError(
            f"{who}: {name} is on {cu.device} but the query on {device}; expected one "
            f"device. Hint: {name}.to(query.device)."
        )
    dtype = cu.dtype
    integer = not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")
    if cu.ndim != 1 or cu.shape[0] < 2 or not integer:
        raise _not_offsets(
            name, who, f"{str(dtype).removeprefix('torch.')} of shape {tuple(cu.shape)}"
        )


def _not_offsets(name: str, who: str, got: str) -> ValueError:
    return ValueError(
        f"{who}: {name} must be integers of shape (B + 1,), got {got}. Hint: "
        "torch.tensor([0, 3, 8], dtype=torch.int32) for sequences of 3 and 5 tokens."
    )


def check_offset_values(values: list[int], name: str, total: int, tokens: str, who: str) -> None:
    """The offsets' values: 0 first, never decreasing, ``total`` (the tokens of
    ``tokens``) last."""
    if values[0] != 0 or any(b < a for a, b in pairwise(values)):
        raise ValueError(
            f"{who}: {name} must start at 0 and never decrease, got {values[:8]}"
            f"{' ...' if len(values) > 8 else ''}. Hint: the running sum of the lengths, "
            "with a leading 0."
        )
    if values[-1] != total:
        raise ValueError(
            f"{who}: {name} ends at {values[-1]} but {tokens} has {total} "
            f"tokens. Hint: its last entry is the total length."
        )


def check_max(
    starts: list[int], given: Any, name: str, what: str, who: str = "varlen_attention"
) -> None:
    """``given`` (max_seqlen) is an integer ≥ the longest sequence of ``starts``."""
    longest = max(b - a for a, b in pairwise(starts))
    if isinstance(given, bool) or not isinstance(given, int) or given < longest:
        cu_name = name.replace("max_seqlen", "cu_seqlens")
        raise ValueError(
            f"{who}: {name} must be an integer ≥ the longest sequence's {what} "
            f"({longest}), got {given!r}. Hint: {name} = int({cu_name}.diff().max())."
        )


def window(window_size: Any, is_causal: bool) -> tuple[int | None, int | None]:
    """(left, right) limits, None for no limit; causal sets right to 0."""
    ok = isinstance(window_size, tuple | list) and len(window_size) == 2
    if not ok or any(isinstance(n, bool) or not isinstance(n, int) or n < -1 for n in window_size):
        raise ValueError(
            f"varlen_attention: window_size must be two integers (left, right), each ≥ 0 "
            f"or −1 for no limit, got {window_size!r}. Hint: (255, 0) with is_causal=True is "
            "a causal window of 256 keys."
        )
    left, right = (None if n < 0 else int(n) for n in window_size)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def packed_rule(
    starts_q: list[int],
    starts_k: list[int],
    left: int | None,
    right: int | None,
    alignment: str = "bottom-right",
) -> Mask:
    """The document rule of the packed sequences (offsets ``starts_q``, ``starts_k``), and,
    unless both limits are None, the window ``left`` keys before and ``right`` after each
    query, within its sequence (None: no limit on that side; causal is right = 0), counted
    from each sequence's start (top-left) or end (bottom-right); with its block hint."""
    lengths_q, lengths_k = np.diff(starts_q), np.diff(starts_k)
    ids_q = np.repeat(np.arange(len(lengths_q)), lengths_q)  # (total_q,)
    ids_k = np.repeat(np.arange(len(lengths_k)), lengths_k)  # (total_k,)
    rule = document(ids_q, ids_k)
    if left is None and right is None:
        return rule
    # each position's place in its sequence: from the start (0 … L − 1) or the end (−L … −1)
    edge = slice(1, None) if alignment == "bottom-right" else slice(None, -1)
    place_q = np.arange(len(ids_q)) - np.asarray(starts_q[edge])[ids_q]
    place_k = np.arange(len(ids_k)) - np.asarray(starts_k[edge])[ids_k]
    tables: dict[tuple[int, str], tuple[Array, Array]] = {}

    def within(b: Any, h: Any, q: Any, kv: Any) -> Any:
        key = (id(type(q)), str(getattr(q, "device", "cpu")))
        if key not in tables:
            if isinstance(q, np.ndarray):
                tables[key] = (place_q, place_k)
            else:
                import torch

                tables[key] = (
                    torch.as_tensor(place_q, device=q.device),
                    torch.as_tensor(place_k, device=q.device),
                )
        table_q, table_k = tables[key]
        offset_q, offset_k = table_q[q], table_k[kv]
        if left is None:
            return offset_k <= offset_q + right
        if right is None:
            return offset_k >= offset_q - left
        return (offset_k >= offset_q - left) & (offset_k <= offset_q + right)

    def blocks(b: Any, h: Any, q0: Any, q1: Any, k0: Any, k1: Any) -> tuple[Any, Any]:
        q_low = np.minimum.reduceat(place_q, q0.reshape(-1))[:, None]  # (nq, 1)
        q_high = np.maximum.reduceat(place_q, q0.reshape(-1))[:, None]
        k_low = np.minimum.reduceat(place_k, k0.reshape(-1))[None, :]  # (1, nk)
        k_high = np.maximum.reduceat(place_k, k0.reshape(-1))[None, :]
        some = np.ones((q_low.shape[0], k_low.shape[1]), dtype=bool)
        every = some.copy()
        if left is not None:
            some &= k_high >= q_low - left
            every &= k_low >= q_high - left
        if right is not None:
            some &= k_low <= q_high + right
            every &= k_high <= q_low + right
        return some[None, None], every[None, None]

    return rule & from_function(within, f"window within each sequence ({alignment})", blocks=blocks)


def jagged_parts(x: Any, name: str) -> tuple[Any, list[int]]:
    """A nested jagged tensor (B, H, j, D) (ragged along the sequence) as its packed values
    (total, H, D) and its offsets (B + 1)."""
    ragged = getattr(x, "_ragged_idx", None)
    if not getattr(x, "is_nested", False) or ragged != 2 or x.dim() != 4:
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(
            f"{name} must be a nested jagged tensor (B, H, j, D), ragged along the sequence "
            f"like query, got {shape}. Hint: torch.nested.nested_tensor(sequences, "
            "layout=torch.jagged).transpose(1, 2), each sequence (L, H, D)."
        )
    tokens = x.transpose(1, 2)  # (B, j, H, D), ragged along j
    values = tokens.values()  # (total, H, D)
    return values, [int(n) for n in tokens.offsets().tolist()]
