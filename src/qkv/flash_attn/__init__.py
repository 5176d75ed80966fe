"""flash-attn 2's public functions on every device torch runs on, exact and differentiable.

Code written for flash-attn calls the same names with the same arguments and layouts;
:func:`install` makes ``import flash_attn`` resolve here (docs/flash_attn.md).
"""

import torch

from qkv.flash_attn import _kvcache
from qkv.flash_attn._functions import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from qkv.flash_attn._install import SERVED, install, installed, uninstall
from qkv.flash_attn._kvcache import apply_rotary

flash_attn_with_kvcache = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _kvcache.flash_attn_with_kvcache,
    reason="flash_attn_with_kvcache reads cache_seqlens to place the new keys, and writes "
    "the cache in place: it runs outside the compiled graph",
)
"""flash-attn's decoding call (:func:`qkv.flash_attn._kvcache.flash_attn_with_kvcache`); under
``torch.compile`` it runs outside the graph (``fullgraph=True`` says why)."""

__all__ = [
    "SERVED",
    "apply_rotary",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "installed",
    "uninstall",
]
