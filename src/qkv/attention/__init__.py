"""The attention algorithm: softmax, scaled dot-product attention, projections and heads.

``scaled_dot_product_attention`` is the readable reference implementation; every fast path in
qkv is tested against it.
"""

from qkv.attention._heads import merge_heads, multi_head_attention, self_attention, split_heads
from qkv.attention._sdpa import scaled_dot_product_attention
from qkv.attention._softmax import softmax

__all__ = [
    "merge_heads",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "self_attention",
    "softmax",
    "split_heads",
]
