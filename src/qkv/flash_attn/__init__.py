"""flash-attn 2's public functions on every device torch runs on, exact and differentiable.

Code written for flash-attn calls the same names with the same arguments and layouts;
:func:`install` makes ``import flash_attn`` resolve here (docs/flash_attn.md).
"""

from qkv.flash_attn._functions import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from qkv.flash_attn._install import SERVED, install, installed, uninstall
from qkv.flash_attn._kvcache import apply_rotary, flash_attn_with_kvcache

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
