"""PyTorch fast paths for attention: torch's fused SDPA, and the tiled O(L)-memory kernel.

- :func:`tiled_attention`: the FlashAttention algorithm in plain PyTorch operations, forward
  and backward (a custom ``torch.autograd.Function`` that keeps only q, k, v, the output and
  the log-sum-exp), with GQA, bias, dropout, score modifiers and masks whose empty blocks are
  skipped.
- :func:`flex_attention`: torch's FlexAttention signature (``BlockMask``, ``score_mod``) on
  the tiled kernel, with a CPU backward.
- :func:`sdpa_attention`: ``torch.nn.functional.scaled_dot_product_attention`` given qkv's
  masks and policies.
- :func:`tiled_in_graph`: the tiled kernel inside a ``torch.compile`` graph, as one
  operator (``qkv::tiled_attention``) whose inside runs eagerly.
- :func:`set_thread_mode`: how the tiled kernel uses several threads (PyTorch's own, or a
  pool of its own for machines busy with other work).

Most code calls them through :func:`qkv.scaled_dot_product_attention` with
``backend="tiled"``, ``"sdpa"`` or ``"auto"``, which checks the arguments and explains its
choice (:func:`qkv.explain_dispatch`). This package needs PyTorch (``pip install
'qkv[torch]'``).
"""

from qkv.kernels._api import as_score_mod, huge_bias, tiled_attention
from qkv.kernels._blocks import BlockPlan, plan_blocks
from qkv.kernels._flex import flex_attention
from qkv.kernels._threads import get_thread_mode, set_thread_mode
from qkv.kernels._tiled_ops import tiled_in_graph
from qkv.kernels._torch_sdpa import dense_mask_elements, sdpa_attention

__all__ = [
    "BlockPlan",
    "as_score_mod",
    "dense_mask_elements",
    "flex_attention",
    "get_thread_mode",
    "huge_bias",
    "plan_blocks",
    "sdpa_attention",
    "set_thread_mode",
    "tiled_attention",
    "tiled_in_graph",
]
