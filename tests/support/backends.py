"""The backends the tests run, from the registry (:data:`qkv.attention.BACKENDS`): a backend
added there is in every parametrisation below, with no list to edit.

A backend that ``compiles`` (its first call of each rule, shape and dtype takes seconds) is
left out of the many-shape tests by default and has a test file of its own on a few shapes
(``flex``: ``tests/kernels/test_flex_masks.py`` and ``test_compiled_cpu.py``, against the
reference). ``tests/core/test_registry.py`` checks that every list of backends in ``tests/``
and ``docs/`` comes from the registry.
"""

from __future__ import annotations

from typing import Any

import qkv
from qkv.attention import BACKENDS


def backend_names(
    *, reference: bool = True, auto: bool = False, compiled: bool = False
) -> tuple[str, ...]:
    """The registered backends in the registry's order (then ``"auto"`` if asked for).

    Args:
        reference: include the reference.
        auto: append ``"auto"``.
        compiled: include backends whose first call of a shape compiles.
    """
    names = tuple(
        name
        for name, backend in BACKENDS.items()
        if (reference or name != "reference") and (compiled or not backend.compiles)
    )
    return (*names, "auto") if auto else names


def accepts(backend: str, query: Any, key: Any, value: Any, **options: Any) -> bool:
    """Whether ``backend`` runs this call (``"auto"`` always does)."""
    if backend == "auto":
        return True
    report = qkv.explain_dispatch(query, key, value, backend=backend, **options)
    return report.refusal is None
