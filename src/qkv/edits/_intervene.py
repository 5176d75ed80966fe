"""``qkv.intervene(model, *edits)``: inside the block the model's forward applies the edits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from qkv._edit_point import active_editor, editing
from qkv.edits._apply import HeadEditor
from qkv.edits._model import Layers, layers_of, routed_model
from qkv.edits._specs import EDITS, Edit

__all__ = ["intervene"]


@contextmanager
def intervene(model: Any, *edits: Edit) -> Iterator[None]:
    """Run ``model`` with some of its attention heads edited, exactly, on the fast path.

    Inside the block every forward of ``model`` (a Hugging Face model of a family
    ``qkv.tracing`` supports, or a model of ``qkv.nn`` modules) applies ``edits`` (see
    :mod:`qkv.edits`): each changes one query head's context, its slice of the input to the
    output projection, and nothing else; the other heads keep the fast kernel's output.
    It works with ``generate()`` and a cache, composes with :func:`qkv.tracing` (a trace
    inside shows the edited numbers; each edited call's meta lists ``edits``) and with an
    enclosing ``intervene`` block (its edits apply first). A Hugging Face model runs its
    attention through qkv inside the block; its implementation comes back afterwards.

    Args:
        model: the model (``torch.nn.Module``).
        *edits: edits of the kinds of :data:`~qkv.edits.EDITS` (:func:`~qkv.edits.ablate`,
            :func:`~qkv.edits.patch`, ...).

    Raises:
        TypeError, ValueError: an edit that is not one, a layer or head the model does not
            have, a patch whose recording lacks the head.

    Example:
        >>> import torch, qkv
        >>> from qkv.edits import ablate
        >>> attn = qkv.nn.MultiHeadAttention(8, num_heads=2)
        >>> x = torch.randn(1, 3, 8)
        >>> with qkv.intervene(attn, ablate(0, 1)):
        ...     edited = attn(x)
        >>> edited.shape
        torch.Size([1, 3, 8])
    """
    where = "intervene(model, ...)"
    layers = layers_of(model, where)
    editor = HeadEditor(layers, _by_layer(layers, edits), active_editor())
    with routed_model(model, layers, where), editing(editor):
        yield


def _by_layer(layers: Layers, edits: tuple[Edit, ...]) -> dict[int, list[Edit]]:
    """The edits of each layer index, checked against the model; a head counted from the
    end (``head=-1``) is written as its index from 0."""
    by_layer: dict[int, list[Edit]] = {}
    for position, edit in enumerate(edits):
        if not isinstance(edit, Edit):
            kinds = ", ".join(f"{kind}(...)" for kind in EDITS)
            raise TypeError(
                f"intervene(model, ...): edit {position} is a {type(edit).__name__}, not an "
                f"edit. Hint: one of qkv.edits' {kinds}."
            )
        where = f"{edit.kind}(layer={edit.layer!r}, head={edit.head})"
        index = layers.index(edit.layer, where)
        head = layers.head(index, edit.head, where)
        if head != edit.head:
            edit = replace(edit, head=head)
        edit.check_sources(index)
        by_layer.setdefault(index, []).append(edit)
    return by_layer
