"""Attention masks and score modifiers: which keys each query may attend, and how much.

A :class:`Mask` is a rule ``mask_mod(b, h, q_idx, kv_idx) -> bool`` evaluated on broadcast
index arrays (**True = may attend**), so it costs nothing until attention needs it and works for
any sequence length. Masks combine with ``&`` (both allow), ``|`` (either allows) and ``~`` (the
opposite)::

    causal() & key_padding([3, 5])      # causal, and never the padding after each length

Any boolean array works as a mask as well. Masks from other conventions convert with
:func:`from_ignore` (``torch.nn.MultiheadAttention``'s True = ignore) and :func:`from_additive`
(0 / −inf additive masks); :func:`to_additive` goes the other way.

Causal alignment matters when the query and key lengths differ (Lq ≠ Lk):

- ``"top-left"``: query i sees keys 0 … i (PyTorch's ``is_causal``);
- ``"bottom-right"``: the last query sees every key, query i sees keys 0 … i + (Lk − Lq); this
  is the one for decoding with a KV cache, where the new queries are the last positions.

**Block structure.** The built-in masks also know, without looking at any element, which
blocks of the (Lq, Lk) matrix they leave empty or full (:meth:`Mask.blocks`): the tiled kernel
(:mod:`qkv.kernels`) skips empty blocks and does not evaluate the mask on full ones. A mask of
your own may give the same hint (``from_function(..., blocks=...)``).

:data:`RULES` is the registry of the rules a user makes (``causal``, ``sliding_window``, …),
by name.

**Score modifiers.** A :class:`ScoreMod` is a rule ``score_mod(score, b, h, q_idx, kv_idx)``
applied to the scaled scores (after ``bias``, before the mask): :func:`alibi`, :func:`softcap`,
or your own with :func:`score_function`.

Example:
    >>> from qkv import masks
    >>> m = masks.causal() & masks.key_padding([2])
    >>> m
    causal('top-left') & key_padding([2])
    >>> m.dense(3, 3).astype(int)[0, 0]
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 0]])
    >>> m.blocks(4, 4, 2, 2)[0, 0]       # 2×2 blocks: 0 empty, 1 partial, 2 full
    array([[1, 0],
           [2, 0]], dtype=int8)
"""

from qkv.masks._builtin import (
    RULES,
    causal,
    document,
    from_function,
    full,
    key_padding,
    prefix_lm,
    sliding_window,
    with_causal,
)
from qkv.masks._convert import from_additive, from_ignore, to_additive
from qkv.masks._dropout import draw_seed, dropout_keep
from qkv.masks._rules import (
    ALIGNMENTS,
    EMPTY,
    FULL,
    PARTIAL,
    Alignment,
    BlockRule,
    Mask,
    Rule,
    RuleCache,
    check_alignment,
)
from qkv.masks._scores import ScoreMod, alibi, alibi_slopes, score_function, softcap

__all__ = [
    "ALIGNMENTS",
    "EMPTY",
    "FULL",
    "PARTIAL",
    "RULES",
    "Alignment",
    "BlockRule",
    "Mask",
    "Rule",
    "RuleCache",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "causal",
    "check_alignment",
    "document",
    "draw_seed",
    "dropout_keep",
    "from_additive",
    "from_function",
    "from_ignore",
    "full",
    "key_padding",
    "prefix_lm",
    "score_function",
    "sliding_window",
    "softcap",
    "to_additive",
    "with_causal",
]
