"""The model an intervention runs on: its attention layers, how to route them through qkv,
and how to run it on some inputs."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from qkv._extras import require

__all__ = ["Layers", "layers_of", "logits_of", "routed_model", "run_model"]


@dataclass(frozen=True)
class Layers:
    """The attention layers of a model, in the order ``qkv.tracing`` counts them."""

    paths: tuple[str, ...]
    modules: tuple[Any, ...]
    hf: bool

    def index(self, layer: int | str, where: str) -> int:
        """The 0-based index of ``layer``: an integer (negative from the end), an attention
        module's path, or a path or pattern that holds exactly one attention module, as
        ``qkv.tracing`` reads ``layers=`` (``"model.layers.1"`` is the block that holds
        ``"model.layers.1.self_attn"``)."""
        count = len(self.paths)
        if isinstance(layer, int):
            if not -count <= layer < count:
                raise ValueError(
                    f"{where}: layer {layer} does not exist; the model has {count} attention "
                    f"layers. Hint: choose from 0 to {count - 1} (or negative from the end)."
                )
            return layer % count
        if layer in self.paths:
            return self.paths.index(layer)
        inside = [
            i
            for i, path in enumerate(self.paths)
            if path.startswith(layer + ".") or fnmatch.fnmatchcase(path, layer)
        ]
        if len(inside) == 1:
            return inside[0]
        if inside:
            shown = ", ".join(repr(self.paths[i]) for i in inside[:4])
            raise ValueError(
                f"{where}: {layer!r} holds {len(inside)} attention layers ({shown}"
                f"{', ...' if len(inside) > 4 else ''}). Hint: name one of them."
            )
        shown = ", ".join(repr(p) for p in self.paths[:4]) + (", ..." if count > 4 else "")
        raise ValueError(
            f"{where}: no attention layer is named {layer!r}. Hint: the model's are {shown}."
        )

    def head(self, index: int, head: int, where: str) -> int:
        """The 0-based query head ``head`` of layer ``index`` (negative from the end, as
        layers count), checked against the heads the module says it has."""
        heads = self.heads(index)
        if heads is None:
            if head < 0:
                raise ValueError(
                    f"{where}: head {head} counts from the end, but layer "
                    f"{self.paths[index]!r} does not say how many heads it has. Hint: a head "
                    "from 0."
                )
            return head
        if not -heads <= head < heads:
            raise ValueError(
                f"{where}: layer {self.paths[index]!r} has {heads} query heads. Hint: choose "
                f"a head from 0 to {heads - 1} (or negative from the end)."
            )
        return head % heads

    def heads(self, index: int) -> int | None:
        """The query heads of layer ``index`` when the module says (else None)."""
        module = self.modules[index]
        for name in ("num_heads", "n_heads", "num_attention_heads"):
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        config = getattr(module, "config", None)
        value = getattr(config, "num_attention_heads", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_hf(model: Any) -> bool:
    return any(cls.__module__.split(".")[0] == "transformers" for cls in type(model).__mro__)


def layers_of(model: Any, where: str) -> Layers:
    """The attention layers of a Hugging Face or qkv.nn model.

    Raises:
        TypeError: not a ``torch.nn.Module``.
        ValueError: a model with no attention layer qkv runs.
    """
    torch = require("torch", feature="qkv.intervene", extra="torch")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        model = model._orig_mod
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{where}: model must be a torch.nn.Module, got {type(model).__name__}. Hint: a "
            "Hugging Face transformers model or a model of qkv.nn modules."
        )
    if _is_hf(model):
        from qkv.hf import attention_modules

        found = attention_modules(model)
    else:
        found = [(p, m) for p, m in model.named_modules() if getattr(m, "_qkv_traceable", False)]
    if not found:
        raise ValueError(
            f"{where}: the {type(model).__name__} has no attention layer qkv runs. Hint: a "
            "Hugging Face model of a family qkv traces (docs/hf.md), or qkv.nn modules."
        )
    paths = tuple(p or type(m).__name__ for p, m in found)
    return Layers(paths, tuple(m for _, m in found), _is_hf(model))


@contextmanager
def routed_model(model: Any, layers: Layers, where: str) -> Iterator[None]:
    """Inside the block a Hugging Face model runs its attention through qkv; a qkv.nn model
    always does."""
    if not layers.hf:
        yield
        return
    from qkv.hf import routed

    with routed(model, caller=where):
        yield


def run_model(model: Any, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping (a tokenizer's output), ``model(*inputs)`` for a
    tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def logits_of(output: Any) -> Any:
    """The logits of a model's output: its ``logits`` (Hugging Face), the first entry of a
    tuple, or the tensor itself."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, tuple):
        return output[0]
    last = getattr(output, "last_hidden_state", None)
    return output if last is None else last
