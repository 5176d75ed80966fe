"""qkv: the attention mechanism, softmax(Q·Kᵀ/√d_k)·V, exact and explained step by step.

The core needs NumPy only and works on NumPy arrays and PyTorch tensors alike.

Example:
    >>> import numpy as np, qkv
    >>> q = k = v = np.eye(2)
    >>> qkv.scaled_dot_product_attention(q, k, v).round(4)
    array([[0.6698, 0.3302],
           [0.3302, 0.6698]])
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from qkv import masks
from qkv._array import DtypeMismatchError
from qkv.attention import (
    explain_dispatch,
    merge_heads,
    multi_head_attention,
    scaled_dot_product_attention,
    self_attention,
    softmax,
    split_heads,
    varlen_attention,
)
from qkv.trace import STEP_NAMES, Step, Trace, current_trace, tracing

try:
    __version__ = version("qkv")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

_SUBMODULES = (
    "examples", "render", "cli", "nn", "positional", "check", "kernels",
    "embeddings", "data", "train", "distributed", "hf", "edits", "flash_attn", "interp",
)  # fmt: skip

_EDITS = ("intervene", "patching", "head_stats", "logit_diff", "prob")
"""Names of ``qkv.edits`` (PyTorch) also reachable as ``qkv.<name>``."""


def __getattr__(name: str) -> Any:
    """``qkv.examples``, ``qkv.render``, ``qkv.cli``, ``qkv.nn``, ``qkv.flash_attn`` (PyTorch)
    and ``qkv.positional`` load on first use, as do ``qkv.flex_attention`` and the interventions
    of ``qkv.edits`` (``qkv.intervene``, ``qkv.patching``, ``qkv.head_stats``, ``qkv.logit_diff``,
    ``qkv.prob``; PyTorch)."""
    if name in _SUBMODULES:
        return import_module(f"qkv.{name}")
    if name == "flex_attention":
        return import_module("qkv.kernels").flex_attention
    if name in _EDITS:
        return getattr(import_module("qkv.edits"), name)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


__all__ = [
    "STEP_NAMES",
    "DtypeMismatchError",
    "Step",
    "Trace",
    "__version__",
    "current_trace",
    "explain_dispatch",
    "flex_attention",
    "head_stats",
    "intervene",
    "logit_diff",
    "masks",
    "merge_heads",
    "multi_head_attention",
    "patching",
    "prob",
    "scaled_dot_product_attention",
    "self_attention",
    "softmax",
    "split_heads",
    "tracing",
    "varlen_attention",
]
