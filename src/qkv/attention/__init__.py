"""The attention algorithm: softmax, scaled dot-product attention, projections and heads.

``reference_attention`` is the readable reference implementation; every fast path in qkv is
tested against it. ``scaled_dot_product_attention`` checks its inputs and runs the reference
or a fast backend (``backend=``); ``explain_dispatch`` says which and why.
"""

from qkv.attention._dispatch import (
    BACKENDS,
    Dispatch,
    dispatch_of_trace,
    explain_dispatch,
    scaled_dot_product_attention,
)
from qkv.attention._heads import merge_heads, multi_head_attention, self_attention, split_heads
from qkv.attention._reference import reference_attention
from qkv.attention._softmax import softmax
from qkv.attention._varlen import varlen_attention

__all__ = [
    "BACKENDS",
    "Dispatch",
    "dispatch_of_trace",
    "explain_dispatch",
    "merge_heads",
    "multi_head_attention",
    "reference_attention",
    "scaled_dot_product_attention",
    "self_attention",
    "softmax",
    "split_heads",
    "varlen_attention",
]
