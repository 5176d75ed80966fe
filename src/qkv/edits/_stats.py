"""What each head attends to, over many prompts: ``qkv.head_stats(model, texts)``.

Per layer and query head, averaged over every query row of every prompt:

    entropy     −Σ_j A_ij log A_ij (nats): 0 for a head that looks at one token
    sink        A_i0: the attention on the first token
    previous    A_i,i−1: the attention on the token before (rows i ≥ 1)
    diagonal    A_ii: the attention on the token itself
    induction   on random tokens repeated twice (x_0 … x_{T−1} x_0 … x_{T−1}): the attention
                of a token of the second copy on the token after its first occurrence,
                A_i,i−T+1 (Olsson et al., 2022, "In-context learning and induction heads")

The rows come from the reference, exactly, a block of query rows at a time while the model
runs on its fast path: O(H · rows · N) memory for a block, never the whole (N, N) pattern of
every head. Positions count the tokens as the model reads them (with a cache, the queries are
the last positions). A head with attention sinks (gpt-oss) gives part of each row to no token:
its rows sum to less than 1, and the statistics are of the tokens' share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qkv._edit_point import Editor, EditSite, active_editor, editing
from qkv._extras import require
from qkv._memory import available_memory
from qkv._read import size_text
from qkv.edits._apply import positions_of
from qkv.edits._model import Layers, layers_of, routed_model

__all__ = ["STATISTICS", "HeadStats", "head_stats"]

STATISTICS = ("entropy", "sink", "previous", "diagonal", "induction")
"""The statistics of :func:`head_stats`, in the order tables show them."""

ROW_BUDGET = 1 << 22
"""The most weights (B · H · rows · Lk) one block of rows holds."""


@dataclass(frozen=True)
class HeadStats:
    """The statistics of every head.

    Attributes:
        layers: the attention layers' module paths (the rows of each table).
        values: ``values[statistic][layer][head]`` (NaN where no row counted: a layer the
            prompts never reach, ``induction`` without a vocabulary).
        prompts: how many prompts were read; ``tokens``: how many query rows.
    """

    layers: tuple[str, ...]
    values: dict[str, list[list[float]]]
    prompts: int
    tokens: int


@dataclass
class _Sums:
    """Running sums of one layer: per statistic, per head, and the rows counted."""

    total: dict[str, list[float]] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, per_head: list[float], rows: int) -> None:
        if name not in self.total:
            self.total[name], self.count[name] = [0.0] * len(per_head), 0
        self.total[name] = [a + b for a, b in zip(self.total[name], per_head, strict=True)]
        self.count[name] += rows


class _Collector:
    """An editor that edits nothing: it reads each call's weight rows, a block at a time."""

    def __init__(self, layers: Layers, outer: Editor | None) -> None:
        self.layers, self.outer = layers, outer
        self._index = {id(m): i for i, m in enumerate(layers.modules)}
        self.sums = [_Sums() for _ in layers.paths]
        self.heads = [0] * len(layers.paths)
        self.repeat: int | None = None  # T while reading the repeated random tokens

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        context, weights = (site.context, site.weights) if self.outer is None else self.outer(site)
        layer = self._index.get(id(site.module))
        if layer is not None:
            self._read(layer, site)
        return context, weights

    def _read(self, layer: int, site: EditSite) -> None:
        torch = require("torch", feature="qkv.head_stats", extra="torch")
        batch, heads, q_len = (int(n) for n in site.query.shape[:3])
        keys = int(site.key.shape[2])
        self.heads[layer] = heads
        first = positions_of(site).start
        block = max(1, ROW_BUDGET // max(batch * heads * keys, 1))
        sums = self.sums[layer]
        for start in range(0, q_len, block):
            rows = list(range(start, min(start + block, q_len)))
            w = site.weight_rows(list(range(heads)), rows).double()  # (B, H, r, Lk)
            positions = torch.tensor([first + r for r in rows], device=w.device)
            if self.repeat is not None:
                self._induction(sums, w, positions, batch)
                continue
            logs = torch.where(w > 0, w.clamp_min(1e-300).log(), torch.zeros_like(w))
            sums.add("entropy", (-(w * logs).sum(-1)).sum((0, 2)).tolist(), batch * len(rows))
            sums.add("sink", w[..., 0].sum((0, 2)).tolist(), batch * len(rows))
            inside = positions < keys
            diagonal = _at(w, positions.clamp_max(keys - 1)) * inside
            sums.add("diagonal", diagonal.sum((0, 2)).tolist(), batch * int(inside.sum()))
            after = (positions >= 1) & (positions - 1 < keys)
            previous = _at(w, (positions - 1).clamp(0, keys - 1)) * after
            sums.add("previous", previous.sum((0, 2)).tolist(), batch * int(after.sum()))

    def _induction(self, sums: _Sums, w: Any, positions: Any, batch: int) -> None:
        assert self.repeat is not None
        keys = int(w.shape[-1])
        target = positions - self.repeat + 1
        second = (positions >= self.repeat) & (target < keys)
        found = _at(w, target.clamp(0, keys - 1)) * second
        sums.add("induction", found.sum((0, 2)).tolist(), batch * int(second.sum()))

    def table(self, name: str) -> list[list[float]]:
        out = []
        for sums, heads in zip(self.sums, self.heads, strict=True):
            count = sums.count.get(name, 0)
            total = sums.total.get(name)
            if not count or total is None:
                out.append([math.nan] * heads)
            else:
                out.append([value / count for value in total])
        return out


def _at(w: Any, keys: Any) -> Any:
    """(B, H, r): each row's weight on its own key ``keys[r]``."""
    index = keys.view(1, 1, -1, 1).expand(*w.shape[:3], 1)
    return w.gather(-1, index).squeeze(-1)


def _token_ids(texts: Sequence[Any], tokenizer: Any, where: str) -> list[Any]:
    torch = require("torch", feature="qkv.head_stats", extra="torch")
    out = []
    for number, text in enumerate(texts):
        if isinstance(text, str):
            if tokenizer is None:
                raise TypeError(
                    f"{where}: text {number} is a string but no tokenizer was given. Hint: "
                    "head_stats(model, texts, tokenizer=tokenizer), or token ids."
                )
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
        else:
            ids = torch.as_tensor(text)
        ids = ids.reshape(1, -1) if ids.ndim <= 1 else ids
        if ids.ndim != 2 or ids.shape[1] == 0 or ids.dtype.is_floating_point:
            raise ValueError(
                f"{where}: prompt {number} must be a text or token ids (N,) or (B, N), got "
                f"shape {tuple(ids.shape)} of {ids.dtype}. Hint: one prompt a line."
            )
        out.append(ids)
    if not out:
        raise ValueError(f"{where}: no prompt. Hint: a list of texts, one prompt each.")
    return out


def _whole(value: object, name: str, low: int, where: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TypeError(
            f"{where}: {name} must be an integer from {low}, got {value!r}. Hint: {hint}."
        )
    return value


def _config_size(model: Any, names: tuple[str, ...]) -> int | None:
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _token_bytes(model: Any, layers: Layers, vocab: int | None) -> int:
    """The memory one token of a run takes at most, estimated from the model's sizes: its
    id, a few (E,) activations, the MLP's (I,) and the logits' (V,), in the model's dtype.
    (Attention adds at most :data:`ROW_BUDGET` float64 weights a block, counted apart.)"""
    torch = require("torch", feature="qkv.head_stats", extra="torch")
    width = _config_size(model, ("hidden_size", "n_embd", "d_model"))
    width = width or getattr(layers.modules[0], "embed_dim", None) or 1
    inner = _config_size(model, ("intermediate_size", "n_inner", "d_ff")) or 4 * width
    first = next(iter(model.parameters()), None)
    size = int(first.element_size()) if first is not None else torch.finfo().bits // 8
    return int(8 + size * (4 * width + inner + (vocab or 0)))


def _check_sizes(
    model: Any, layers: Layers, runs: list[tuple[str, int, int]], vocab: int | None, where: str
) -> None:
    """Refuse, before anything is allocated, a run (``what``, batch, length) longer than the
    model's positions or larger than the memory this process may still take."""
    limit = _config_size(model, ("n_positions", "max_position_embeddings"))
    free = available_memory()
    per_token = _token_bytes(model, layers, vocab)
    for what, batch, length in runs:
        if limit is not None and length > limit:
            shorter = (
                f"induction_length at most {limit // 2:,}"
                if what.startswith("induction")
                else "a shorter prompt, or several"
            )
            raise ValueError(
                f"{where}: {what} makes sequences of {length:,} tokens, more than the "
                f"{limit:,} positions the model reads (its config). Hint: at most "
                f"{limit:,} tokens ({shorter})."
            )
        needed = batch * length * per_token + 8 * ROW_BUDGET
        if free is not None and needed > free:
            raise ValueError(
                f"{where}: {what} makes {batch:,} × {length:,} tokens, about "
                f"{size_text(needed)} for the run, more than the {size_text(free)} this "
                "process may still take. Hint: fewer or shorter sequences (induction_length="
                "20, induction_prompts=4 by default)."
            )


def _runner(model: Any) -> Any:
    """What reads the tokens: the encoder of an encoder–decoder model, else the model."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return model.get_encoder()
    return model


def head_stats(
    model: Any,
    texts: Sequence[Any],
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    induction_length: int = 20,
    induction_prompts: int = 4,
    seed: int = 0,
) -> HeadStats:
    """Entropy, sink mass, previous-token, diagonal and induction scores of every head.

    Args:
        model: a Hugging Face model of a family qkv traces, or a model of ``qkv.nn`` modules
            that takes token ids.
        texts: the prompts: strings (with ``tokenizer``) or token ids, (N,) or (B, N). Each
            runs on its own, so prompts of any length mix without padding.
        tokenizer: turns a string into ids (a Hugging Face tokenizer).
        vocab_size: the vocabulary of the random tokens of the induction score (default: the
            model's ``config.vocab_size``; without either, induction is NaN).
        induction_length: T, the random tokens repeated twice (from 2).
        induction_prompts: how many such sequences; ``seed`` draws them.

    Raises:
        ValueError: before anything is allocated, a prompt or the induction sequences
            (2T tokens) longer than the model's positions (``n_positions``,
            ``max_position_embeddings``), or needing more memory than this process may
            still take (estimated from the model's sizes: ids, activations, logits).

    Returns:
        A :class:`HeadStats`.

    Example:
        >>> import torch, qkv
        >>> from torch import nn
        >>> class Tiny(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed, self.attn = nn.Embedding(10, 8), qkv.nn.MultiHeadAttention(8, 2)
        ...     def forward(self, ids):
        ...         return self.attn(self.embed(ids), is_causal=True)
        >>> stats = qkv.head_stats(Tiny(), [torch.tensor([1, 2, 3])], vocab_size=10)
        >>> [round(v, 4) for v in stats.values["sink"][0]][0] > 0.33
        True
    """
    where = "head_stats(model, texts)"
    torch = require("torch", feature="qkv.head_stats", extra="torch")
    length = _whole(induction_length, "induction_length", 2, where, "induction_length=20")
    repeats = _whole(induction_prompts, "induction_prompts", 1, where, "induction_prompts=4")
    if vocab_size is not None:
        _whole(vocab_size, "vocab_size", 1, where, "the model's config.vocab_size")
    prompts = _token_ids(list(texts), tokenizer, where)
    layers = layers_of(model, where)
    vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    runs = [(f"prompt {i}", int(ids.shape[0]), int(ids.shape[1])) for i, ids in enumerate(prompts)]
    if isinstance(vocab, int) and vocab > 0:
        runs.append((f"induction_length={length}", repeats, 2 * length))
    _check_sizes(model, layers, runs, vocab if isinstance(vocab, int) else None, where)
    collector = _Collector(layers, active_editor())
    runner = _runner(model)
    tokens = 0
    with torch.no_grad(), routed_model(model, layers, where), editing(collector):
        for ids in prompts:
            runner(ids)
            tokens += int(ids.numel())
        if isinstance(vocab, int) and vocab > 0:
            generator = torch.Generator().manual_seed(seed)
            half = torch.randint(0, vocab, (repeats, length), generator=generator)
            collector.repeat = length
            runner(torch.cat((half, half), dim=1))
    values = {name: collector.table(name) for name in STATISTICS}
    return HeadStats(layers.paths, values, len(prompts), tokens)
