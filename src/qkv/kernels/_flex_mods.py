"""What ``qkv.flex_attention`` checks of the functions it is given: a ``score_mod`` returns
floating-point scores and a ``mask_mod`` booleans, one per score.

torch's FlexAttention calls them one score at a time (``torch.vmap``), so whatever they
compute on a 0-d tensor is their meaning. On CPU qkv calls them on whole blocks of
broadcasting index tensors, which is fast but hides two mistakes: a result of the wrong
shape that still broadcasts (a ``sum`` or ``max`` over the scores, a scalar), used as if it
were elementwise, and an integer or boolean result, which fails deep in the kernel. Each
function is therefore tried once on a small probe (at most 2 batch elements, 3 heads, 5
queries and 7 keys, so that no two axes share a size by chance) and compared with the same
probe score by score; a mistake is one line naming the argument, what came and a hint.
The verdict is kept per function (weakly), so a training loop pays once.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import array_api_compat.torch as torch_xp
import torch

from qkv.masks import Mask, ScoreMod
from qkv.masks._scores import _per_element, _returned

__all__ = ["check_mods"]

_CHECKED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""The functions (and rules) already found to act score by score."""


def check_mods(
    score_mod: Any,
    block_mask: Any,
    query: torch.Tensor,
    key: torch.Tensor,
) -> None:
    """Raise on a ``score_mod`` or ``mask_mod`` (of a torch BlockMask, or a qkv Mask given
    as ``block_mask``) that does not give one score, or one boolean, per score of the
    (B, H, Lq, Lk) problem of ``query`` (B, H, Lq, D) and ``key`` (B, Hkv, Lk, D).

    Raises:
        TypeError: a result of an integer or boolean dtype (scores) or not boolean (masks).
        ValueError: a result that is not score by score: another shape than torch's call
            one score at a time gives, or other values.

    Example:
        >>> q = torch.zeros(1, 2, 8, 4)
        >>> check_mods(lambda s, b, h, q_idx, kv_idx: s * 2, None, q, q)   # fine
        >>> try:
        ...     check_mods(lambda s, b, h, q_idx, kv_idx: s.sum(-1), None, q, q)
        ... except ValueError as error:
        ...     print(str(error).split("; ")[1].split(". Hint")[0])
        score_mod returned an array of shape (1, 2, 5)
    """
    probe = _probe(query, key)
    if score_mod is not None and not _known(score_mod):
        _check_score_mod(score_mod, probe, int(query.shape[2]), int(key.shape[2]))
        _remember(score_mod)
    if block_mask is None:
        return
    if isinstance(block_mask, Mask):
        function, name, each = block_mask, f"block_mask {block_mask!r}", not block_mask.pure
    else:  # a torch BlockMask: its mask_mod, which torch calls one score at a time
        function, name, each = block_mask.mask_mod, "the mask_mod of block_mask", True
    if function is not None and not _known(function):
        _check_mask(function, name, each, probe, int(query.shape[2]), int(key.shape[2]))
        _remember(function)


def _probe(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Scores (B', H', Lq', Lk') and their broadcasting indices b, h, q_idx, kv_idx."""
    sizes = (
        min(int(query.shape[0]), 2),
        min(int(query.shape[1]), 3),
        min(int(query.shape[2]), 5),
        min(int(key.shape[2]), 7),
    )
    dtype = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    count = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    scores = torch.linspace(-1.0, 1.0, count, dtype=dtype, device=query.device).view(sizes)
    indices = []
    for axis, size in enumerate(sizes):
        shape = [1, 1, 1, 1]
        shape[axis] = size
        indices.append(torch.arange(size, device=query.device).view(shape))
    return (scores, *indices)


def _check_score_mod(
    score_mod: Any, probe: tuple[torch.Tensor, ...], q_len: int, kv_len: int
) -> None:
    scores = probe[0]
    try:
        if isinstance(score_mod, ScoreMod):
            scores, b, h, q, kv = probe
            result = score_mod(scores, b, h, q, kv, q_len, kv_len, torch_xp)
        else:
            result = score_mod(*probe)
    except Exception:  # the kernel's call decides: per element as torch, or the rule's error
        return
    if not isinstance(result, torch.Tensor):  # None, a number: the kernel's own error
        return
    if not result.is_floating_point():
        hint = (
            "a boolean is a mask: give it as block_mask, or return torch.where(condition, "
            "score, -inf)"
            if result.dtype == torch.bool
            else "convert what it adds, e.g. score + (q_idx - kv_idx).to(score.dtype)"
        )
        raise TypeError(
            f"flex_attention: score_mod must return floating-point scores, got {result.dtype} "
            f"of shape {tuple(result.shape)}. Hint: {hint}."
        )
    hint = "no sum, mean or max over the scores: e.g. score + bias[h, q_idx, kv_idx]"
    if isinstance(score_mod, ScoreMod) or result.ndim > scores.ndim:
        return  # a ScoreMod checks itself; chained indexing (bias[b][q_idx]) runs per score
    if not _broadcasts(result, scores):  # the same words as the kernel's, had it seen it
        got = f"an array of shape {tuple(result.shape)}"
        raise ValueError(f"flex_attention: {_returned('score_mod', got, scores)}")
    _same_score_by_score(
        result,
        lambda: _per_element(score_mod, probe),
        "score_mod",
        "scores",
        scores,
        hint,
    )


def _check_mask(
    function: Any,
    name: str,
    each: bool,
    probe: tuple[torch.Tensor, ...],
    q_len: int,
    kv_len: int,
) -> None:
    scores, b, h, q, kv = probe
    if isinstance(function, Mask):
        rule = function

        def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return rule(b, h, q, kv, q_len, kv_len, torch_xp)

    else:
        mask_mod = function
    result = torch.as_tensor(mask_mod(b, h, q, kv))
    if result.dtype != torch.bool:
        raise TypeError(
            f"flex_attention: {name} must return booleans (True = may attend), got "
            f"{result.dtype} of shape {tuple(result.shape)}. Hint: return a comparison such "
            "as q_idx >= kv_idx, or (...) != 0."
        )
    hint = (
        "no any() or all() over the positions, and a table indexed once, table[b, q_idx]: "
        "e.g. (q_idx >= kv_idx) & (kv_idx < n)"
    )
    if not _broadcasts(result, scores):
        raise ValueError(
            f"flex_attention: {name} must give one boolean per score, broadcasting to "
            f"{tuple(scores.shape)}, got shape {tuple(result.shape)}. Hint: {hint}."
        )
    if each:
        _same_score_by_score(
            result,
            lambda: _per_element(lambda s, *index: mask_mod(*index), probe),
            name,
            "positions",
            scores,
            hint,
        )


def _same_score_by_score(
    result: torch.Tensor,
    per_score: Any,
    name: str,
    what: str,
    scores: torch.Tensor,
    hint: str,
) -> None:
    """``result`` (computed on the broadcast probe) equals the probe computed score by
    score, as torch computes it; a function vmap cannot run (data-dependent Python) is
    taken as it is."""
    try:
        each = per_score()
    except Exception:
        return
    whole = result.expand(scores.shape)
    same = each.shape == scores.shape and bool(
        torch.equal(whole, each)
        if each.dtype == torch.bool
        else torch.allclose(whole.to(each.dtype), each, equal_nan=True)
    )
    if same:
        return
    if tuple(result.shape) == tuple(scores.shape):
        came = "other values than one at a time"
    else:
        came = f"shape {tuple(result.shape)}"
    raise ValueError(
        f"flex_attention: {name} must act on each score alone, as torch's flex_attention "
        f"calls it one score at a time; on {what} of shape {tuple(scores.shape)} it returned "
        f"{came}. Hint: {hint}."
    )


def _broadcasts(result: torch.Tensor, scores: torch.Tensor) -> bool:
    got, want = tuple(result.shape), tuple(scores.shape)
    return len(got) <= len(want) and all(
        g in (1, w) for g, w in zip(reversed(got), reversed(want), strict=False)
    )


def _known(function: Any) -> bool:
    try:
        return function in _CHECKED
    except TypeError:  # not weakly referable: checked on every call
        return False


def _remember(function: Any) -> None:
    with contextlib.suppress(TypeError):  # not weakly referable: checked on every call
        _CHECKED[function] = True
