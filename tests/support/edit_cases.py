"""The one list of edit cases the tests draw from: for every kind of edit in the registry
(:data:`qkv.edits.EDITS`), how to make it and what it does to a head, written out without
qkv (the oracle). ``tests/edits/test_intervene_nn.py`` and ``test_intervene_hf.py`` run
every case on their models; ``tests/core/test_registry.py`` fails when a kind of the
registry has no case here. A new kind of edit adds its cases here, and nowhere else in
``tests/``.

A case has a *variant* (``"zero"``, ``"mean"``: one way of using a kind), the ``kind`` of
the registry it makes, ``make(run, layer, head)`` giving the qkv edit and the value the
oracle needs, and ``oracle(view, value, query)`` (``query``: the case's) giving the head's
new (B, Lq, D) context from its old one and its values, as the model's own attention
computed them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qkv.edits import Edit, Recording, ablate, patch, scale, set_weights


class Run(Protocol):
    """What a case needs of the model a test edits: one head of one layer."""

    dtype: torch.dtype
    generator: torch.Generator

    @property
    def width(self) -> int:
        """The head's D."""
        ...

    @property
    def keys(self) -> int:
        """Lk of the edited call."""
        ...

    @property
    def key_mask(self) -> torch.Tensor | None:
        """(Lk,) True where a weight row may put weight (None: every key)."""
        ...

    def record(self, what: str) -> Recording:
        """qkv's recording of the head's context or weights on the other inputs."""
        ...

    def eager(self, what: str) -> torch.Tensor:
        """The oracle's own (B, L, D) context or (B, L, Lk) weights of the head there."""
        ...


@dataclass(frozen=True)
class HeadView:
    """One head at one call, as the oracle sees it: its (B, Lq, D) context (the slice of
    the output projection's input), its (B, Lk, D) values, and the sequence position of
    the call's first query row."""

    context: torch.Tensor
    value: torch.Tensor
    first: int


@dataclass(frozen=True)
class EditCase:
    variant: str
    kind: str
    make: Callable[[Run, int, int], tuple[Edit, Any]]
    oracle: Callable[[HeadView, Any, int], torch.Tensor]
    query: int = 0  # the query position the edit names, if it names one


def _mean(run: Run, layer: int, head: int) -> tuple[Edit, Any]:
    mean = torch.randn(run.width, generator=run.generator).to(run.dtype)
    return ablate(layer, head, how="mean", mean=mean), mean


def _patch(what: str) -> Callable[[Run, int, int], tuple[Edit, Any]]:
    def make(run: Run, layer: int, head: int) -> tuple[Edit, Any]:
        return patch(layer, head, run.record(what), what=what), run.eager(what)

    return make


def _row(run: Run, layer: int, head: int) -> tuple[Edit, Any]:
    row = torch.rand(run.keys, generator=run.generator).to(run.dtype)
    if run.key_mask is not None:  # no weight on padding keys, whose values differ
        row = row * run.key_mask
    row = row / row.sum()  # an attention row: set_weights takes rows that sum to 1
    return set_weights(layer, head, _ROW, row), row


_ROW = -2  # the row set_weights sets: the last but one token


def _set_row(view: HeadView, row: Any, query: int) -> torch.Tensor:
    q_len = view.context.shape[1]
    end = view.first + q_len
    position = query if query >= 0 else end + query
    out = view.context.clone()
    if view.first <= position < end:
        out[:, position - view.first] = torch.einsum("k,bkd->bd", row, view.value)
    return out


def _weights(view: HeadView, source: torch.Tensor, query: int) -> torch.Tensor:
    q_len, kv_len = view.context.shape[1], view.value.shape[1]
    return source[:, :q_len, :kv_len] @ view.value


CASES: dict[str, EditCase] = {
    case.variant: case
    for case in (
        EditCase(
            "zero",
            "ablate",
            lambda run, layer, head: (ablate(layer, head), None),
            lambda view, _, __: torch.zeros_like(view.context),
        ),
        EditCase("mean", "ablate", _mean, lambda view, mean, _: mean.expand_as(view.context)),
        EditCase(
            "scale",
            "scale",
            lambda run, layer, head: (scale(layer, head, -1.5), -1.5),
            lambda view, factor, _: view.context * factor,
        ),
        EditCase(
            "context",
            "patch",
            _patch("context"),
            lambda view, source, _: source[:, : view.context.shape[1]],
        ),
        EditCase("weights", "patch", _patch("weights"), _weights),
        EditCase("row", "set_weights", _row, _set_row, query=_ROW),
    )
}
"""Every case, by variant; the registry's kinds each have one at least."""


def edited(variant: str, view: HeadView, value: Any, query: int = 0) -> torch.Tensor:
    """The head's new context under the oracle's reading of one case."""
    return CASES[variant].oracle(view, value, query)
