"""The JSON renderer: the trace itself, every step with its numbers, formula and axes."""

from __future__ import annotations

from qkv._format import json_safe
from qkv.trace import Trace

__all__ = ["json"]


def json(trace: Trace) -> str:
    """The trace as indented JSON (``Trace.from_json`` reads it back).

    Masked scores (−inf) are written as the string ``"-inf"``, so the file is strict JSON.
    Control characters and bidirectional overrides in tokens are written as ``\\uXXXX``
    escapes: the same strings when read back, inert when printed to a terminal.

    Example:
        >>> import numpy as np, qkv
        >>> with qkv.tracing() as t:
        ...     _ = qkv.self_attention(np.eye(2), np.eye(2), np.eye(2), np.eye(2))
        >>> qkv.Trace.from_json(json(t)).names == t.names
        True
    """
    return json_safe(trace.to_json(indent=2)) + "\n"
