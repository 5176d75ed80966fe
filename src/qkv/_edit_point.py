"""The place where an intervention changes a model's attention: one call, after the kernel.

Every attention call of a model that qkv runs (a :class:`qkv.nn.MultiHeadAttention`, or a
Hugging Face attention routed through qkv) hands its result to the *editor* of the enclosing
``qkv.intervene`` block, if there is one, before the heads are merged and projected:

    context (B, H, Lq, D)  →  editor(site)  →  context, weights   →  concat · W_o

The editor lives above (``qkv.edits``); this module only holds the hook, so that the layers
that run attention need not import the layer that edits it. With no block open, the check
costs one look at a list (which ``torch.compile`` reads too, as ``qkv.trace`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = ["EditSite", "Editor", "active_editor", "editing", "known_context"]


@dataclass(frozen=True)
class EditSite:
    """One attention call, as an editor sees it.

    Attributes:
        module: the attention module that ran the call.
        query: (B, H, Lq, D), after any rotation (RoPE).
        key: (B, Hkv, Lk, D).
        value: (B, Hkv, Lk, Dv).
        context: (B, H, Lq, Dv), the fast kernel's output for every head.
        weights: (B, H, Lq, Lk) when the caller asked for them, else None.
        queries_last: whether the queries are the last Lq of the Lk positions (causal
            self-attention, decoding with a cache); else query i is position i.
        weight_rows: ``weight_rows(heads, rows)``: the exact weights of those query heads
            and query rows, (B, len(heads), len(rows), Lk), computed on the reference for
            those rows only.
        first_key: the sequence position of key 0: 0, or the tokens a windowed cache has let
            go (decoding with ``KVCache(max_length=W)``). The queries' positions count from
            it too.
    """

    module: object
    query: Any
    key: Any
    value: Any
    context: Any
    weights: Any
    queries_last: bool
    weight_rows: Callable[[list[int], list[int]], Any]
    first_key: int = 0


Editor = Callable[[EditSite], tuple[Any, Any]]
"""Returns the call's (context, weights), edited."""

_editor: ContextVar[Editor | None] = ContextVar("qkv_editor", default=None)
_OPEN: list[Editor | None] = []


@contextmanager
def editing(editor: Editor | None) -> Iterator[None]:
    """Inside the block, attention calls hand their result to ``editor`` (None: to none)."""
    token = _editor.set(editor)
    _OPEN.append(editor)
    try:
        yield
    finally:
        _OPEN.pop()
        _editor.reset(token)


def active_editor() -> Editor | None:
    """The editor of the enclosing block, or None (one look at a list when none is open)."""
    return _editor.get() if _OPEN else None


def known_context(module: object) -> Any:
    """The context (B, H, Lq, Dv) the open block's editor already holds for this call of
    ``module``, or None (then the caller runs the kernel). An editor that knows a call's
    result without it (a sweep's patched layer, whose every batch row sees the inputs of a
    run it kept) says so with a ``known(module)`` method."""
    known = getattr(active_editor(), "known", None)
    return None if known is None else known(module)
