"""Optional dependencies: imported only when a feature needs them, with a clear error if absent.

The core (attention, masks, trace, examples, explain) needs NumPy only. PyTorch, matplotlib and
the like are extras of the package: ``pip install 'qkv[torch]'``, ``'qkv[viz]'``, ``'qkv[all]'``.

Example:
    >>> require("numpy", extra="core", feature="qkv").__name__
    'numpy'
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"torch": "torch", "matplotlib": "viz"}
"""The extra of the package that installs each optional module."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, *, feature: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` for ``feature``, or fail with the pip command that installs it.

    Args:
        module: the module to import, e.g. ``"torch"``.
        feature: what needs it, for the message, e.g. ``"qkv.nn"``.
        extra: the package extra that installs it (default: looked up in :data:`EXTRAS`).

    Raises:
        MissingExtraError: the module cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        name = extra or EXTRAS.get(module.split(".")[0], "all")
        raise MissingExtraError(
            f"{feature} needs {module}, which is not installed. "
            f"Hint: pip install 'qkv[{name}]' (or 'qkv[all]')."
        ) from error
