"""Recording without passing a trace around: ``with qkv.tracing() as t:`` and its kin."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from importlib import import_module

from qkv.trace._select import int_selection, layer_selection, step_selection
from qkv.trace._trace import Trace, blocks_open, current_or_none, using

__all__ = [
    "blocks_open",
    "current_trace",
    "register_model_adapter",
    "resolve",
    "suspended",
    "tracing",
]

ModelAdapter = Callable[[object, Trace], AbstractContextManager[None]]
"""Prepares a model of another library for ``tracing(model=...)``: names its attention
modules (``trace._use_model(model, modules)``) and routes their attention through qkv for
the duration of the block."""

_ADAPTER_MODULES = {  # a model's package -> the qkv module adapting it
    "transformers": "qkv.hf",
    "transformer_lens": "qkv.interp",
    "nnsight": "qkv.interp",
}
_ADAPTERS: dict[str, ModelAdapter] = {}


def register_model_adapter(package: str, adapter: ModelAdapter) -> None:
    """Let ``tracing(model=...)`` use ``adapter`` for models whose class comes from
    ``package`` (e.g. ``"transformers"``); qkv.hf registers itself so, as it sits above
    this layer."""
    _ADAPTERS[package] = adapter


def _adapter_for(model: object) -> ModelAdapter | None:
    """The adapter for ``model``'s library (importing the qkv module that registers it), or
    None for a model of qkv modules."""
    packages = {cls.__module__.split(".")[0] for cls in type(model).__mro__}
    for package, module in _ADAPTER_MODULES.items():
        if package in packages:
            if package not in _ADAPTERS:
                import_module(module)  # registers itself; named by string, not imported
            return _ADAPTERS[package]
    return None


def current_trace() -> Trace | None:
    """The trace being recorded by an enclosing :func:`tracing` block, or None."""
    return current_or_none()


@contextmanager
def tracing(
    trace: Trace | None = None,
    *,
    model: object = None,
    layers: str | int | Sequence[str | int] | None = None,
    heads: int | Sequence[int] | None = None,
    queries: int | Sequence[int] | None = None,
    steps: str | Sequence[str] | None = None,
) -> Iterator[Trace]:
    """Record every attention call inside the block into one trace.

    On a model, choose what to record: only the chosen layers, heads and query rows are
    copied (to the CPU, detached), so a trace of a long sequence stays small. It works under
    ``torch.no_grad()`` and while training.

    Args:
        trace: the trace to append to; a new one by default.
        model: the model (a ``torch.nn.Module``) whose qkv attention modules to name by their
            path, e.g. ``"blocks.0.attn"``; or a Hugging Face transformers model, whose
            attention runs through qkv inside the block (see :mod:`qkv.hf`). Without it,
            modules are named by class and call order (``"MultiHeadAttention.0"``).
        layers: module paths, glob patterns (``"blocks.*.attn"``; ``"blocks.0"`` selects
            the attention inside ``blocks.0``) or positions among the model's attention
            modules (``0``, ``-1``); default: all.
        heads: query heads to record, e.g. ``[0, 3]``; default: all.
        queries: query rows to record, e.g. ``-1`` (the last token of each call); default:
            all.
        steps: step names to record, e.g. ``["weights"]``; default: every step of the
            computation (a module's W_q, W_k, W_v, W_o only when named).

    Raises:
        ValueError, TypeError: a selection that is not a list of integers or names, an
            unknown step name, or layers that select no attention module of ``model``.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.scaled_dot_product_attention(np.ones((2, 4)), np.ones((3, 4)),
        ...                                          np.ones((3, 4)))
        >>> t["weights"].shape
        (2, 3)
        >>> q = np.ones((1, 4, 5, 2))                    # (B, H, Lq, D)
        >>> with qkv.tracing(heads=[1, 3], queries=-1) as t:
        ...     _ = qkv.scaled_dot_product_attention(q, q, q)
        >>> t["weights"].shape, t["weights"].index
        ((1, 2, 1, 5), {'head': [1, 3], 'query': [4]})
    """
    trace = Trace() if trace is None else trace
    if layers is not None:
        trace.layers = layer_selection(layers)
    if heads is not None:
        trace.heads = int_selection(heads, "heads", "heads=[0, 3] records heads 0 and 3")
    if queries is not None:
        trace.queries = int_selection(
            queries, "queries", "queries=-1 records the last query row of each call"
        )
    if steps is not None:
        trace.record_steps = step_selection(steps)
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        model = model._orig_mod  # torch.compile's wrapper: name the layers as in the model
    adapter = None if model is None else _adapter_for(model)
    if model is not None and adapter is None:
        trace._use_model(model)
    chosen = list(trace.layers or ())
    if model is None and any(isinstance(s, int) and s < 0 for s in chosen):
        raise ValueError(
            f"tracing layers={chosen}: a negative position needs model=... to know "
            "how many attention modules there are. Hint: qkv.tracing(model=model, layers=-1)."
        )
    with ExitStack() as stack:
        if adapter is not None:
            stack.enter_context(adapter(model, trace))
        try:
            with using(trace):
                yield trace
        finally:
            trace._finish()


@contextmanager
def suspended() -> Iterator[None]:
    """Record nothing inside the block, even inside a :func:`tracing` block.

    A module whose layer is not selected runs its attention in here, so that the fast
    path runs and nothing is copied.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t, suspended():
        ...     _ = qkv.scaled_dot_product_attention(np.eye(2), np.eye(2), np.eye(2))
        >>> len(t)
        0
    """
    with using(None):
        yield


def resolve(trace: Trace | None) -> Trace | None:
    """The trace to record into: the one given, else the enclosing :func:`tracing` block's."""
    return trace if trace is not None else current_or_none()
