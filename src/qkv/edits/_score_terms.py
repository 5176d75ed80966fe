"""A head's scaled score of one query, split into the terms of its query and key coordinates.

:func:`score_terms` gives ``S'_j = Σ_d scale · q_d · k_jd`` for one head and one query on
every key j, with Q and K the call's own, after RoPE, as the kernel sees them (qkv's reference
recomputes that one row while the model runs on its fast path); :class:`ScoreTerms` holds the
terms, their sum and the score qkv's trace recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv._extras import require
from qkv.edits._model import layers_of, run_model
from qkv.trace import tracing

__all__ = ["ScoreTerms", "score_terms"]


@dataclass(frozen=True)
class ScoreTerms:
    """One head's scaled score of one query on every key, split into coordinate terms.

    Attributes:
        terms: (B, Lk, D) float64: ``scale · q_d · k_jd``, after RoPE; ``terms.sum(-1)``
            is :attr:`score`.
        score: (B, Lk) float64, the scaled score ``S' = q · k_j · scale`` the terms make
            (before any bias, softcap or mask): ``terms.sum(-1)``.
        traced: (B, Lk) the same scores as qkv's reference records them (step ``scaled``),
            in the model's dtype.
        layer: the attention layer's module path; ``head``: the query head; ``kv_head``
            its key/value head; ``query``: the query's position; ``scale``: the call's.
    """

    terms: Any
    score: Any
    traced: Any
    layer: str
    head: int
    kv_head: int
    query: int
    scale: float

    def pairs(self, layout: str = "half") -> Any:
        """(B, Lk, D/2): the terms of each rotary pair summed, one per RoPE frequency: the
        coordinates (i, i + D/2) for ``layout="half"`` (Hugging Face's ``rotate_half``,
        qkv's default), (2i, 2i + 1) for ``"interleaved"`` (GPT-J, Meta's original)."""
        width = int(self.terms.shape[-1])
        if layout not in ("half", "interleaved") or width % 2:
            raise ValueError(
                f"ScoreTerms.pairs(layout={layout!r}): layout must be 'half' or "
                f"'interleaved', on an even head size (got {width}). Hint: 'half' for "
                "Llama-style rotate_half."
            )
        if layout == "half":
            return self.terms[..., : width // 2] + self.terms[..., width // 2 :]
        return self.terms[..., 0::2] + self.terms[..., 1::2]


def score_terms(model: Any, inputs: Any, layer: int | str, head: int, query: int) -> ScoreTerms:
    """Split the scaled score of ``head``'s query at position ``query`` on every key into
    the terms of its coordinates: ``S'_j = Σ_d scale · q_d · k_jd``.

    Q and K are the call's own, after RoPE (qkv's reference recomputes that one row while
    the model runs on its fast path); the terms are float64, so ``terms.sum(-1)`` is the
    score exactly (up to float64 rounding). What comes after the scaled score (a position
    bias, a softcap, the mask) is not part of the terms: they split ``S'``, the step
    ``scaled``. With RoPE, :meth:`ScoreTerms.pairs` sums the two coordinates of each
    frequency.

    Args:
        model: a Hugging Face model or a model of ``qkv.nn`` modules.
        inputs: what the model takes; one forward over whole sequences.
        layer: the attention layer (0-based, negative from the end, or its module path).
        head: the query head.
        query: the query's position (negative from the end).

    Example:
        >>> import torch, qkv
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> split = score_terms(attn, torch.randn(1, 4, 8), 0, 1, -1)
        >>> split.terms.shape                                 # (B, Lk, D)
        torch.Size([1, 4, 4])
        >>> bool(torch.allclose(split.terms.sum(-1), split.score))
        True
    """
    where = f"score_terms(model, inputs, layer={layer!r}, head={head!r}, query={query!r})"
    torch = require("torch", feature="qkv.edits.score_terms", extra="torch")
    for name, value, what in (("head", head, "a query head index"), ("query", query, "a position")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{where}: {name} must be {what} (an integer, negative from the end), got "
                f"{value!r}. Hint: head=0, query=-1 (the last token)."
            )
    layers = layers_of(model, where)
    index = layers.index(layer, where)
    heads = layers.heads(index)
    if heads is not None and not -heads <= head < heads:
        raise ValueError(
            f"{where}: layer {layers.paths[index]!r} has {heads} query heads. Hint: choose a "
            f"head from 0 to {heads - 1} (or negative from the end)."
        )
    head = head % heads if heads is not None else head
    with (
        torch.no_grad(),
        tracing(
            model=model, layers=index, heads=head, queries=query, steps=["Q", "K", "scaled"]
        ) as trace,
    ):
        run_model(model, inputs)
    if not trace.calls:
        raise ValueError(f"{where}: the layer did not run. Hint: inputs the model reads.")
    call = trace.calls[0]
    head = int(((call["Q"].index or {}).get("head") or [head])[0])  # counted from 0
    q = torch.from_numpy(_step(call, "Q")).double()[:, 0, 0]  # (B, D)
    k = torch.from_numpy(_step(call, "K")).double()[:, 0]  # (B, Lk, D)
    traced = torch.from_numpy(_step(call, "scaled"))[:, 0, 0]  # (B, Lk)
    scale = float(call.meta["scale"])
    terms = q[:, None, :] * k * scale  # (B, Lk, D)
    kv_index = (call["K"].index or {}).get("kv_head")
    kv_head = int(kv_index[0]) if kv_index else head
    rows = call.meta.get("rows", {}).get("queries") or [query]
    return ScoreTerms(
        terms=terms,
        score=terms.sum(-1),
        traced=traced,
        layer=layers.paths[index],
        head=head,
        kv_head=kv_head,
        query=int(rows[0]),
        scale=scale,
    )


def _step(call: Any, name: str) -> Any:
    import numpy as np

    return np.ascontiguousarray(call[name].value)
