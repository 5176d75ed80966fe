"""``use_qkv(model)``: the attention of a model loaded by TransformerLens, nnsight or
transformers runs through qkv; and ``qkv.tracing(model=...)`` on those models."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from qkv._extras import require
from qkv.hf import routed
from qkv.interp._lens import attention_bridges, switch_bridge
from qkv.trace import Trace
from qkv.trace._context import register_model_adapter

__all__ = ["QkvAttention", "use_qkv"]

_ACTIVE: weakref.WeakKeyDictionary[Any, QkvAttention] = weakref.WeakKeyDictionary()
"""The switch in force on each model (a second ``use_qkv`` returns it)."""


class QkvAttention:
    """The switch :func:`use_qkv` made: ``restore()`` (or the end of a ``with`` block)
    puts the tool's own attention back.

    Attributes:
        model: the model switched (a ``TransformerBridge``, an nnsight model or a
            transformers model).
        tool: ``"transformer_lens"``, ``"nnsight"`` or ``"transformers"``.
    """

    def __init__(self, model: Any, tool: str, restore: Callable[[], None]) -> None:
        self.model = model
        self.tool = tool
        self._restore: Callable[[], None] | None = restore

    def restore(self) -> None:
        """Switch the model back to the attention it had (once; later calls do nothing)."""
        if self._restore is not None:
            self._restore()
            self._restore = None
            _ACTIVE.pop(self.model, None)

    def __enter__(self) -> QkvAttention:
        return self

    def __exit__(self, *_: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self._restore is not None else "restored"
        return f"QkvAttention({type(self.model).__name__}, tool={self.tool!r}, {state})"


def _tool(model: Any) -> str:
    """Which library ``model`` comes from, by its classes' packages."""
    packages = {cls.__module__.split(".")[0] for cls in type(model).__mro__}
    for tool in ("transformer_lens", "nnsight", "transformers"):
        if tool in packages:
            return tool
    raise TypeError(
        f"use_qkv(model): expected a TransformerLens TransformerBridge, an nnsight "
        f"LanguageModel or a transformers model, got {type(model).__name__}. Hint: a model "
        "of qkv.nn modules runs qkv's attention already."
    )


def _hf_model(model: Any, tool: str) -> Any:
    """The transformers model inside ``model``."""
    if tool == "transformer_lens":
        return model.original_model
    if tool == "nnsight":
        if not getattr(model, "dispatched", True):
            model.dispatch()  # real weights now, so the switch reaches the model that runs
        return model._module
    return model


def use_qkv(model: Any) -> QkvAttention:
    """Run the attention of ``model`` through qkv: torch's SDPA (O(N) memory) in place of
    the eager (B, H, N, N) pattern, exact to float32 rounding, the tool's hooks kept.

    - A TransformerLens ``TransformerBridge`` (GPT-2, Llama and kin): every hook fires as
      before and edits through hooks apply; ``hook_attn_scores`` and ``hook_pattern`` fire
      only when hooked, with qkv's exact recompute of the heads and query rows that a
      :func:`qkv.tracing` block selects (every head and row without one).
    - An nnsight ``LanguageModel`` (or any nnsight transformers model) and a transformers
      model: ``attn_implementation="qkv"``; nnsight's module outputs and edits are those of
      any implementation. Patterns come from :func:`qkv.tracing`.

    Needs ``pip install 'qkv[interp]'``.

    Args:
        model: the loaded model.

    Returns:
        The switch, :class:`QkvAttention`: ``restore()`` or ``with use_qkv(model): ...``
        puts the previous attention back. A model already switched returns its switch.

    Raises:
        TypeError: ``model`` is of none of these libraries.
        ValueError: a TransformerLens attention of a kind qkv does not switch (nothing is
            changed then), or a transformers family that does not use its AttentionInterface.

    Example:
        >>> import torch, qkv
        >>> from qkv.interp import use_qkv
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=30, n_embd=16, n_layer=1,
        ...                                    n_head=2, n_positions=8)).eval()
        >>> with use_qkv(model) as switch:
        ...     model.config._attn_implementation, switch.tool
        ('qkv', 'transformers')
        >>> model.config._attn_implementation
        'sdpa'
    """
    tool = _tool(model)
    if model in _ACTIVE:
        return _ACTIVE[model]
    if tool == "transformer_lens":
        require("transformer_lens", feature="qkv.interp", extra="interp")
        restore = switch_bridge(model)
    else:
        hf = _hf_model(model, tool)
        block = routed(hf, caller="use_qkv(model)")
        block.__enter__()

        def restore() -> None:
            block.__exit__(None, None, None)

    switch = QkvAttention(model, tool, restore)
    _ACTIVE[model] = switch
    return switch


@contextmanager
def _trace_bridge(bridge: Any, trace: Trace) -> Iterator[None]:
    """``qkv.tracing(model=bridge)``: the layers are the bridge's (``"blocks.0.attn"``);
    qkv runs the attention inside the block (and after it, if it did before)."""
    found = attention_bridges(bridge)
    trace._use_model(bridge, [(path, a.original_component) for path, a in found])
    with _switched(bridge):
        yield


@contextmanager
def _trace_nnsight(model: Any, trace: Trace) -> Iterator[None]:
    """``qkv.tracing(model=nnsight_model)``: the layers are named by their module paths
    in the transformers model nnsight wraps (``"model.layers.0.self_attn"``)."""
    with routed(_hf_model(model, "nnsight")) as modules:
        trace._use_model(model, modules)
        yield


@contextmanager
def _switched(model: Any) -> Iterator[None]:
    """Inside the block ``model`` runs qkv's attention; a switch made here ends with it."""
    had = model in _ACTIVE
    switch = use_qkv(model)
    try:
        yield
    finally:
        if not had:
            switch.restore()


register_model_adapter("transformer_lens", _trace_bridge)
register_model_adapter("nnsight", _trace_nnsight)
