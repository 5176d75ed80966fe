"""The edits: what to change in which head, checked once when they are written.

A head's *context* is its slice of the input to the output projection: the (Lq, D) rows
``A_h · V_h`` of query head ``h`` in layer ``layer`` (layers counted from 0 as
``qkv.tracing`` counts them, or named by module path). An edit changes that slice only:

    ablate     C_h ← 0, or C_h ← the head's mean context
    patch      C_h ← C_h of another run (what="context"), or A_h ← A_h of another run and
               C_h ← A_h · V_h with this run's values (what="weights")
    scale      C_h ← factor · C_h
    set_weights  one row: A_h[i] ← w, C_h[i] ← w · V_h
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from qkv._extras import require

__all__ = [
    "Ablate",
    "Edit",
    "HeadMeans",
    "Patch",
    "Recording",
    "Scale",
    "SetWeights",
    "ablate",
    "check_layer",
    "patch",
    "scale",
    "set_weights",
]

Layer = int | str


def check_layer(layer: object, where: str) -> Layer:
    """A layer as an edit names it: an integer (negative from the end) or a module path."""
    if isinstance(layer, bool) or not isinstance(layer, (int, str)) or layer == "":
        raise TypeError(
            f"{where}: layer must be an integer or a module path, got {layer!r}. Hint: "
            "layer=0 is the first attention layer (as qkv.tracing counts them), "
            "layer='model.layers.0.self_attn' names it."
        )
    return layer


def _head(head: object, where: str) -> int:
    if isinstance(head, bool) or not isinstance(head, int) or head < 0:
        raise TypeError(
            f"{where}: head must be a query head index (an integer from 0), got {head!r}. "
            "Hint: head=3 is the fourth query head of the layer."
        )
    return head


def _number(value: object, name: str, where: str, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{where}: {name} must be a finite number, got {value!r}. Hint: {hint}")
    return float(value)


def _tensor(value: object, name: str, where: str, hint: str) -> Any:
    """A floating tensor with finite entries (a NumPy array or a list is converted)."""
    torch = require("torch", feature="qkv.edits", extra="torch")
    tensor: Any = value
    if not isinstance(tensor, torch.Tensor):
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"{where}: {name} must be a tensor of numbers, got {type(value).__name__}. "
                f"Hint: {hint}"
            ) from None
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    if tensor.numel() == 0 or not bool(torch.isfinite(tensor).all()):
        raise ValueError(
            f"{where}: {name} must hold finite numbers, got shape {tuple(tensor.shape)} with "
            f"{'no entries' if tensor.numel() == 0 else 'NaN or infinity'}. Hint: {hint}"
        )
    return tensor.detach()


@dataclass(frozen=True)
class Recording:
    """The contexts (or weights) of some heads in one run: what :func:`patch` copies.

    Made by :func:`qkv.edits.record`. ``contexts[layer][head]`` is (B, P, D): the context of
    that head at each of the run's P positions; ``weights[layer][head]`` is (B, P, K): its
    attention weights (rows of a shorter call padded with zeros). ``layers`` are the
    module paths, by layer index; ``logits`` the run's output.
    """

    what: Literal["context", "weights"]
    layers: tuple[str, ...]
    contexts: dict[int, dict[int, Any]] = field(default_factory=dict)
    weights: dict[int, dict[int, Any]] = field(default_factory=dict)
    logits: Any = None

    def head(self, layer: int, head: int, what: str) -> Any:
        """The recorded (B, P, D) contexts or (B, P, K) weights of one head."""
        held = self.contexts if what == "context" else self.weights
        found = held.get(layer, {}).get(head)
        if found is None:
            kept = sorted((lay, h) for lay, heads in held.items() for h in heads)
            shown = ", ".join(f"({lay}, {h})" for lay, h in kept[:8]) or "none"
            raise ValueError(
                f"patch(layer={layer}, head={head}, what={what!r}): the recording holds no "
                f"{what} of that head (it holds (layer, head) {shown}"
                f"{', ...' if len(kept) > 8 else ''}). Hint: record(model, inputs, "
                f"what={what!r}) with that layer and head selected."
            )
        return found


@dataclass(frozen=True)
class HeadMeans:
    """The mean context of every head over a set of prompts (real tokens only).

    Made by :func:`qkv.edits.head_means`; ``means[layer]`` is (H, D). Pass it as
    ``ablate(layer, head, how="mean", mean=...)``.
    """

    layers: tuple[str, ...]
    means: dict[int, Any]
    tokens: int

    def of(self, layer: int, head: int) -> Any:
        """The (D,) mean context of one head."""
        found = self.means.get(layer)
        if found is None or not 0 <= head < int(found.shape[0]):
            raise ValueError(
                f"ablate(layer={layer}, head={head}, how='mean'): the head means hold no such "
                f"head ({len(self.means)} layers). Hint: head_means(model, inputs) of the same "
                "model."
            )
        return found[head]


@dataclass(frozen=True)
class Edit:
    """An edit of one query head of one layer (see the module docstring)."""

    layer: Layer
    head: int

    kind: ClassVar[str] = "edit"

    def describe(self) -> dict[str, Any]:
        """What a trace notes of this edit (JSON-able)."""
        return {"edit": self.kind, "head": self.head}


@dataclass(frozen=True)
class Ablate(Edit):
    kind: ClassVar[str] = "ablate"
    how: Literal["zero", "mean"] = "zero"
    mean: Any = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "how": self.how}


@dataclass(frozen=True)
class Patch(Edit):
    kind: ClassVar[str] = "patch"
    source: Recording | None = None
    what: Literal["context", "weights"] = "context"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "what": self.what}


@dataclass(frozen=True)
class Scale(Edit):
    kind: ClassVar[str] = "scale"
    factor: float = 1.0

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "factor": self.factor}


@dataclass(frozen=True)
class SetWeights(Edit):
    kind: ClassVar[str] = "set_weights"
    query: int = 0
    weights: Any = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "query": self.query}


def ablate(layer: Layer, head: int, how: str = "zero", mean: Any = None) -> Ablate:
    """Replace a head's context by zeros, or by its mean context.

    Args:
        layer: the attention layer (0-based, negative from the end) or its module path.
        head: the query head (0-based).
        how: ``"zero"`` or ``"mean"``.
        mean: with ``how="mean"``: a (D,) tensor, or the :class:`HeadMeans` of
            :func:`qkv.edits.head_means` (averaged over a set of prompts).

    Example:
        >>> ablate(0, 1)
        Ablate(layer=0, head=1, how='zero', mean=None)
    """
    where = f"ablate(layer={layer!r}, head={head!r})"
    layer, head = check_layer(layer, where), _head(head, where)
    if how not in ("zero", "mean"):
        raise ValueError(
            f"{where}: how must be 'zero' or 'mean', got {how!r}. Hint: how='mean' with "
            "mean=qkv.edits.head_means(model, inputs)."
        )
    if how == "zero" and mean is not None:
        raise ValueError(f"{where}: mean= is given but how='zero'. Hint: pass how='mean'.")
    if how == "mean":
        if mean is None:
            raise ValueError(
                f"{where}: how='mean' needs mean=..., got none. Hint: "
                "mean=qkv.edits.head_means(model, inputs), or a (D,) tensor."
            )
        if not isinstance(mean, HeadMeans):
            mean = _tensor(mean, "mean", where, "a (D,) tensor: the head's mean context")
            if mean.ndim != 1:
                raise ValueError(
                    f"{where}: mean must have shape (D,), got {tuple(mean.shape)}. Hint: "
                    "one mean context vector for the head."
                )
    return Ablate(layer, head, "zero" if how == "zero" else "mean", mean)


def patch(layer: Layer, head: int, source: Recording, what: str = "context") -> Patch:
    """Replace a head's context by the one recorded in another run (``what="context"``), or
    its attention weights (``what="weights"``: the context is recomputed from this run's
    values).

    Args:
        layer, head: as in :func:`ablate`.
        source: a :class:`Recording` of :func:`qkv.edits.record` holding that head.
        what: ``"context"`` or ``"weights"``.
    """
    where = f"patch(layer={layer!r}, head={head!r})"
    layer, head = check_layer(layer, where), _head(head, where)
    if what not in ("context", "weights"):
        raise ValueError(
            f"{where}: what must be 'context' or 'weights', got {what!r}. Hint: 'weights' "
            "patches the attention pattern only."
        )
    if not isinstance(source, Recording):
        raise TypeError(
            f"{where}: source must be a recording, got {type(source).__name__}. Hint: "
            "source = qkv.edits.record(model, inputs)."
        )
    if source.what != what:
        raise ValueError(
            f"{where}: what={what!r} but the source recorded {source.what}. Hint: "
            f"record(model, inputs, what={what!r})."
        )
    return Patch(layer, head, source, "context" if what == "context" else "weights")


def scale(layer: Layer, head: int, factor: float) -> Scale:
    """Multiply a head's context by ``factor``.

    Example:
        >>> scale(-1, 0, 2)
        Scale(layer=-1, head=0, factor=2.0)
    """
    where = f"scale(layer={layer!r}, head={head!r})"
    layer, head = check_layer(layer, where), _head(head, where)
    factor = _number(factor, "factor", where, "factor=0.5 halves the head's context")
    return Scale(layer, head, factor)


def set_weights(layer: Layer, head: int, query: int, weights: Any) -> SetWeights:
    """Replace one row of a head's attention pattern: "what if this token had attended
    there". The row's context becomes ``weights · V`` with this run's values.

    Args:
        layer, head: as in :func:`ablate`.
        query: the position of the query token (0-based; negative from the end of the
            sequence). In a call that holds only the last positions (decoding with a cache),
            the row of that position, if present.
        weights: (Lk,) or (B, Lk): the new row, one weight per key position.
    """
    where = f"set_weights(layer={layer!r}, head={head!r}, query={query!r})"
    layer, head = check_layer(layer, where), _head(head, where)
    if isinstance(query, bool) or not isinstance(query, int):
        raise TypeError(
            f"{where}: query must be a token position (an integer), got {query!r}. Hint: "
            "query=-1 is the last token."
        )
    row = _tensor(weights, "weights", where, "one weight per key, e.g. [0, 1, 0]")
    if row.ndim not in (1, 2):
        raise ValueError(
            f"{where}: weights must have shape (Lk,) or (B, Lk), got {tuple(row.shape)}. "
            "Hint: one weight per key position."
        )
    return SetWeights(layer, head, query, row)
