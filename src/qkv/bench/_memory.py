"""Peak memory of a call, measured by the operating system (PyTorch's CPU tensors live in
ordinary process memory, which ``tracemalloc`` does not see).

On Linux the peak resident set size (``VmHWM`` in ``/proc/self/status``) can be reset by
writing ``5`` to ``/proc/self/clear_refs``: reset, run, read the peak, subtract what was
resident before. Elsewhere, :func:`peak_memory` falls back to ``ru_maxrss`` (a peak over the
process's whole life, so run the call in a fresh process, as ``qkv bench`` does).
"""

from __future__ import annotations

import gc
import re
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["peak_memory", "resident"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        text = _STATUS.read_text(encoding="ascii")
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def resident() -> int:
    """Bytes resident now (``VmRSS``; the lifetime peak where that is unknown)."""
    now = _status_kib("VmRSS")
    if now is not None:
        return now * 1024
    return _max_rss()


def _max_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5", encoding="ascii")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def peak_memory(call: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``call()``; return (the most memory it added at any moment, in bytes; its result).

    Example:
        >>> import numpy as np
        >>> added, _ = peak_memory(lambda: np.ones(25_000_000).sum())  # 200 MB, then freed
        >>> added > 150_000_000  # other threads of the process may free a little meanwhile
        True
    """
    gc.collect()
    exact = _reset_peak()
    before = resident()  # after the reset: the peak starts from this, not from a moment before
    result = call()
    peak_kib = _status_kib("VmHWM") if exact else None
    peak = peak_kib * 1024 if peak_kib is not None else _max_rss()
    return max(0, peak - before), result
