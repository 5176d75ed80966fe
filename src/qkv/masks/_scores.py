"""Score modifiers: rules that change the scaled scores (ALiBi, soft-capping, your own)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from qkv._array import Array, is_torch_namespace, shape_str
from qkv._array import device as array_device
from qkv.masks._rules import Alignment, check_alignment, diagonal_offset

# (score, b, h, q_idx, kv_idx, q_len, kv_len, xp) -> score, elementwise.
ScoreRule = Callable[[Array, Array, Array, Array, Array, int, int, Any], Array]
# (heads, q_len, kv_len, xp, device, dtype) -> the additive (H, Lq, Lk) array.
DenseBias = Callable[[int, int, int, Any, Any, Any], Array]


class ScoreMod:
    """A change of the scaled scores by a rule on positions: ``score_mod(score, b, h, q, kv)``.

    Applied after the scaling and the ``bias`` and before the mask, on every backend. Chain
    two with :meth:`then`.

    Args:
        rule: ``(score, b, h, q_idx, kv_idx, q_len, kv_len, xp) -> score``, elementwise.
        description: the repr, e.g. ``"softcap(30.0)"``.
        dense_bias: for a modifier that only adds a number to each score (ALiBi):
            ``(heads, q_len, kv_len, xp, device, dtype) -> (H, Lq, Lk)``, the same numbers
            as one additive array (see :meth:`as_bias`).
    """

    def __init__(
        self, rule: ScoreRule, description: str, *, dense_bias: DenseBias | None = None
    ) -> None:
        self._rule = rule
        self._description = description
        self._dense_bias = dense_bias

    @property
    def additive(self) -> bool:
        """Whether the modifier adds a number that depends only on the position (ALiBi):
        it can then be given as an additive ``bias`` array instead (:meth:`as_bias`)."""
        return self._dense_bias is not None

    def as_bias(
        self, heads: int, q_len: int, kv_len: int, *, xp: Any, device: Any = None, dtype: Any
    ) -> Array:
        """The additive (H, Lq, Lk) array of an :attr:`additive` modifier.

        Example:
            >>> import numpy as np
            >>> alibi([0.5]).as_bias(1, 1, 3, xp=np, dtype=np.float64)
            array([[[-1. , -0.5,  0. ]]])
        """
        if self._dense_bias is None:
            raise TypeError(
                f"{self!r} is not additive, so it has no bias array. Hint: pass it as "
                "score_mod=..., which every backend but sdpa takes."
            )
        return self._dense_bias(heads, q_len, kv_len, xp, device, dtype)

    def __repr__(self) -> str:
        return self._description

    def __call__(
        self,
        score: Array,
        b: Array,
        h: Array,
        q_idx: Array,
        kv_idx: Array,
        q_len: int,
        kv_len: int,
        xp: Any,
    ) -> Array:
        """Apply the rule to scores laid out as the broadcast of the index arrays.

        Raises:
            ValueError: the rule returned no scores (None, a number, an array that does not
                broadcast to the scores' shape), in one line that names what it returned.
        """
        result = self._rule(score, b, h, q_idx, kv_idx, q_len, kv_len, xp)
        problem = _not_scores(result, score)
        if problem is not None:
            raise ValueError(_returned(self._description, problem, score))
        return result

    def then(self, other: ScoreMod) -> ScoreMod:
        """This modifier, then ``other`` on its result.

        Example:
            >>> alibi([0.5]).then(softcap(20.0))
            alibi([0.5], alignment='bottom-right').then(softcap(20.0))
        """
        if not isinstance(other, ScoreMod):
            raise TypeError(
                f"ScoreMod.then expects another ScoreMod, got {type(other).__name__}. Hint: "
                "wrap a function with qkv.masks.score_function(fn)."
            )
        return ScoreMod(
            lambda s, *a: other(self(s, *a), *a), f"{self._description}.then({other!r})"
        )


def score_function(
    score_mod: Callable[[Array, Array, Array, Array, Array], Array], name: str = ""
) -> ScoreMod:
    """A score modifier from your own rule ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

    The rule is called on whole blocks of scores with index arrays that broadcast against
    them (``b`` of shape (B, 1, 1, 1), ``q_idx`` (1, 1, Lq, 1), ...), which is fast for
    elementwise code (arithmetic, ``where``, ``tanh``, ``table[q_idx - kv_idx]``,
    ``bias[b, h, q_idx, kv_idx]``). On PyTorch tensors, a rule written for torch's
    FlexAttention, which calls it on one element at a time, works as well: when the rule
    fails on the broadcast arrays or returns the wrong shape (chained indexing such as
    ``bias[b][q_idx]`` does both), qkv calls it per element as torch does (``torch.vmap``
    over each axis), slower but the same numbers. Gradients flow through it to the queries,
    the keys and the tensors it captures.

    Example:
        >>> import numpy as np
        >>> halve = score_function(lambda s, b, h, q, kv: s / 2, "halve")
        >>> halve(np.array([[2.0]]), 0, 0, np.zeros((1, 1)), np.zeros((1, 1)), 1, 1, np)
        array([[1.]])
    """
    label = name or getattr(score_mod, "__name__", "score_mod")
    description = f"score_function({label})"
    per_element = False  # set once the rule is found not to broadcast

    def rule(s: Array, b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        nonlocal per_element
        arrays = (s, b, h, q, kv)
        if per_element:
            return _per_element(score_mod, arrays)
        failure: Exception | None = None
        try:
            result = score_mod(s, b, h, q, kv)
        except Exception as error:  # the rule's own error, unless it works per element
            failure = error
        else:
            problem = _not_scores(result, s)
            if problem is None:
                return result
            if not hasattr(result, "shape"):  # None, a number: no evaluation gives scores
                raise ValueError(_returned(description, problem, s))
        found = None
        if is_torch_namespace(xp):
            with contextlib.suppress(Exception):  # the error to show is the first one
                found = _per_element(score_mod, arrays)
        if found is None or _not_scores(found, s) is not None:
            if isinstance(failure, IndexError) and not is_torch_namespace(xp):
                raise ValueError(
                    f"{description} failed on broadcast index arrays ({failure}), and "
                    "NumPy arrays cannot be evaluated one element at a time. Hint: index a "
                    "table once, bias[b, q_idx] rather than bias[b][q_idx], or pass PyTorch "
                    "tensors."
                ) from failure
            if failure is not None:
                raise failure
            raise ValueError(_returned(description, _not_scores(result, s) or "", s, xp))
        per_element = True
        return found

    return ScoreMod(rule, description)


def _not_scores(result: object, score: Array) -> str | None:
    """What is wrong with a score modifier's result (None: it is scores): it must be an array
    that broadcasts to the scores' shape."""
    shape = getattr(result, "shape", None)
    if shape is None or not hasattr(result, "dtype"):
        return f"{type(result).__name__} {result!r}"[:80] if result is not None else "None"
    want = tuple(int(n) for n in score.shape)
    got = tuple(int(n) for n in shape)
    fits = len(got) <= len(want) and all(
        g in (1, w) for g, w in zip(reversed(got), reversed(want), strict=False)
    )
    return None if fits else f"an array of shape {shape_str(got)}"


def _returned(description: str, problem: str, score: Array, xp: Any = None) -> str:
    hint = "return an expression of score, e.g. score + bias[h] or where(q_idx >= kv_idx, "
    hint += "score, -inf)"
    numpy = xp is not None and not is_torch_namespace(xp)
    if numpy and problem.startswith("an array"):  # what a table indexed twice gives there
        hint = "index a table once, bias[b, q_idx] rather than bias[b][q_idx]"
    return (
        f"score_mod must return the modified scores, an array that broadcasts to the scores' "
        f"shape {shape_str(tuple(int(n) for n in score.shape))}; {description} returned "
        f"{problem}. Hint: {hint}."
    )


def _per_element(fn: Callable[..., Any], arrays: tuple[Array, ...]) -> Array:
    """``fn`` called on every element alone, as torch's FlexAttention calls a score_mod: one
    ``torch.vmap`` per axis of the scores (outermost first), each over the arguments that
    vary along that axis, so each call sees 0-d tensors and chained indexing
    (``bias[b][q_idx]``) reads one entry. An index array enters only the levels of its own
    axes, so ``bias[b]`` gathers B rows, not one per score."""
    import torch

    tensors = [torch.as_tensor(x) for x in arrays]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))  # type: ignore[no-untyped-call]
    ndim = len(shape)
    reduced, axes = [], []
    for i, t in enumerate(tensors):
        t = t.reshape((1,) * (ndim - t.ndim) + tuple(t.shape))
        # the scores enter every level of their size; an index array only where it varies
        own = [d for d in range(ndim) if t.shape[d] == shape[d] and (i == 0 or shape[d] > 1)]
        reduced.append(t.reshape([int(t.shape[d]) for d in own]))
        axes.append(own)
    mapped = fn
    for d in reversed(range(ndim)):
        in_dims = tuple(0 if d in own else None for own in axes)
        mapped = torch.vmap(mapped, in_dims=in_dims)
    return mapped(*reduced)


def as_score_mod(score_mod: ScoreMod | Callable[..., Any] | None) -> ScoreMod | None:
    """A ScoreMod from a ScoreMod or a plain ``fn(score, b, h, q_idx, kv_idx)`` (None stays
    None); anything else is a TypeError that says what was expected."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if callable(score_mod):
        return score_function(score_mod)
    raise TypeError(
        f"score_mod must be a qkv.masks.ScoreMod or a function (score, b, h, q_idx, kv_idx) "
        f"-> score, got {type(score_mod).__name__}. Hint: qkv.masks.softcap(30.0), or "
        "lambda score, b, h, q, kv: score - (q - kv).abs() * 0.1."
    )


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi slope m_h of each head: a geometric sequence, 2^(−8/H), 2^(−16/H), ...

    For a power of two H the slopes are ``2^(−8·(h+1)/H)``. For other head counts (as in the
    paper's reference code) the slopes of the largest power of two n < H come first, followed
    by every other slope of 2n, so that the slopes stay spread between 0 and 1.

    Args:
        num_heads: H ≥ 1.

    Returns:
        H floats, the slope of head 0 first (the steepest).

    Example:
        >>> alibi_slopes(8)[:3]
        [0.5, 0.25, 0.125]
        >>> [round(m, 4) for m in alibi_slopes(6)]
        [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(
            f"num_heads must be a positive integer, got {num_heads!r}. "
            "Hint: ALiBi gives each attention head its own slope, e.g. alibi_slopes(8)."
        )

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    closest = 1 << (num_heads.bit_length() - 1)  # the largest power of two ≤ H
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return slopes


def alibi(slopes: int | Sequence[float], *, alignment: Alignment = "bottom-right") -> ScoreMod:
    """ALiBi (Press et al. 2022) as a score modifier: ``score − m_h · |(i + offset) − j|``.

    The same numbers as :func:`qkv.positional.alibi_bias`, computed block by block instead
    of as an (H, Lq, Lk) array.

    Args:
        slopes: the number of heads H (slopes from :func:`alibi_slopes`), or
            one slope m_h per head.
        alignment: where query 0 sits among the keys: ``"bottom-right"`` (offset Lk − Lq,
            the queries are the last positions, as with a KV cache; the default, as in
            ``alibi_bias``) or ``"top-left"`` (offset 0).

    Example:
        >>> import numpy as np
        >>> rule = alibi([0.5])
        >>> q, kv = np.arange(2).reshape(2, 1), np.arange(3).reshape(1, 3)
        >>> rule(np.zeros((2, 3)), 0, 0, q, kv, 2, 3, np)
        array([[-0.5,  0. , -0.5],
               [-1. , -0.5,  0. ]])
    """
    check_alignment(alignment)
    if isinstance(slopes, int):
        values = alibi_slopes(slopes)
    else:
        values = [float(m) for m in slopes]
        if not values or not all(math.isfinite(m) for m in values):
            raise ValueError(
                f"alibi: slopes must be finite numbers, one per head, got {values!r}. "
                "Hint: alibi(8) uses the paper's slopes for 8 heads."
            )

    def rule(s: Array, b: Array, h: Array, q: Array, kv: Array, lq: int, lk: int, xp: Any) -> Array:
        if getattr(h, "ndim", 0) == 4 and int(h.shape[1]) > len(values):
            raise ValueError(
                f"alibi has {len(values)} slopes but the scores have {h.shape[1]} heads. "
                "Hint: give one slope per query head, e.g. alibi(num_heads)."
            )
        table = xp.asarray(values, dtype=s.dtype, device=array_device(s))
        slope = table[h]
        distance = xp.abs(q + diagonal_offset(alignment, lq, lk) - kv)
        return s - slope * xp.astype(distance, s.dtype)

    def dense(heads: int, lq: int, lk: int, xp: Any, device: Any, dtype: Any) -> Array:
        if heads > len(values):
            raise ValueError(
                f"alibi has {len(values)} slopes but the scores have {heads} heads. "
                "Hint: give one slope per query head, e.g. alibi(num_heads)."
            )
        offset = diagonal_offset(alignment, lq, lk)
        return alibi_table(values[:heads], lq, lk, offset, xp=xp, device=device, dtype=dtype)

    return ScoreMod(rule, f"alibi({_short(values)}, alignment={alignment!r})", dense_bias=dense)


def alibi_table(
    slopes: Sequence[float],
    q_len: int,
    kv_len: int,
    offset: int,
    *,
    xp: Any,
    device: Any,
    dtype: Any,
) -> Array:
    """``−m_h · |(i + offset) − j|`` as an (H, Lq, Lk) array (what
    :func:`qkv.positional.alibi_bias` returns; checked arguments)."""
    query_pos = xp.reshape(xp.arange(q_len, device=device), (1, q_len, 1)) + offset
    key_pos = xp.reshape(xp.arange(kv_len, device=device), (1, 1, kv_len))
    distance = xp.astype(-xp.abs(query_pos - key_pos), dtype)  # −|i − j|: (1, Lq, Lk)
    m = xp.reshape(xp.asarray(list(slopes), dtype=dtype, device=device), (len(slopes), 1, 1))
    return m * distance  # (H, Lq, Lk)


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): ``cap · tanh(score / cap)``, scores within ±cap.

    Example:
        >>> import numpy as np
        >>> softcap(1.0)(np.array([0.0, 100.0]), 0, 0, 0, 0, 1, 1, np).round(4)
        array([0., 1.])
    """
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf:
        raise ValueError(
            f"softcap: cap must be a positive finite number, got {cap!r}. "
            "Hint: Gemma 2 uses softcap(50.0) on the attention scores."
        )
    cap = float(cap)
    return ScoreMod(lambda s, b, h, q, kv, lq, lk, xp: xp.tanh(s / cap) * cap, f"softcap({cap})")


def _short(values: list[float]) -> str:
    shown = ", ".join(f"{m:.4g}" for m in values[:4])
    return f"[{shown}{', ...' if len(values) > 4 else ''}]"
