"""Path patching: a head's effect through one later head's queries, keys or values.

For a *receiver*, query head r of layer R, and what it reads (``"queries"``, ``"keys"`` or
``"values"``), each *sender* head s of a layer S < R is patched from the clean run into the
corrupt one along that path only (Wang et al., 2022, "Interpretability in the wild", §3.1 and
appendix B; Goldowsky-Dill et al., 2023):

1. the corrupt inputs run with s's context taken from the clean run and every head of the
   layers between S and R frozen to its corrupt context (the MLPs recompute, as in the
   paper); the run stops at R's projection of the chosen input, whose input is kept;
2. the corrupt inputs run again with R's projection giving, for r's slice only (its key/value
   head for keys and values), the projection of that kept input; every other head of layer R
   keeps its corrupt context (under grouped-query attention its group shares r's keys and
   values), and the layers above recompute. The table holds ``metric(logits)``.

Both runs are batched, one sender per batch row, and start from the kept input of the block
of S (step 1) and of R (step 2), as :mod:`qkv.edits._sweep` does. The receiver's projections
are found by name: ``q_proj``/``k_proj``/``v_proj`` (Llama, Mistral, Qwen2, Gemma, gpt-oss,
BART, Whisper, ``qkv.nn``), ``query``/``key``/``value`` (BERT, ViT), ``q``/``k``/``v`` (T5),
or GPT-2's fused ``c_attn`` (queries, keys, values side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from qkv._edit_point import EditSite
from qkv.edits._apply import positions_of
from qkv.edits._specs import Recording, Target
from qkv.edits._sweep import Cell, Reuse, Stop

__all__ = ["THROUGH", "projection", "sender_rows"]

THROUGH = {"queries": 0, "keys": 1, "values": 2}
"""What a receiver reads of the residual stream, and its place in a fused projection."""

_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"))


def projection(
    module: Any, through: str, shape: tuple[int, int, int, int], head: int, where: str
) -> tuple[Any, slice]:
    """The module that projects the receiver's ``through`` input, and the columns of its
    output that are query head ``head``'s (its key/value head's for keys and values).

    ``shape`` is the layer's (H, Hkv, D, Dv)."""
    heads, kv_heads, dim, dim_v = shape
    part = THROUGH[through]
    kv = head // (heads // kv_heads)
    width, index = (dim, head) if part == 0 else ((dim, kv) if part == 1 else (dim_v, kv))
    start = index * width
    children = dict(module.named_children())
    for names in _NAMES:
        found = children.get(names[part])
        if found is not None:
            return found, slice(start, start + width)
    fused = children.get("c_attn")
    if fused is not None and heads == kv_heads:  # GPT-2: [queries | keys | values]
        offset = part * heads * dim
        return fused, slice(offset + start, offset + start + width)
    raise ValueError(
        f"{where}: the {type(module).__name__} has no projection of its {through} qkv knows "
        "(q_proj/k_proj/v_proj, query/key/value, q/k/v, or GPT-2's c_attn). Hint: patch by "
        "head or by position instead."
    )


class _Senders:
    """The editor of step 1: each row's sender patched, the layers between frozen."""

    def __init__(self, reuse: Reuse, cells: list[Cell], frozen: Recording, between: range):
        self.reuse, self.cells, self.frozen, self.between = reuse, cells, frozen, between
        self.index = {id(m): i for i, m in enumerate(reuse.layers.modules)}

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        outer = self.reuse.outer
        context, weights = (site.context, site.weights) if outer is None else outer(site)
        layer = self.index.get(id(site.module))
        if layer is None or (layer not in self.between and layer != self.cells[0].layer):
            return context, weights
        context = context.clone()
        batch, positions = self.reuse.batch, positions_of(site)
        if layer in self.between:
            _freeze(context, self.frozen, layer, range(int(context.shape[1])), positions)
            return context, weights
        group = int(context.shape[1]) // int(site.key.shape[1])
        for row, cell in enumerate(self.cells):
            part = slice(row * batch, (row + 1) * batch)
            value = site.value[part, cell.head // group]
            cell.write(Target(context[part], value, positions, site.first_key, layer, cell.where))
        return context, weights


def _freeze(context: Any, frozen: Recording, layer: int, heads: Any, positions: range) -> None:
    """Write the recorded (corrupt) contexts of ``heads`` into every copy of the batch."""
    copies = None
    for head in heads:
        held = frozen.contexts[layer][head][:, positions.start : positions.stop]
        copies = copies or int(context.shape[0]) // int(held.shape[0])
        context[:, head] = held.to(context.dtype).repeat(copies, 1, 1)


class _Receiver:
    """The editor of step 2: every head of the receiver's layer but the receiver keeps its
    corrupt context."""

    def __init__(self, reuse: Reuse, frozen: Recording, layer: int, head: int):
        self.reuse, self.frozen, self.layer, self.head = reuse, frozen, layer, head
        self.module = reuse.layers.modules[layer]

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        outer = self.reuse.outer
        context, weights = (site.context, site.weights) if outer is None else outer(site)
        if site.module is not self.module:
            return context, weights
        context = context.clone()
        others = [h for h in range(int(context.shape[1])) if h != self.head]
        _freeze(context, self.frozen, self.layer, others, positions_of(site))
        return context, weights


def sender_rows(
    reuse: Reuse,
    cells: list[Cell],
    frozen: Recording,
    receiver: tuple[int, int],
    through: str,
    where: str,
) -> list[Any]:
    """The logits (B, ...) of each sender cell's path to ``receiver`` through ``through``:
    two batched forwards (module docstring). All cells are of one sender layer."""
    layer, head = receiver
    module = reuse.layers.modules[layer]
    target, columns = projection(module, through, reuse.shapes[layer], head, where)
    kept: dict[str, Any] = {}

    def stop_at(stack: ExitStack) -> None:
        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            given = args[0] if args else next(iter(kwargs.values()))
            kept["out"] = target.forward(given)[..., columns]
            raise Stop

        stack.callback(target.register_forward_pre_hook(hook, with_kwargs=True).remove)

    senders = _Senders(reuse, cells, frozen, range(cells[0].layer + 1, layer))
    start = min(cell.first for cell in cells)
    reuse.forward(len(cells), cells[0].layer, senders, stop_at, start)

    def swap(stack: ExitStack) -> None:
        def hook(_: Any, __: Any, output: Any) -> Any:
            output = output.clone()
            output[..., columns] = kept["out"].to(output.dtype)
            return output

        stack.callback(target.register_forward_hook(hook).remove)

    receiving: Callable[[EditSite], tuple[Any, Any]] = _Receiver(reuse, frozen, layer, head)
    logits = reuse.forward(len(cells), layer, receiving, swap, start)
    batch = reuse.batch
    return [logits[i * batch : (i + 1) * batch] for i in range(len(cells))]
