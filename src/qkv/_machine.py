"""What this machine has, for checks made before allocating: its memory.

Example:
    >>> memory_bytes() > 0
    True
"""

from __future__ import annotations

import os

__all__ = ["memory_bytes"]


def memory_bytes() -> int:
    """The machine's physical memory, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
