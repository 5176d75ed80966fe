"""The edits: what to change in which head, checked once when they are written.

A head's *context* is its slice of the input to the output projection: the (Lq, D) rows
``A_h · V_h`` of query head ``h`` in layer ``layer`` (layers counted from 0 as
``qkv.tracing`` counts them, or named by module path). An edit changes that slice only:

    ablate     C_h ← 0, or C_h ← the head's mean context
    patch      C_h ← C_h of another run (what="context"), or A_h ← A_h of another run and
               C_h ← A_h · V_h with this run's values (what="weights")
    scale      C_h ← factor · C_h
    set_weights  one row: A_h[i] ← w, C_h[i] ← w · V_h

Each kind is one class of :data:`EDITS` (its ``kind``, the name of the function that makes
it) and applies itself (:meth:`Edit.apply`); the tests and the docs' lists of edits come
from that registry.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from qkv._extras import require

__all__ = [
    "EDITS",
    "Ablate",
    "Edit",
    "HeadMeans",
    "Patch",
    "Recording",
    "Rows",
    "Scale",
    "SetWeights",
    "Target",
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
    if isinstance(head, bool) or not isinstance(head, int):
        raise TypeError(
            f"{where}: head must be a query head index (an integer, negative from the end), "
            f"got {head!r}. Hint: head=3 is the fourth query head of the layer, head=-1 the last."
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
    module paths, by layer index; ``logits`` the run's output; ``sizes[layer]`` the
    (query heads, head size D) of each layer of the model it was recorded on, which a
    patch compares with the model it is applied to (empty: not checked).
    """

    what: Literal["context", "weights"]
    layers: tuple[str, ...]
    contexts: dict[int, dict[int, Any]] = field(default_factory=dict)
    weights: dict[int, dict[int, Any]] = field(default_factory=dict)
    logits: Any = None
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)

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
                f"{', ...' if len(kept) > 8 else ''}; recorded on a model of "
                f"{len(self.layers)} attention layers). Hint: record(model, inputs, "
                f"what={what!r}) with that layer and head selected."
            )
        return found

    def check_model(self, layer: int, head: int, layers: int, where: str) -> None:
        """Refuse, in one line, a recording of a model with another number of attention
        layers than the model's ``layers``, or whose numbers for ``layer``'s ``head`` are
        not all finite."""
        _same_layers("the recording has", len(self.layers), layers, where, _RECORD_HINT)
        _finite("the recording holds", self.head(layer, head, self.what), where, "record")

    def check_call(self, layer: int, heads: int, width: int, where: str) -> None:
        """Refuse a recording whose ``layer`` had other (query heads, head size) than the
        call it patches (``heads``, ``width``)."""
        _same_sizes("the recording has", self.sizes.get(layer), heads, width, where, _RECORD_HINT)


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
            held = "no such layer" if found is None else f"{int(found.shape[0])} heads there"
            raise ValueError(
                f"ablate(layer={layer}, head={head}, how='mean'): the head means hold no such "
                f"head ({len(self.means)} layers, {held}). Hint: {_MEANS_HINT}."
            )
        return found[head]

    def check_model(self, layer: int, head: int, layers: int, where: str) -> None:
        """Refuse, in one line, means of a model with another number of attention layers
        than the model's ``layers``, or whose mean of ``layer``'s ``head`` is not finite."""
        _same_layers("the head means have", len(self.layers), layers, where, _MEANS_HINT)
        _finite("the head means hold", self.of(layer, head), where, "compute them")

    def check_call(self, layer: int, heads: int, width: int, where: str) -> None:
        """Refuse means whose ``layer`` had other (query heads, head size) than the call
        (``heads``, ``width``)."""
        found = self.means.get(layer)
        sizes = None if found is None else (int(found.shape[0]), int(found.shape[-1]))
        _same_sizes("the head means have", sizes, heads, width, where, _MEANS_HINT)


_RECORD_HINT = "record on the same model: qkv.edits.record(model, inputs)"
_MEANS_HINT = "head_means(model, inputs) of the same model"


def _same_layers(source: str, held: int, model: int, where: str, hint: str) -> None:
    """``source``: its subject and verb ("the recording has")."""
    if held != model:
        raise ValueError(
            f"{where}: {source} {held} attention layers, the model {model}. Hint: {hint}."
        )


def _same_sizes(
    source: str, sizes: tuple[int, int] | None, heads: int, width: int, where: str, hint: str
) -> None:
    """(query heads, head size) of the source's layer against the call's."""
    if sizes is None:
        return
    if sizes[0] != heads:
        raise ValueError(
            f"{where}: {source} {sizes[0]} heads per layer, the model {heads}. Hint: {hint}."
        )
    if sizes[1] != width:
        raise ValueError(
            f"{where}: {source} heads of size {sizes[1]}, the model's are of size {width}. "
            f"Hint: {hint}."
        )


def _finite(source: str, values: Any, where: str, again: str) -> None:
    """Refuse NaN or infinity in what an edit copies (one look at the whole tensor)."""
    torch = require("torch", feature="qkv.intervene", extra="torch")
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise ValueError(
            f"{where}: {source} NaN or infinity for this head ({bad} of {values.numel()} "
            f"numbers). Hint: {again} again on inputs and in a dtype where the model's run "
            "is finite (NaN in its logits too means the run overflowed or read NaN)."
        )


@dataclass(frozen=True)
class Target:
    """What an edit writes into at one attention call.

    ``context``: the call's (B, H, Lq, D) contexts, a copy the edit writes its head's slice
    of; ``value``: the edited head's (B, Lk, Dv) values (its key/value head under GQA);
    ``positions``: the sequence positions of the call's query rows; ``first_key``: the
    position of its first key (past the tokens a windowed cache let go); ``layer``: the
    layer's index; ``where``: how the edit is named in an error.
    """

    context: Any
    value: Any
    positions: range
    first_key: int
    layer: int
    where: str


@dataclass
class Rows:
    """The weight rows an edit wrote: head, row indices in the call, (B, rows, Lk) values."""

    head: int
    rows: list[int]
    values: Any


EDITS: dict[str, type[Edit]] = {}
"""The kinds of edit, by ``kind`` (the name of the function that makes one): a class that
subclasses :class:`Edit` registers itself here."""


@dataclass(frozen=True)
class Edit(ABC):
    """An edit of one query head of one layer (see the module docstring).

    A kind of edit is a subclass with its ``kind``, its fields, and :meth:`apply`; it joins
    :data:`EDITS` by being defined.
    """

    layer: Layer
    head: int

    kind: ClassVar[str] = "edit"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        EDITS[cls.kind] = cls

    def describe(self) -> dict[str, Any]:
        """What a trace notes of this edit (JSON-able)."""
        return {"edit": self.kind, "head": self.head}

    def check_sources(self, layer: int) -> None:
        """Check, before any forward, that what the edit reads holds layer ``layer``'s
        head (a recording, head means); raises ValueError."""
        return None  # an edit that reads nothing else has nothing to check

    def check_model(self, layer: int, layers: int) -> None:
        """Check, before any forward, that what the edit reads comes from a model of
        ``layers`` attention layers and holds finite numbers for layer ``layer``'s head;
        raises ValueError in one line. (Heads and head size are checked at each call,
        where the model's own are known.)"""
        return None

    @abstractmethod
    def apply(self, at: Target) -> Rows | bool | None:
        """Write this edit into ``at.context`` (its head's slice only). Returns the weight
        rows it set, True for a context edit, None when it does not touch this call."""


@dataclass(frozen=True)
class Ablate(Edit):
    kind: ClassVar[str] = "ablate"
    how: Literal["zero", "mean"] = "zero"
    mean: Any = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "how": self.how}

    def check_sources(self, layer: int) -> None:
        if isinstance(self.mean, HeadMeans):
            self.mean.of(layer, self.head)

    def check_model(self, layer: int, layers: int) -> None:
        if isinstance(self.mean, HeadMeans):
            where = f"ablate(layer={self.layer!r}, head={self.head}, how='mean')"
            self.mean.check_model(layer, self.head, layers, where)

    def apply(self, at: Target) -> bool:
        context, h = at.context, self.head
        if self.how == "zero":
            context[:, h] = 0
            return True
        if isinstance(self.mean, HeadMeans):
            self.mean.check_call(at.layer, int(context.shape[1]), int(context.shape[-1]), at.where)
        mean = self.mean.of(at.layer, h) if isinstance(self.mean, HeadMeans) else self.mean
        if mean.shape[-1] != context.shape[-1]:
            raise ValueError(
                f"{at.where}: mean has {mean.shape[-1]} features, the head has "
                f"{context.shape[-1]}. Hint: the head means of the same model."
            )
        context[:, h] = mean.to(device=context.device, dtype=context.dtype)
        return True


@dataclass(frozen=True)
class Patch(Edit):
    kind: ClassVar[str] = "patch"
    source: Recording | None = None
    what: Literal["context", "weights"] = "context"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "what": self.what}

    def _source(self) -> Recording:
        if self.source is None:
            raise ValueError(
                f"patch(layer={self.layer!r}, head={self.head}): no source recording. Hint: "
                "make the edit with qkv.edits.patch(layer, head, source)."
            )
        return self.source

    def check_sources(self, layer: int) -> None:
        self._source().head(layer, self.head, self.what)

    def check_model(self, layer: int, layers: int) -> None:
        where = f"patch(layer={self.layer!r}, head={self.head})"
        self._source().check_model(layer, self.head, layers, where)

    def apply(self, at: Target) -> Rows | bool:
        context, value, h = at.context, at.value, self.head
        recording = self._source()
        recording.check_call(at.layer, int(context.shape[1]), int(value.shape[-1]), at.where)
        source = recording.head(at.layer, h, self.what)
        source = _rows_of(source, at.positions, context.shape[0], at.where)
        if self.what == "context":
            context[:, h] = source.to(device=context.device, dtype=context.dtype)
            return True
        pattern = _keys(source, at.first_key, int(value.shape[1]))
        pattern = pattern.to(device=value.device, dtype=value.dtype)
        context[:, h] = (pattern @ value).to(context.dtype)  # (B, Lq, Lk)·(B, Lk, Dv)
        return Rows(h, list(range(len(at.positions))), pattern)


@dataclass(frozen=True)
class Scale(Edit):
    kind: ClassVar[str] = "scale"
    factor: float = 1.0

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "factor": self.factor}

    def apply(self, at: Target) -> bool:
        at.context[:, self.head] = at.context[:, self.head] * self.factor
        return True


@dataclass(frozen=True)
class SetWeights(Edit):
    kind: ClassVar[str] = "set_weights"
    query: int = 0
    weights: Any = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "query": self.query}

    def apply(self, at: Target) -> Rows | None:
        context, value, positions, first_key = at.context, at.value, at.positions, at.first_key
        end = positions.stop
        position = self.query if self.query >= 0 else end + self.query
        if position < 0:
            raise ValueError(
                f"{at.where}: query {self.query} is before the sequence of {end} tokens. "
                f"Hint: choose a position from 0 to {end - 1}, or from -{end}."
            )
        if position not in positions:
            return None
        row = position - positions.start
        w = self.weights
        keys, span = int(value.shape[1]), first_key + int(value.shape[1])
        if w.shape[-1] != span or (w.ndim == 2 and w.shape[0] not in (1, context.shape[0])):
            raise ValueError(
                f"{at.where}: weights of shape {tuple(w.shape)} for a row of {span} keys and "
                f"a batch of {context.shape[0]}. Hint: pass ({span},) or "
                f"({context.shape[0]}, {span})."
            )
        if first_key and bool(w[..., :first_key].any()):
            raise ValueError(
                f"{at.where}: weights on keys 0 to {first_key - 1}, which the cache's window "
                f"has let go before query {position}. Hint: weights only on keys {first_key} "
                f"to {span - 1}, or a cache with a longer max_length."
            )
        w = w[..., first_key:].to(device=value.device, dtype=value.dtype)
        w = w.reshape(-1, 1, keys).expand(context.shape[0], 1, keys)  # (B, 1, Lk)
        context[:, self.head, row] = (w @ value)[:, 0].to(context.dtype)
        return Rows(self.head, [row], w)


def _rows_of(source: Any, positions: range, batch: int, where: str) -> Any:
    """The recorded rows (B, Lq, ·) of this call's positions."""
    held, size = int(source.shape[1]), int(source.shape[0])
    if positions.stop > held:
        raise ValueError(
            f"{where}: the call reaches position {positions.stop - 1} but the recording holds "
            f"{held} positions. Hint: record the source on inputs as long as this run's."
        )
    if size not in (1, batch):
        raise ValueError(
            f"{where}: the recording has a batch of {size}, this run {batch}. Hint: record "
            "the source with the same batch size (or one prompt)."
        )
    return source[:, positions.start : positions.stop].expand(batch, -1, -1)


def _keys(pattern: Any, first: int, keys: int) -> Any:
    """The columns of recorded weight rows (one per key position) of this call's ``keys``
    from position ``first`` on, padded with zeros past the recording (a causal row gives no
    weight to later keys)."""
    cut = pattern[..., first : first + keys]
    held = int(cut.shape[-1])
    if held == keys:
        return cut
    pad = pattern.new_zeros((*pattern.shape[:-1], keys - held))
    torch = require("torch", feature="qkv.intervene", extra="torch")
    return torch.cat((cut, pad), dim=-1)


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

    The row is an attention row, as softmax makes one: its weights must be ≥ 0 and sum to
    1 (to within rounding: Lk · ε of its dtype), and a row that does not is refused in one
    line, since ``[1, 1, 1]`` meant as "attend evenly" would triple the context. The row is
    the whole pattern of that query: in a head with attention sinks, nothing goes to the
    sink. To weaken a head's context instead, use :func:`scale`.

    Args:
        layer, head: as in :func:`ablate`.
        query: the position of the query token (0-based; negative from the end of the
            sequence). In a call that holds only the last positions (decoding with a cache),
            the row of that position, if present.
        weights: (Lk,) or (B, Lk): the new row, one weight per key position (each row ≥ 0,
            summing to 1).

    Example:
        >>> set_weights(0, 1, -1, [0.25, 0.75]).query
        -1
        >>> set_weights(0, 1, -1, [1.0, 1.0])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: set_weights(...): weights must sum to 1 in each row ..., got a sum of 2. ...
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
    _check_row(row, where)
    return SetWeights(layer, head, query, row)


def _check_row(row: Any, where: str) -> None:
    """An attention row: every weight ≥ 0, each row summing to 1 within Lk · ε."""
    torch = require("torch", feature="qkv.edits", extra="torch")
    if bool((row < 0).any()):
        raise ValueError(
            f"{where}: weights must be ≥ 0 (an attention row), got {float(row.min()):.6g}. "
            "Hint: softmax of scores gives a row; to turn a head against itself, use scale."
        )
    sums = row.double().sum(-1).reshape(-1)
    tolerance = row.shape[-1] * torch.finfo(row.dtype).eps
    off = int((sums - 1).abs().argmax())
    if abs(float(sums[off]) - 1) > tolerance:
        raise ValueError(
            f"{where}: weights must sum to 1 in each row (an attention row), got a sum of "
            f"{float(sums[off]):.6g}. Hint: divide by the sum: "
            "weights / weights.sum(-1, keepdim=True)."
        )
