"""Packed sequences under ``torch.compile``: their offsets as tensors, nothing read.

Shape legend: T packed tokens, S sequences (S + 1 offsets).

Eagerly, ``cu_seqlens`` is read to the host once (:func:`qkv.attention._packed.offsets`) and
the packed tokens get the document rule with its block hints. While dynamo traces, no value
may be read: the offsets' shape, dtype and device are checked then, their values when the
graph runs, by the operator ``qkv::packed_offsets`` (the same one-line errors as eager), and
each token's sequence and place in it are tensor operations on the offsets
(``searchsorted``), from which the rule is evaluated in the graph as a boolean tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qkv.attention._packed import check_max, check_offset_values, check_offsets_tensor
from qkv.masks import Mask

__all__ = ["Sequences", "graph_rule", "traced_offsets"]


def traced_offsets(
    cu: Any,
    name: str,
    total: int,
    tokens: str,
    who: str,
    device: torch.device,
    longest: tuple[str, Any, str] | None = None,
) -> torch.Tensor:
    """``cu`` (S + 1,) as int64 on ``device``: its shape, dtype and device checked now, its
    values (0 first, never decreasing, ``total`` last; with ``longest = (max name, given
    max, what)``, no sequence longer than the given max) when the graph runs.

    Example:
        >>> cu = traced_offsets([0, 3, 8], "cu_seqlens", 8, "query", "demo", torch.device("cpu"))
        >>> cu.tolist()
        [0, 3, 8]
    """
    if not isinstance(cu, torch.Tensor):  # numbers given in the code: a constant of the graph
        cu = torch.as_tensor(cu, device=device)
    check_offsets_tensor(cu, name, who, device)
    max_name, given, what = longest if longest is not None else ("", 0, "")
    if longest is not None and (
        isinstance(given, bool) or not isinstance(given, int | torch.SymInt)
    ):
        raise ValueError(
            f"{who}: {max_name} must be an integer ≥ the longest sequence's {what}, got "
            f"{given!r}. Hint: {max_name} = int({name}.diff().max())."
        )
    result: torch.Tensor = torch.ops.qkv.packed_offsets(
        cu, total, given, "|".join((name, tokens, who, max_name, what))
    )
    return result


@torch.library.custom_op("qkv::packed_offsets", mutates_args=())
def _packed_offsets(cu: torch.Tensor, total: int, longest: int, words: str) -> torch.Tensor:
    """The offsets as int64, after the checks of their values (what the compiled graph runs:
    the checks read them). ``words``: the offsets' name, the tokens' name, the caller, and
    (or two empty strings) the name of the max and what it counts, joined by "|"."""
    name, tokens, who, max_name, what = words.split("|")
    values = [int(n) for n in cu.tolist()]
    check_offset_values(values, name, total, tokens, who)
    if max_name:
        check_max(values, longest, max_name, what, who)
    return cu.to(torch.int64, copy=True)


@_packed_offsets.register_fake
def _packed_offsets_fake(cu: torch.Tensor, total: int, longest: int, words: str) -> torch.Tensor:
    return torch.empty_like(cu, dtype=torch.int64)


@dataclass(frozen=True)
class Sequences:
    """Where each of T packed tokens sits, from offsets (S + 1,) int64.

    Attributes:
        ids: (T,) the sequence of each token.
        first: (T,) the first token of that sequence.
        end: (T,) one past its last token.
        lengths: (S,) the tokens of each sequence.
    """

    ids: torch.Tensor
    first: torch.Tensor
    end: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, cu: torch.Tensor, total: int) -> Sequences:
        """The tables of ``total`` tokens packed at offsets ``cu`` (checked ones).

        Example:
            >>> Sequences.of(torch.tensor([0, 2, 2, 5]), 5).ids.tolist()
            [0, 0, 2, 2, 2]
        """
        tokens = torch.arange(total, device=cu.device, dtype=cu.dtype)
        ids = torch.searchsorted(cu[1:].contiguous(), tokens, right=True)  # (T,)
        return cls(ids=ids, first=cu[ids], end=cu[ids + 1], lengths=cu.diff())

    def place(self, alignment: str) -> torch.Tensor:
        """(T,) each token's place in its sequence: 0 … L − 1 from its start (top-left), or
        −L … −1 from its end (bottom-right)."""
        tokens = torch.arange(self.ids.shape[0], device=self.ids.device)
        return tokens - (self.end if alignment == "bottom-right" else self.first)


def graph_rule(
    queries: Sequences,
    keys: Sequences,
    left: int | None,
    right: int | None,
    alignment: str = "bottom-right",
) -> Mask:
    """The rule of :func:`qkv.attention._packed.packed_rule` from tensors: a query sees
    the keys of its own sequence, within ``left`` keys before and ``right`` after it (None:
    no limit) counted from each sequence's start or end (``alignment``).

    Example:
        >>> cu = torch.tensor([0, 1, 3])
        >>> rule = graph_rule(Sequences.of(cu, 3), Sequences.of(cu, 3), None, 0, "top-left")
        >>> rule.dense(3, 3)[0, 0].astype(int).tolist()
        [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    """
    place_q, place_k = queries.place(alignment), keys.place(alignment)
    tensors = (queries.ids, keys.ids, place_q, place_k)

    def rule(b: Any, h: Any, q: Any, kv: Any, lq: int, lk: int, xp: Any) -> Any:
        ids_q, ids_k, at_q, at_k = (
            tuple(t.cpu().numpy() for t in tensors) if isinstance(q, np.ndarray) else tensors
        )
        allowed = ids_q[q] == ids_k[kv]
        if left is not None:
            allowed = allowed & (at_k[kv] >= at_q[q] - left)
        if right is not None:
            allowed = allowed & (at_k[kv] <= at_q[q] + right)
        return allowed

    window = "" if left is None and right is None else f", window ({left}, {right})"
    return Mask(rule, f"packed sequences ({alignment}{window})")
