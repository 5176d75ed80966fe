"""qkv's mask rules and score modifiers in torch FlexAttention's form, and a cache of
BlockMasks.

- :func:`torch_mask_mod` / :func:`torch_score_mod`: a :class:`qkv.masks.Mask` rule as
  ``mask_mod(b, h, q_idx, kv_idx)``, a :class:`qkv.masks.ScoreMod` (and an additive bias
  array) as ``score_mod(score, b, h, q_idx, kv_idx)``; the lengths Lq, Lk the rules need are
  bound in.
- :func:`flex_block_mask`: a ``BlockMask`` from the rule's own block structure
  (:meth:`qkv.masks.Mask.blocks`), without evaluating the (Lq, Lk) mask element by element;
  a rule with no known structure gets every block partial (its ``mask_mod`` decides each
  pair, nothing is skipped).
- :data:`BLOCK_MASKS`: a bounded LRU cache of those block masks keyed by (rule, B, H, Lq, Lk,
  device), so a model does not rebuild them at each step (a rule is keyed by its
  :func:`fingerprint`: qkv's modules make equal rules anew at each call); it also keeps one
  ``score_mod`` function per (modifier, bias, Lq, Lk), so that ``torch.compile`` sees the
  same function again and does not recompile.
- :func:`run_flex`: torch's ``flex_attention`` under ``torch.compile`` (compiled once).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import array_api_compat.torch as torch_xp
import torch

from qkv.kernels._fingerprint import ByIdentity, fingerprint
from qkv.masks import FULL, PARTIAL, Mask, ScoreMod

__all__ = [
    "BLOCK_MASKS",
    "BLOCK_SIZE",
    "CACHE_SIZE",
    "CPU_BLOCK_SIZE",
    "BlockMaskCache",
    "block_mask_of_kinds",
    "block_size_for",
    "compiled_flex",
    "fingerprint",
    "flex_block_mask",
    "raise_recompile_limits",
    "run_flex",
    "torch_mask_mod",
    "torch_score_mod",
]

BLOCK_SIZE = 128
"""FlexAttention's block (queries × keys) for the block masks built here on CUDA (torch's
default)."""

CPU_BLOCK_SIZE = 64
"""The block on CPU. There it is also the compiled kernel's tile (torch's C++ template takes
the BlockMask's block sizes as its query and key split sizes), and 64 × 64 was the fastest of
the sizes measured (docs/decisions.md, "FlexAttention on CPU uses 64-blocks")."""


def block_size_for(device: torch.device | str) -> int:
    """The block of the BlockMasks qkv builds for ``device``: :data:`CPU_BLOCK_SIZE` on CPU,
    else :data:`BLOCK_SIZE`.

    Example:
        >>> block_size_for("cpu"), block_size_for("cuda")
        (64, 128)
    """
    return CPU_BLOCK_SIZE if torch.device(device).type == "cpu" else BLOCK_SIZE


CACHE_SIZE = 32
"""How many block masks (and score_mod functions) :data:`BLOCK_MASKS` keeps."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
TorchScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


_CONSTANTS: dict[Hashable, torch.Tensor] = {}
_CONSTANTS_LIMIT = 1024


def _constant(obj: Any, dtype: Any = None, device: Any = None, copy: Any = None) -> Any:
    """``asarray`` that makes each tensor of a Python list once and then returns it again.

    qkv's rules build small tables inside the rule (``key_padding``'s lengths, ALiBi's
    slopes). Inductor cannot lower a tensor made inside ``mask_mod``; a tensor made before
    (at the eager warm-up call, :func:`_warm`) and found again under tracing is a captured
    buffer, which FlexAttention supports.
    """
    if not isinstance(obj, list | tuple):
        return torch_xp.asarray(obj, dtype=dtype, device=device, copy=copy)
    key = (tuple(obj), dtype, device)
    found = _CONSTANTS.get(key)
    if found is None:
        if len(_CONSTANTS) >= _CONSTANTS_LIMIT:
            _CONSTANTS.clear()
        found = torch_xp.asarray(obj, dtype=dtype, device=device)
        _CONSTANTS[key] = found
    return found


def _namespace() -> Any:
    """array_api_compat's torch namespace, with :func:`_constant` as ``asarray``: what qkv's
    rules receive as ``xp`` inside FlexAttention."""
    names = {n: getattr(torch_xp, n) for n in dir(torch_xp) if not n.startswith("_")}
    names["asarray"] = _constant
    return types.SimpleNamespace(**names)


FLEX_XP = _namespace()
"""The ``xp`` qkv's rules get inside FlexAttention (one object: rules cache by its id)."""


def _warm(
    rule: Mask | ScoreMod,
    q_len: int,
    kv_len: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Run a rule once, eagerly, on one position on ``device`` (scores of ``dtype``): its
    tables and the constants of :func:`_constant` are made there, outside torch.compile.
    A rule that fails here fails the same way in the call, which reports it."""
    index = torch.zeros((), dtype=torch.long, device=device)
    with contextlib.suppress(Exception):
        if isinstance(rule, Mask):
            rule(index, index, index, index, q_len, kv_len, FLEX_XP)
        else:
            for kind in dict.fromkeys((dtype, torch.float32)):
                score = torch.zeros((), dtype=kind, device=device)
                rule(score, index, index, index, index, q_len, kv_len, FLEX_XP)


def torch_mask_mod(
    rule: Mask, q_len: int, kv_len: int, *, device: torch.device | str = "cpu"
) -> MaskMod:
    """``rule`` as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for Lq × Lk.

    The rule is run once on ``device`` first (eagerly), so that the tables it makes exist
    before torch.compile traces it (a tensor made inside ``mask_mod`` cannot be compiled).

    Example:
        >>> import torch
        >>> from qkv import masks
        >>> mod = torch_mask_mod(masks.causal("bottom-right"), 2, 4)
        >>> bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(2)))
        True
    """

    _warm(rule, q_len, kv_len, device)

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        allowed: torch.Tensor = rule(b, h, q_idx, kv_idx, q_len, kv_len, FLEX_XP)
        return allowed

    mask_mod.__name__ = f"qkv_mask_{_label(rule)}"
    return mask_mod


def torch_score_mod(
    modifier: ScoreMod | None,
    q_len: int,
    kv_len: int,
    bias: torch.Tensor | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TorchScoreMod | None:
    """``bias`` and ``modifier`` as FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``.

    qkv's order: the scaled score, plus ``bias[b, h, q_idx, kv_idx]``, then the modifier
    (FlexAttention hands ``score_mod`` the scaled score and masks after it). None when there
    is neither.

    Args:
        modifier: a :class:`qkv.masks.ScoreMod`, or None.
        q_len, kv_len: Lq and Lk (ALiBi's alignment needs them).
        bias: broadcastable to (B, H, Lq, Lk), 4 dimensions, or None.
        device, dtype: where and in what dtype the modifier is run once first (eagerly, as
            for :func:`torch_mask_mod`).

    Example:
        >>> import torch
        >>> from qkv import masks
        >>> mod = torch_score_mod(masks.softcap(1.0), 4, 4)
        >>> zero = torch.tensor(0)
        >>> round(float(mod(torch.tensor(100.0), zero, zero, zero, zero)), 4)
        1.0
    """
    if modifier is None and bias is None:
        return None
    if bias is not None and bias.ndim != 4:
        raise ValueError(
            f"torch_score_mod: bias must have 4 dimensions (B, H, Lq, Lk), each of its size "
            f"or 1, got shape {tuple(bias.shape)}. Hint: bias[None, None] for an (Lq, Lk) one."
        )
    # Which axes of the bias are broadcast (size 1): those are read at index 0.
    wide = (False,) * 4 if bias is None else tuple(int(n) > 1 for n in bias.shape)
    if modifier is not None:
        _warm(modifier, q_len, kv_len, device, dtype)

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        if bias is not None:
            index = tuple(i if w else 0 for i, w in zip((b, h, q_idx, kv_idx), wide, strict=True))
            score = score + bias[index]
        if modifier is not None:
            score = modifier(score, b, h, q_idx, kv_idx, q_len, kv_len, FLEX_XP)
        return score

    score_mod.__name__ = f"qkv_score_{_label(modifier) if modifier is not None else 'bias'}"
    return score_mod


def _label(thing: object) -> str:
    """A short identifier-like label of a rule or modifier (for function names in logs)."""
    text = repr(thing).split("(", 1)[0]
    return "".join(c if c.isalnum() else "_" for c in text)[:40] or "rule"


def flex_block_mask(
    rule: Mask,
    mask_mod: MaskMod | None,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    block: int = BLOCK_SIZE,
    device: torch.device | str = "cpu",
) -> Any:
    """A torch ``BlockMask`` from a qkv mask's own block structure.

    The kinds of the blocks come from :meth:`qkv.masks.Mask.blocks` (the rule's block hint:
    no (Lq, Lk) evaluation); FlexAttention then skips the empty blocks, runs the full ones
    without ``mask_mod`` and applies ``mask_mod`` in the partial ones. A rule without a block
    hint has every block partial: exact, nothing skipped. The batch and head axes of the
    BlockMask have size 1 when the structure does not depend on them (torch broadcasts).

    Args:
        rule: the qkv mask.
        mask_mod: the same rule in torch's form (default: :func:`torch_mask_mod` of ``rule``).
        q_len, kv_len: Lq and Lk (default Lk = Lq).
        batch, heads: B and H of the query (a rule may differ per batch element or head).
        block: the block size, queries and keys.
        device: where the BlockMask lives (the device of the query).

    Returns:
        A ``torch.nn.attention.flex_attention.BlockMask`` for (B or 1, H or 1, Lq, Lk).

    Example:
        >>> from qkv import masks
        >>> bm = flex_block_mask(masks.causal(), None, 256)
        >>> bm.to_dense()[0, 0].tolist()        # 2 × 2 blocks of 128: partial, empty, full
        [[1, 0], [1, 1]]
    """
    kv_len = q_len if kv_len is None else kv_len
    if mask_mod is None:
        mask_mod = torch_mask_mod(rule, q_len, kv_len, device=device)
    kinds = torch.tensor(rule.blocks(q_len, kv_len, block, block, batch=batch, heads=heads))
    return block_mask_of_kinds(kinds, mask_mod, q_len, kv_len, block=block, device=device)


def block_mask_of_kinds(
    kinds: torch.Tensor,
    mask_mod: MaskMod,
    q_len: int,
    kv_len: int,
    *,
    block: int = BLOCK_SIZE,
    device: torch.device | str = "cpu",
) -> Any:
    """A torch ``BlockMask`` from a table of block kinds (B', H', nq, nk) of
    :data:`~qkv.masks.EMPTY`, :data:`~qkv.masks.PARTIAL` and :data:`~qkv.masks.FULL`
    (:meth:`qkv.masks.Mask.blocks`), with ``mask_mod`` for the partial blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = kinds == kind  # (B', H', nq, nk)
        # The chosen blocks' key-block indices first, in order (a stable sort of 0s and 1s).
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        return chosen.sum(-1).to(torch.int32).to(device), order.to(torch.int32).to(device)

    partial_num, partial_idx = ordered(PARTIAL)
    full_num, full_idx = ordered(FULL)
    return BlockMask.from_kv_blocks(
        partial_num,
        partial_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


class BlockMaskCache:
    """A bounded LRU cache of FlexAttention block masks and score_mod functions.

    ``block_mask(rule, ...)`` returns the same ``BlockMask`` for the same (rule, B, H, Lq,
    Lk, device, block) and builds a new one otherwise; the least recently used entry goes
    when ``size`` are held. Rules are keyed by :func:`fingerprint`, so that equal rules made
    anew at each step share an entry. Safe to use from several threads.

    Args:
        size: how many block masks, and separately how many score_mod functions, to keep.
    """

    def __init__(self, size: int = CACHE_SIZE) -> None:
        if size < 1:
            raise ValueError(f"BlockMaskCache: size must be ≥ 1, got {size}. Hint: 32.")
        self.size = size
        self.hits = 0
        self.misses = 0
        self._masks: OrderedDict[Hashable, Any] = OrderedDict()
        self._mods: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._masks)

    def clear(self) -> None:
        """Forget every entry (and the counts)."""
        with self._lock:
            self._masks.clear()
            self._mods.clear()
            self.hits = self.misses = 0

    def block_mask(
        self,
        rule: Mask,
        *,
        batch: int,
        heads: int,
        q_len: int,
        kv_len: int,
        device: torch.device | str,
        key: Hashable | None = None,
        block: int | None = None,
    ) -> Any:
        """The ``BlockMask`` of ``rule`` for (B, H, Lq, Lk) on ``device``, built once, of
        ``block``-blocks (default: :func:`block_size_for` the device).

        The rule is keyed by its :func:`fingerprint` (an equal rule made anew at each step
        finds the same BlockMask), or by ``key`` when given.
        """
        block = block_size_for(device) if block is None else block
        rule_key = fingerprint(rule) if key is None else key
        full_key = (rule_key, batch, heads, q_len, kv_len, str(device), block)
        with self._lock:
            found = self._masks.get(full_key)
            if found is not None:
                self._masks.move_to_end(full_key)
                self.hits += 1
                return found
            self.misses += 1
        made = flex_block_mask(
            rule, None, q_len, kv_len, batch=batch, heads=heads, block=block, device=device
        )
        with self._lock:
            self._masks[full_key] = made
            self._masks.move_to_end(full_key)
            while len(self._masks) > self.size:
                self._masks.popitem(last=False)
        return made

    def score_mod(
        self,
        modifier: ScoreMod | None,
        q_len: int,
        kv_len: int,
        bias: torch.Tensor | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> TorchScoreMod | None:
        """:func:`torch_score_mod` of the arguments, the same function for the same ones
        (the modifier by :func:`fingerprint`, the bias by identity: the function reads its
        values at each call): ``torch.compile`` then reuses its compiled kernel."""
        if modifier is None and bias is None:
            return None
        tensor_key = None if bias is None else ByIdentity(bias)
        full_key = (fingerprint(modifier), tensor_key, q_len, kv_len, str(device), dtype)
        with self._lock:
            found = self._mods.get(full_key)
            if found is not None:
                self._mods.move_to_end(full_key)
                return found  # type: ignore[no-any-return]
            made = torch_score_mod(modifier, q_len, kv_len, bias, device=device, dtype=dtype)
            self._mods[full_key] = made
            while len(self._mods) > self.size:
                self._mods.popitem(last=False)
            return made


BLOCK_MASKS = BlockMaskCache(CACHE_SIZE)
"""The cache the ``flex`` backend and :func:`qkv.flex_attention` use on CUDA."""


# torch.compile keeps at most ``recompile_limit`` (8) compilations of one function, and every
# new mask rule, score modifier, shape or dtype is one more: past it, torch runs
# flex_attention uncompiled, which forms every score (O(L²) memory, ~1 TFLOP/s on an H200:
# measured, docs/benchmarks.md). Compiled flex_attention is the one function qkv compiles,
# so its limits are raised, once, to what a process with many rules needs.
RECOMPILE_LIMIT = 1024
ACCUMULATED_RECOMPILE_LIMIT = 8192


def raise_recompile_limits() -> None:
    """Raise torch.compile's recompilation limits to :data:`RECOMPILE_LIMIT` and
    :data:`ACCUMULATED_RECOMPILE_LIMIT` (a higher limit is kept)."""
    import torch._dynamo.config as dynamo

    for name, least in (
        ("recompile_limit", RECOMPILE_LIMIT),
        ("accumulated_recompile_limit", ACCUMULATED_RECOMPILE_LIMIT),
    ):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(int(getattr(dynamo, name)), least))


@functools.cache
def compiled_flex(static: bool = False) -> Callable[..., Any]:
    """torch's ``flex_attention`` under ``torch.compile``, compiled on first use, then per
    new shape, dtype, mask_mod or score_mod, with :func:`raise_recompile_limits`.

    ``static``: one compilation per shape (``dynamic=False``), for the CPU: there, torch
    2.13's C++ code for a dynamic-shape compilation (what torch.compile makes once a second
    shape comes) does not compile (``cur_kvSplitSize`` undeclared). On CUDA the default,
    dynamic after the second shape, spares a compilation per new length (decoding).
    """
    from torch.nn.attention.flex_attention import flex_attention

    raise_recompile_limits()
    compiled: Callable[..., Any] = torch.compile(flex_attention, dynamic=False if static else None)
    return compiled


@functools.cache
def _has_return_aux() -> bool:
    """Whether torch's flex_attention takes ``return_aux`` (torch ≥ 2.9: ``return_lse`` is
    deprecated there)."""
    from torch.nn.attention.flex_attention import flex_attention

    return "return_aux" in inspect.signature(flex_attention).parameters


def run_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    score_mod: Callable[..., Any] | None,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
) -> Any:
    """Compiled ``flex_attention`` on (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv).

    Returns the output (B, H, Lq, Dv), and with ``return_lse`` also the natural log-sum-exp
    of each row (B, H, Lq), float32 (−inf for a row with no allowed key).
    """
    flex = compiled_flex(static=query.device.type == "cpu")
    arguments: dict[str, Any] = {
        "score_mod": score_mod,
        "block_mask": block_mask,
        "scale": scale,
        "enable_gqa": enable_gqa,
    }
    if not return_lse:
        return flex(query, key, value, **arguments)
    if _has_return_aux():
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex(query, key, value, return_aux=AuxRequest(lse=True), **arguments)
        return out, aux.lse
    return flex(query, key, value, return_lse=True, **arguments)
