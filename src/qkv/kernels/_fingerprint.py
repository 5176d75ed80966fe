"""Cache keys of qkv's mask rules and score modifiers: :func:`fingerprint`, equal for two
rules that compute the same thing, so that the caches of block masks
(:mod:`qkv.kernels._flex_masks`) and of compiled forwards (:mod:`qkv.kernels._compiled_forward`)
find a rule made anew at each call.
"""

from __future__ import annotations

import hashlib
import types
import weakref
from collections.abc import Hashable

import numpy as np
import torch

from qkv.masks import Mask, RuleCache, ScoreMod

__all__ = ["ByIdentity", "fingerprint"]


class ByIdentity:
    """An object in a cache key, compared by identity (the key holds it, so its id is not
    reused while the entry lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByIdentity) and other.obj is self.obj


_SMALL_TENSOR = 1 << 16
_DEPTH = 16


def fingerprint(obj: object) -> Hashable:
    """A cache key for a rule or modifier: equal for two that compute the same thing.

    qkv's modules build new rules at every call (``mask & causal()``, ``alibi(slopes)``,
    ``key_padding(lengths)``): keyed by identity, the cache would miss at every step. The
    key is the rule's code and, recursively, what it closes over and the module-level names
    it reads: numbers and strings by value, lists, tuples, dictionaries, NumPy arrays and
    small CPU tensors (≤ 65,536 elements, no gradient) by content, modules by name, other
    tensors and objects by identity (a rule that reads an object's attributes is keyed by the
    object: give a new rule when they change). A rule's own caches
    (:class:`qkv.masks.RuleCache`) are left out. An array that the rule reaches several
    times (its query and key ids, views of one buffer) is hashed once per key. A
    :attr:`~qkv.masks.Mask.pure` rule (built-in rules and their combinations: they never
    change) is hashed once while it lives, so a rule reused at every call costs one look-up.
    """
    if isinstance(obj, Mask) and obj.pure:
        found = _MASK_FINGERPRINTS.get(obj)
        if found is None:
            found = _fingerprint(obj, 0, {})
            _MASK_FINGERPRINTS[obj] = found
        return found
    return _fingerprint(obj, 0, {})


_MASK_FINGERPRINTS: weakref.WeakKeyDictionary[Mask, Hashable] = weakref.WeakKeyDictionary()


def _fingerprint(obj: object, depth: int, digests: dict[Hashable, bytes]) -> Hashable:
    """:func:`fingerprint`, with the digests of the arrays met so far (by buffer address,
    shape, strides and dtype: the same bytes within one call)."""
    if depth > _DEPTH:
        return ByIdentity(obj)
    if obj is None or isinstance(obj, bool | int | float | str | bytes | torch.dtype):
        return (type(obj).__name__, obj)
    if isinstance(obj, torch.device):
        return ("device", str(obj))
    if isinstance(obj, Mask | ScoreMod):
        parts = tuple(
            (name, _fingerprint(value, depth + 1, digests)) for name, value in vars(obj).items()
        )
        return (type(obj).__name__, parts)
    if isinstance(obj, types.FunctionType):
        cells: list[Hashable] = []
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not filled yet
                cells.append(("empty",))
                continue
            cells.append(_fingerprint(contents, depth + 1, digests))
        defaults = _fingerprint(obj.__defaults__, depth + 1, digests)
        names = tuple(
            (name, _fingerprint(obj.__globals__[name], depth + 1, digests))
            for name in obj.__code__.co_names
            if name in obj.__globals__
        )
        return ("function", obj.__code__, tuple(cells), defaults, names)
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__)
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, tuple(_fingerprint(x, depth + 1, digests) for x in obj))
    if isinstance(obj, RuleCache):
        return ("cache",)
    if isinstance(obj, dict):
        items = ((repr(key), _fingerprint(value, depth + 1, digests)) for key, value in obj.items())
        return ("dict", tuple(sorted(items, key=lambda item: item[0])))
    if isinstance(obj, np.ndarray):
        where: Hashable = (
            obj.__array_interface__["data"][0],
            obj.shape,
            obj.strides,
            obj.dtype.str,
        )
        if where not in digests:
            data = np.ascontiguousarray(obj).tobytes()
            digests[where] = hashlib.blake2b(data, digest_size=16).digest()
        return ("ndarray", obj.shape, str(obj.dtype), digests[where])
    if isinstance(obj, np.generic):
        return ("numpy", obj.item())
    if isinstance(obj, torch.Tensor):
        small = obj.numel() <= _SMALL_TENSOR and obj.device.type == "cpu"
        if small and not obj.requires_grad:
            where = ("tensor", obj.data_ptr(), tuple(obj.shape), obj.stride(), str(obj.dtype))
            if where not in digests:
                data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                digests[where] = hashlib.blake2b(data, digest_size=16).digest()
            return ("tensor", tuple(obj.shape), str(obj.dtype), digests[where])
        return ByIdentity(obj)
    return ByIdentity(obj)
