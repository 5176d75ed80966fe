"""Recording heads' contexts or weights in one run (the source of a patch), and their means
over a set of prompts (for mean ablation)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qkv._edit_point import Editor, EditSite, active_editor, editing
from qkv._extras import require
from qkv.edits._apply import positions_of
from qkv.edits._model import Layers, layers_of, logits_of, routed_model, run_model
from qkv.edits._specs import HeadMeans, Recording, check_layer

__all__ = ["head_means", "record"]


class _Recorder:
    """An editor that edits nothing: it keeps the chosen heads' contexts (or weights) of
    every call, by position (after the edits of an enclosing ``intervene`` block)."""

    def __init__(
        self, layers: Layers, chosen: dict[int, list[int] | None], what: str, outer: Editor | None
    ):
        self.layers, self.chosen, self.what, self.outer = layers, chosen, what, outer
        self._index = {id(m): i for i, m in enumerate(layers.modules)}
        # each call's part: (first position, first key, (B, Lq, D) or (B, Lq, Lk))
        self.parts: dict[int, dict[int, list[tuple[int, int, Any]]]] = {}
        self.sizes: dict[int, tuple[int, int]] = {}  # (query heads, D) of each layer seen

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        context, weights = (site.context, site.weights) if self.outer is None else self.outer(site)
        layer = self._index.get(id(site.module))
        if layer is not None:
            self.sizes[layer] = (int(context.shape[1]), int(context.shape[-1]))
        if layer is None or layer not in self.chosen:
            return context, weights
        total = int(context.shape[1])
        heads = self.chosen[layer] or list(range(total))
        if max(heads) >= total:
            raise ValueError(
                f"record(heads={heads}): layer {self.layers.paths[layer]!r} has {total} query "
                f"heads. Hint: choose heads from 0 to {total - 1}."
            )
        start = positions_of(site).start
        if self.what == "context":
            found = context[:, heads].detach().transpose(0, 1)  # (h, B, Lq, D)
        else:
            rows = list(range(int(site.query.shape[2])))
            found = site.weight_rows(heads, rows).to(context.dtype).transpose(0, 1)
        for h, part in zip(heads, found, strict=True):
            first_key = site.first_key if self.what == "weights" else 0
            kept = (start, first_key, part.clone())
            self.parts.setdefault(layer, {}).setdefault(h, []).append(kept)
        return context, weights

    def assembled(self) -> dict[int, dict[int, Any]]:
        """Each head's calls laid out by position: (B, P, D) or (B, P, K) (weights by key
        position), zeros elsewhere."""
        out: dict[int, dict[int, Any]] = {}
        for layer, heads in self.parts.items():
            for head, parts in heads.items():
                length = max(start + int(p.shape[1]) for start, _, p in parts)
                width = max(key + int(p.shape[2]) for _, key, p in parts)
                first = parts[0][2]
                whole = first.new_zeros((first.shape[0], length, width))
                for start, key, p in parts:
                    whole[:, start : start + p.shape[1], key : key + p.shape[2]] = p
                out.setdefault(layer, {})[head] = whole
        return out


def _chosen(layers: Layers, chosen: Any, heads: Any, where: str) -> dict[int, list[int] | None]:
    if chosen is None:
        indices = list(range(len(layers.paths)))
    else:
        items = chosen if isinstance(chosen, (list, tuple)) else [chosen]
        indices = [layers.index(check_layer(layer, where), where) for layer in items]
    if heads is not None:
        items = heads if isinstance(heads, (list, tuple)) else [heads]
        if not items or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in items):
            raise TypeError(
                f"{where}: heads must be query head indices (integers from 0), got {heads!r}. "
                "Hint: heads=[0, 3]; the default records every head."
            )
        heads = sorted(set(items))
    return dict.fromkeys(indices, heads)


def record(
    model: Any,
    inputs: Any,
    *,
    layers: Any = None,
    heads: Any = None,
    what: str = "context",
) -> Recording:
    """Run ``model`` on ``inputs`` and keep the contexts (or attention weights) of the chosen
    heads: the source of :func:`qkv.edits.patch`.

    The contexts are the fast kernel's own; ``what="weights"`` computes each chosen head's
    whole pattern exactly, on the reference (O(H · Lq · Lk) per layer: choose heads to keep
    it small). The run is under ``torch.no_grad()``; inside a ``qkv.intervene`` block the
    edits of the block apply and are recorded.

    Args:
        model: a Hugging Face model or a model of ``qkv.nn`` modules.
        inputs: what the model takes: a mapping (a tokenizer's output), a tuple of
            arguments or one tensor.
        layers: layer indices or module paths (default: every attention layer).
        heads: query heads (default: all).
        what: ``"context"`` or ``"weights"``.

    Returns:
        A :class:`~qkv.edits.Recording` (with the run's ``logits``).

    Example:
        >>> import torch, qkv
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> source = record(attn, torch.randn(1, 3, 8))
        >>> source.contexts[0][1].shape                        # (B, P, D)
        torch.Size([1, 3, 4])
    """
    where = "record(model, inputs)"
    torch = require("torch", feature="qkv.edits.record", extra="torch")
    if what not in ("context", "weights"):
        raise ValueError(
            f"{where}: what must be 'context' or 'weights', got {what!r}. Hint: 'weights' "
            "keeps the attention patterns, for patch(..., what='weights')."
        )
    found = layers_of(model, where)
    recorder = _Recorder(found, _chosen(found, layers, heads, where), what, active_editor())
    with torch.no_grad(), routed_model(model, found, where), editing(recorder):
        output = run_model(model, inputs)
    held = recorder.assembled()
    return Recording(
        what="context" if what == "context" else "weights",
        layers=found.paths,
        contexts=held if what == "context" else {},
        weights=held if what == "weights" else {},
        logits=logits_of(output),
        sizes=dict(recorder.sizes),
    )


def head_means(model: Any, inputs: Any) -> HeadMeans:
    """The mean context of every head of every layer over some prompts (real tokens only):
    what ``ablate(layer, head, how="mean", mean=...)`` puts in place of a head.

    Args:
        model: as in :func:`record`.
        inputs: one input (as in :func:`record`) or a list of them; with a mapping, its
            ``attention_mask`` says which tokens are real (padding is left out).

    Returns:
        A :class:`~qkv.edits.HeadMeans`: ``means[layer]`` is (H, D).

    Example:
        >>> import torch, qkv
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> head_means(attn, [torch.randn(2, 3, 8), torch.randn(1, 5, 8)]).means[0].shape
        torch.Size([2, 4])
    """
    runs = list(inputs) if isinstance(inputs, list) else [inputs]
    if not runs:
        raise ValueError("head_means(model, inputs): no inputs. Hint: a list of tokenized prompts.")
    sums: dict[int, Any] = {}
    tokens = 0
    paths: tuple[str, ...] = ()
    for one in runs:
        recording = record(model, one)
        paths = recording.layers
        real = _real_tokens(one)
        for layer, heads in recording.contexts.items():
            stacked = _stack(heads)  # (H, B, P, D)
            keep = (
                stacked.new_ones(stacked.shape[1:3])
                if real is None
                else real.to(stacked)[:, : stacked.shape[2]]
            )
            total = (stacked * keep[None, :, :, None]).sum(dim=(1, 2))  # (H, D)
            sums[layer] = total if layer not in sums else sums[layer] + total
        tokens += _count(real, recording)
    means = {layer: total / max(tokens, 1) for layer, total in sums.items()}
    return HeadMeans(layers=paths, means=means, tokens=tokens)


def _real_tokens(inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        mask = inputs.get("attention_mask")
        return None if mask is None else mask.bool()
    return None


def _stack(heads: dict[int, Any]) -> Any:
    torch = require("torch", feature="qkv.edits.head_means", extra="torch")
    return torch.stack([heads[h] for h in sorted(heads)])


def _count(real: Any, recording: Recording) -> int:
    if real is not None:
        return int(real.sum())
    first: Sequence[Any] = list(next(iter(recording.contexts.values())).values())
    return int(first[0].shape[0] * first[0].shape[1])
