"""Sweeps that reuse what they can: one row of a batch per edited head, and only the layers
above the edited one run.

A sweep (patching, ablation, patching by position) runs the same inputs many times, each
time with one head's slice changed. Everything the model computes before that head's layer
is the same in every run, so :class:`Reuse` runs the inputs once and keeps the output of each
*block* (a module held in a ``torch.nn.ModuleList``: a decoder layer, a GPT-2 block, a
``qkv.nn.TransformerBlock``). A batch of edits of layer L then runs the model once on the
inputs repeated along the batch, one edit per batch row, with every block that finished
before layer L's attention started replaced by its kept output: only the layers above run.

In a causal language model of Hugging Face, the positions before the first one an edit
changes are the same in every run too (a cell's ``first``: where a patch's source first
differs from the run's own context, or the one position a position patch writes). A batch
then runs only the positions from the batch's first on, with the first run's keys and
values of the positions before as the model's own cache, and its logits of those positions
in front of the new ones. There the batch's own layer runs no attention kernel: its input is
the first run's, whose contexts were kept (``_RowEditor.known``).

Which blocks finished before is seen, not assumed: the first run notes, in order, when each
block ends and when each attention layer starts. A block whose output holds something other
than tensors and tuples of them (a cache), or that ran more than once, always runs. The
result is the one-forward-per-edit result; the tests compare the two on every family.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from qkv._edit_point import EditSite, active_editor, editing
from qkv._extras import require
from qkv.edits._apply import positions_of
from qkv.edits._model import Layers, logits_of, routed_model, run_model
from qkv.edits._specs import Rows, Target

__all__ = ["Cell", "Reuse", "Stop"]

_ACTIVATIONS = 10
"""A batch row's activations, counted as this many copies of a block's output (the MLP's
wider hidden layer, the residual, the norms)."""

_UNKEPT = object()  # a block output that is not kept (not tensors and tuples of them)


class Stop(Exception):  # noqa: N818 (not an error: the run has what it needs)
    """Raised by a hook to end a forward early (what it needed has been seen)."""


@dataclass(frozen=True)
class Cell:
    """One batch row of a sweep: at layer ``layer`` (an index), ``write(target)`` changes
    query head ``head``'s slice of the call's context (``target.context`` is this row's
    (B, H, Lq, D) view). ``where`` names the edit in an error."""

    layer: int
    head: int
    write: Callable[[Target], object]
    where: str
    first: int = 0  # the first sequence position the write can change


def _frozen(value: Any, torch: Any) -> Any:
    """A copy of a block's output that later code cannot change, or ``_UNKEPT``."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value) in (tuple, list):
        parts = [_frozen(v, torch) for v in value]
        return _UNKEPT if any(p is _UNKEPT for p in parts) else type(value)(parts)
    return _UNKEPT


def _repeated(value: Any, batch: int, copies: int, torch: Any) -> Any:
    """``value`` with each tensor whose first axis is the batch (``batch`` rows) repeated
    ``copies`` times along it (rows i·batch to (i + 1)·batch are copy i); other tensors
    copied as they are. Mappings, tuples and lists keep their form."""
    if isinstance(value, torch.Tensor):
        if value.ndim and int(value.shape[0]) == batch:
            return value.repeat(copies, *([1] * (value.ndim - 1)))
        return value.clone()
    if isinstance(value, Mapping):
        return {key: _repeated(v, batch, copies, torch) for key, v in value.items()}
    if type(value) in (tuple, list):
        return type(value)(_repeated(v, batch, copies, torch) for v in value)
    return value


def _blocks(model: Any, torch: Any) -> list[tuple[str, Any]]:
    """The modules held in a ``ModuleList`` or ``Sequential`` of the model, by path."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            found += [
                (f"{path}.{name}" if path else name, m) for name, m in module.named_children()
            ]
    return found


def _sliced(value: Any, batch: int, length: int, start: int, torch: Any) -> Any:
    """``value`` with each tensor laid out (batch, length, ...) cut to positions ``start``
    on; tuples and lists keep their form."""
    if isinstance(value, torch.Tensor):
        if value.ndim >= 2 and tuple(value.shape[:2]) == (batch, length):
            return value[:, start:]
        return value
    if type(value) in (tuple, list):
        return type(value)(_sliced(v, batch, length, start, torch) for v in value)
    return value


def _parameters(model: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _token_ids(inputs: Any, torch: Any) -> Any:
    """The (B, N) token ids of inputs that are token ids only (a tensor, or a mapping of
    ``input_ids`` and an all-ones ``attention_mask``), else None."""
    if isinstance(inputs, Mapping):
        mask = inputs.get("attention_mask")
        if set(inputs) - {"input_ids", "attention_mask"} or (
            mask is not None and not bool((mask == 1).all())
        ):
            return None
        inputs = inputs.get("input_ids")
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and not inputs.is_floating_point():
        return inputs
    return None


def _causal_lm(model: Any, layers: Layers) -> bool:
    """Whether ``model`` is a Hugging Face decoder that takes a key/value cache and whose
    attention layers are all causal (each position sees only those before it)."""
    return (
        layers.hf
        and "past_key_values" in _parameters(model)
        and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        and all(getattr(module, "is_causal", False) is True for module in layers.modules)
    )


@dataclass
class _Seen:
    """What the first run saw of the model."""

    batch: int = 0
    shapes: dict[int, tuple[int, int, int, int]] | None = None  # (H, Hkv, D, Dv) by layer
    starts: dict[int, int] | None = None  # the tick at which each layer's attention began
    row_bytes: int = 0  # the attention scores of the largest call, per batch row
    contexts: dict[int, Any] | None = None  # (B, H, N, Dv) by layer (a causal LM's only)
    cache_bytes: int = 0  # the keys and values of every layer, per batch row (the same)


class Reuse:
    """The model run once on ``inputs``, with each block's output kept: the base of a sweep.

    Attributes:
        logits: the first run's logits (B, ...), unedited (edits of an enclosing
            ``qkv.intervene`` block apply).
        cache: the first run's key/value cache, where a batch may start at a later
            position (a causal language model of Hugging Face on token ids, no enclosing
            ``qkv.intervene`` block), else None.
        batch: B, the inputs' batch.
        heads: the query heads of each layer (0 for a layer that did not run).
        shapes: (H, Hkv, D, Dv) of each layer that ran.
        row_bytes: the memory one batch row of a sweep takes, estimated (logits,
            activations, the largest call's attention scores, and a copy of the cache).
    """

    def __init__(self, model: Any, layers: Layers, inputs: Any, where: str) -> None:
        torch = require("torch", feature="qkv.patching", extra="torch")
        self.model, self.layers, self.inputs, self.where = model, layers, inputs, where
        self.extra = {"use_cache": False} if layers.hf and "use_cache" in _parameters(model) else {}
        self.outer = active_editor()
        self._ids = _token_ids(inputs, torch)
        self._length = 0 if self._ids is None else int(self._ids.shape[1])
        self._later = self._ids is not None and self.outer is None and _causal_lm(model, layers)
        self.cache: Any = None  # set by the first run where batches may start later
        self._blocks = _blocks(model, torch)
        self._kept: dict[str, Any] = {}
        self._ends: dict[str, int] = {}
        seen = self._observe(torch)
        self.batch = seen.batch
        self.shapes = seen.shapes or {}
        self.heads = [self.shapes.get(i, (0,))[0] for i in range(len(layers.paths))]
        self._starts = seen.starts or {}
        self._contexts = seen.contexts or {}
        kept = max((_bytes(v, torch) for v in self._kept.values()), default=0)
        logits = _bytes(self.logits, torch)
        self.row_bytes = (logits + _ACTIVATIONS * kept) // max(self.batch, 1) + seen.row_bytes
        self.row_bytes += seen.cache_bytes if self.cache is not None else 0

    def _observe(self, torch: Any) -> _Seen:
        ticks = itertools.count()
        seen = _Seen(shapes={}, starts={}, contexts={} if self._later else None)
        calls: dict[str, int] = {}
        index = {id(m): i for i, m in enumerate(self.layers.modules)}

        def started(i: int) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                assert seen.starts is not None
                seen.starts.setdefault(i, next(ticks))

            return hook

        def ended(path: str) -> Callable[..., None]:
            def hook(_: Any, __: Any, output: Any) -> None:
                calls[path] = calls.get(path, 0) + 1
                self._ends[path] = next(ticks)
                self._kept[path] = _frozen(output, torch)

            return hook

        def look(site: EditSite) -> tuple[Any, Any]:
            context, weights = (
                (site.context, site.weights) if self.outer is None else self.outer(site)
            )
            layer = index.get(id(site.module))
            if layer is not None:
                assert seen.shapes is not None
                b, h, lq = (int(n) for n in context.shape[:3])
                seen.batch = seen.batch or b
                kv, dim = int(site.key.shape[1]), int(site.query.shape[-1])
                seen.shapes[layer] = (h, kv, dim, int(site.value.shape[-1]))
                scores = h * lq * int(site.key.shape[2]) * context.element_size()
                seen.row_bytes = max(seen.row_bytes, scores // max(b, 1))
                if seen.contexts is not None:  # a layer called twice has no one context
                    once = layer not in seen.contexts
                    seen.contexts[layer] = context.detach().clone() if once else None
                    held = site.key.numel() + site.value.numel()  # the cache a row copies
                    seen.cache_bytes += held * site.key.element_size() // max(b, 1)
            return context, weights

        with ExitStack() as stack:
            for i, module in enumerate(self.layers.modules):
                handle = module.register_forward_pre_hook(started(i))
                stack.callback(handle.remove)
            for path, module in self._blocks:
                handle = module.register_forward_hook(ended(path))
                stack.callback(handle.remove)
            stack.enter_context(torch.no_grad())
            stack.enter_context(routed_model(self.model, self.layers, self.where))
            stack.enter_context(editing(look))
            output = self._forward(self.inputs, **({"use_cache": True} if self._later else {}))
        self.logits = logits_of(output)
        cache = getattr(output, "past_key_values", None) if self._later else None
        whole = not any(getattr(cache, "is_sliding", None) or ())  # a window drops keys
        if whole and getattr(cache, "is_croppable", False) and hasattr(cache, "crop"):
            self.cache = cache
        for path, count in calls.items():
            if count != 1:
                self._kept[path] = _UNKEPT
        if not seen.batch:
            raise ValueError(
                f"{self.where}: the model ran no attention layer on these inputs. Hint: "
                "inputs the model's attention sees (token ids of a prompt)."
            )
        return seen

    def _forward(self, inputs: Any, **extra: Any) -> Any:
        """The model's output on ``inputs`` (with ``use_cache=False`` where it takes it,
        unless ``extra`` says otherwise)."""
        if not self.extra:
            return run_model(self.model, inputs)
        extra = {**self.extra, **extra}
        if isinstance(inputs, Mapping):
            return self.model(**{**extra, **inputs})
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return self.model(*args, **extra)

    def first_change(self, layer: int, head: int, source: Any) -> int:
        """The first position at which ``source`` (B, N, Dv), a head's context from
        another run, differs from this run's context of that head (N if nowhere; 0 when
        batches cannot start later)."""
        context = self._contexts.get(layer)
        if self.cache is None or context is None or source.shape != context[:, head].shape:
            return 0
        differs = (source.to(context.dtype) != context[:, head]).any(dim=2).any(dim=0)
        found = differs.nonzero()
        return int(found[0, 0]) if len(found) else int(differs.shape[0])

    def _start(self, start: int) -> int:
        """The first position a batch asked to start at runs from: 0 without a cache."""
        return min(start, self._length - 1) if self.cache is not None else 0

    def context_of(self, layer: int, start: int, copies: int) -> Any:
        """This run's context of ``layer`` from position ``start`` on, (copies·B, H, N −
        start, Dv), or None where it was not kept (a causal language model's only)."""
        held = self._contexts.get(layer)
        return None if held is None else held[:, :, start:].repeat(copies, 1, 1, 1)

    def skipped(self, layer: int) -> list[str]:
        """The blocks whose kept output a batch of edits of ``layer`` reuses: those that
        ended before the layer's attention began (in the first run)."""
        start = self._starts.get(layer, -1)
        return [
            path
            for path, _ in self._blocks
            if self._kept.get(path, _UNKEPT) is not _UNKEPT and self._ends[path] < start
        ]

    def run(self, cells: list[Cell]) -> list[Any]:
        """The logits (B, ...) of each cell's run: one forward of ``len(cells)`` copies of
        the inputs, cell i editing copy i, starting above the blocks all cells' layers
        reuse."""
        first = min(cell.layer for cell in cells)
        start = min(cell.first for cell in cells)
        if self.cache is not None and start >= self._length:  # no cell changes a position
            return [self.logits] * len(cells)
        editor = _RowEditor(self, cells, first, self._start(start))
        logits = self.forward(len(cells), first, editor, start=start)
        return [logits[i * self.batch : (i + 1) * self.batch] for i in range(len(cells))]

    def forward(
        self,
        copies: int,
        first: int,
        editor: Callable[[EditSite], tuple[Any, Any]],
        hooks: Callable[[ExitStack], None] | None = None,
        start: int = 0,
    ) -> Any:
        """One forward of ``copies`` copies of the inputs under ``editor`` (and the forward
        hooks ``hooks`` registers on the stack), reusing the blocks that ended before layer
        ``first`` began, and (with :attr:`cache`) the positions before ``start``. Returns
        the logits (copies·B, ...), or None when a hook raised :class:`Stop`."""
        torch = require("torch", feature="qkv.patching", extra="torch")
        start = self._start(start)
        tiled = torch.arange(self.batch).repeat(copies)
        extra: dict[str, Any] = {}
        if start > 0:
            cache = copy.deepcopy(self.cache)
            cache.crop(start - self._length)  # a negative count: the tokens removed
            cache.batch_select_indices(tiled.to(self._ids.device))
            extra = {"use_cache": True, "past_key_values": cache}
            inputs = self._ids[:, start:].repeat(copies, 1)
        else:
            inputs = _repeated(self.inputs, self.batch, copies, torch)
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self._reusing(self.skipped(first), copies, start, torch))
            stack.enter_context(routed_model(self.model, self.layers, self.where))
            stack.enter_context(editing(editor))
            if hooks is not None:
                hooks(stack)
            try:
                logits = logits_of(self._forward(inputs, **extra))
            except Stop:
                return None
        if start > 0:  # the positions before start are the first run's
            before = self.logits[:, :start].to(logits.device)
            logits = torch.cat([before[tiled.to(before.device)], logits], dim=1)
        if int(logits.shape[0]) != copies * self.batch:
            raise ValueError(
                f"{self.where}: the model gave {int(logits.shape[0])} rows for a batch of "
                f"{copies} copies of {self.batch}. Hint: batch=1, or a model whose output "
                "keeps the batch axis first."
            )
        return logits

    @contextmanager
    def _reusing(self, paths: list[str], copies: int, start: int, torch: Any) -> Iterator[None]:
        """Inside the block, the modules at ``paths`` return their kept output (from
        position ``start`` on, repeated ``copies`` times along the batch) instead of
        running."""
        modules = dict(self._blocks)
        saved: list[tuple[Any, Any]] = []
        try:
            for path in paths:
                module, kept = modules[path], self._kept[path]
                if start:
                    kept = _sliced(kept, self.batch, self._length, start, torch)
                saved.append((module, module.__dict__.get("forward")))

                def reused(*_: Any, kept: Any = kept, **__: Any) -> Any:
                    return _repeated(kept, self.batch, copies, torch)

                module.forward = reused
            yield
        finally:
            for module, previous in reversed(saved):
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous


def _bytes(value: Any, torch: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if type(value) in (tuple, list):
        return sum(_bytes(v, torch) for v in value)
    return 0


class _RowEditor:
    """The editor of a batched run: cell i writes its head's slice of rows i·B to (i+1)·B
    (after the edits of an enclosing ``qkv.intervene`` block)."""

    def __init__(self, reuse: Reuse, cells: list[Cell], first: int, start: int) -> None:
        self.reuse, self.first, self.start = reuse, first, start
        self.batch, self.outer, self.where = reuse.batch, reuse.outer, reuse.where
        self.index = {id(m): i for i, m in enumerate(reuse.layers.modules)}
        self.cells: dict[int, list[tuple[int, Cell]]] = {}
        for row, cell in enumerate(cells):
            self.cells.setdefault(cell.layer, []).append((row, cell))
        self.copies = len(cells)

    def known(self, module: object) -> Any:
        """The context of the batch's first layer: every row's input there is the kept
        run's (the blocks below are reused), so its attention is that run's."""
        if self.index.get(id(module)) != self.first:
            return None
        return self.reuse.context_of(self.first, self.start, self.copies)

    def __call__(self, site: EditSite) -> tuple[Any, Any]:
        context, weights = (site.context, site.weights) if self.outer is None else self.outer(site)
        layer = self.index.get(id(site.module))
        cells = self.cells.get(layer, []) if layer is not None else []
        if layer is None or not cells:
            return context, weights
        if int(context.shape[0]) != self.copies * self.batch:
            raise ValueError(
                f"{self.where}: layer {layer} ran a batch of {int(context.shape[0])}, not "
                f"{self.copies} copies of {self.batch}. Hint: batch=1."
            )
        context = context.clone()
        weights = None if weights is None else weights.clone()
        heads, kv_heads = int(context.shape[1]), int(site.key.shape[1])
        group, positions = heads // kv_heads, positions_of(site)
        for row, cell in cells:
            part = slice(row * self.batch, (row + 1) * self.batch)
            value = site.value[part, cell.head // group]
            target = Target(context[part], value, positions, site.first_key, layer, cell.where)
            written = cell.write(target)
            if isinstance(written, Rows) and weights is not None:
                weights[part, written.head, written.rows] = written.values.to(weights.dtype)
        return context, weights
