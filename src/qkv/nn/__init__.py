"""PyTorch layers over the qkv core: multi-head attention, KV cache, a transformer block.

- :class:`MultiHeadAttention` - batch-first multi-head attention: self and cross, GQA/MQA,
  RoPE or ALiBi, masks with True = may attend, a KV cache for decoding, and
  ``from_torch`` to take over a ``torch.nn.MultiheadAttention`` with its weights.
- :class:`KVCache` - keys and values of the tokens seen so far, optionally a sliding window,
  and with ``track_weights=True`` the attention mass each token received (for eviction).
- :class:`PagedKVCache` - a pool of fixed-size blocks shared by many sequences of different
  lengths (flash-attn's paged layout), allocated as they grow and freed as they end.
- :class:`TransformerBlock` - pre-norm attention and MLP.
- :func:`masks_from_torch` - torch's True = ignore / additive masks to qkv's True = attend.
- :func:`split_sequence` - sequence parallelism: every attention layer of a model runs on
  this rank's share of one sequence with :func:`qkv.distributed.ring_attention`
  (``MultiHeadAttention(sequence_group=...)`` for one layer); see ``docs/distributed.md``.

The modules only project and split heads; the attention is
:func:`qkv.scaled_dot_product_attention`. Inside ``qkv.tracing(model=model, ...)`` they
record their steps under their path in the model.

Example:
    >>> import torch, qkv
    >>> block = qkv.nn.TransformerBlock(16, num_heads=2)
    >>> with qkv.tracing(model=block, heads=[1]) as t:
    ...     _ = block(torch.randn(1, 3, 16))
    >>> t["weights"].layer, t["weights"].shape
    ('attn', (1, 1, 3, 3))
"""

from qkv._extras import require

require("torch", feature="qkv.nn")

from qkv.nn._block import TransformerBlock  # noqa: E402
from qkv.nn._cache import KVCache  # noqa: E402
from qkv.nn._mha import MultiHeadAttention  # noqa: E402
from qkv.nn._paged import PagedKVCache  # noqa: E402
from qkv.nn._sequence import SequenceSplit  # noqa: E402
from qkv.nn._split import split_sequence  # noqa: E402
from qkv.nn._torch import masks_from_torch  # noqa: E402

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "PagedKVCache",
    "SequenceSplit",
    "TransformerBlock",
    "masks_from_torch",
    "split_sequence",
]
