"""``install()``: make ``import flash_attn`` resolve to ``qkv.flash_attn``, and undo it.

Explicit and reversible: nothing happens on import of qkv. ``install`` registers a module
``flash_attn`` (and ``flash_attn.flash_attn_interface``) in ``sys.modules`` holding qkv's
functions, and remembers what was there; ``uninstall`` puts that back. A real flash-attn
that is installed or already imported is left alone unless ``replace=True``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

from qkv.flash_attn import _functions, _kvcache

__all__ = ["SERVED", "install", "installed", "uninstall"]

_NAMES = ("flash_attn", "flash_attn.flash_attn_interface")
_MARK = "__qkv_flash_attn__"
_saved: dict[str, types.ModuleType | None] = {}


def _served() -> dict[str, Callable[..., Any]]:
    return {name: getattr(_functions, name) for name in _functions.__all__} | {
        "flash_attn_with_kvcache": _kvcache.flash_attn_with_kvcache
    }


SERVED: tuple[str, ...] = (
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
)
"""The functions of flash-attn 2 that :func:`install` serves from qkv."""


def installed() -> bool:
    """Whether ``flash_attn`` in ``sys.modules`` is qkv's (after :func:`install`)."""
    return getattr(sys.modules.get("flash_attn"), _MARK, False) is True


def _real_flash_attn() -> str | None:
    """Where a real flash-attn is (imported or importable), or None."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return None if getattr(module, _MARK, False) else str(getattr(module, "__file__", module))
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return None
    return None if spec is None else str(spec.origin)


def install(*, replace: bool = False) -> tuple[str, ...]:
    """Make ``import flash_attn`` and ``from flash_attn import flash_attn_func`` (also from
    ``flash_attn.flash_attn_interface``) resolve to qkv's functions, until :func:`uninstall`.

    Args:
        replace: shadow a real flash-attn that is installed or imported (off by default:
            on a machine that has it, code should get the real one).

    Returns:
        The names of the functions served (:data:`SERVED`).

    Raises:
        RuntimeError: a real flash-attn is there and ``replace`` is False, in one line.

    Example:
        >>> import qkv.flash_attn
        >>> served = qkv.flash_attn.install()
        >>> from flash_attn import flash_attn_func
        >>> flash_attn_func is qkv.flash_attn.flash_attn_func
        True
        >>> qkv.flash_attn.uninstall()
        >>> import sys; "flash_attn" in sys.modules
        False
    """
    if installed():
        return SERVED
    real = _real_flash_attn()
    if real is not None and not replace:
        raise RuntimeError(
            f"qkv.flash_attn.install: a real flash-attn is installed ({real}); qkv leaves it "
            "in place. Hint: install(replace=True) to run qkv's functions instead."
        )
    functions = _served()
    package = types.ModuleType("flash_attn", "qkv.flash_attn serving flash-attn 2's functions.")
    interface = types.ModuleType("flash_attn.flash_attn_interface", package.__doc__)
    for module in (package, interface):
        # a spec, so that importlib.util.find_spec("flash_attn") answers instead of raising
        module.__spec__ = importlib.machinery.ModuleSpec(
            module.__name__, None, is_package=module is package
        )
        module.__dict__.update(functions)
        module.__dict__["__all__"] = list(SERVED)
        setattr(module, _MARK, True)
    package.__path__ = []  # a package, so that its submodule imports
    package.__version__ = "2.8.4+qkv"  # type: ignore[attr-defined]
    package.flash_attn_interface = interface  # type: ignore[attr-defined]
    for name, module in zip(_NAMES, (package, interface), strict=True):
        _saved[name] = sys.modules.get(name)
        sys.modules[name] = module
    return SERVED


def uninstall() -> None:
    """Undo :func:`install`: ``sys.modules`` holds again what it held before (nothing, or a
    real flash-attn). Does nothing when qkv's is not installed."""
    if not installed():
        return
    for name in _NAMES:
        previous = _saved.pop(name, None)
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
