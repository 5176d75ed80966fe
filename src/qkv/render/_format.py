"""The renderers' formatting helpers, kept under their old import path.

They live in :mod:`qkv._format`, below both ``render`` and ``check``; this module re-exports
them for code that imports ``qkv.render._format``.
"""

from __future__ import annotations

from qkv._format import (
    MINUS_INFINITY,
    json_safe,
    latex_escape,
    latex_number,
    latex_visible,
    markdown_escape,
    number,
    visible,
    wrap_equation,
)

__all__ = [
    "MINUS_INFINITY",
    "json_safe",
    "latex_escape",
    "latex_number",
    "latex_visible",
    "markdown_escape",
    "number",
    "visible",
    "wrap_equation",
]
