"""The backends of attention, one registry: :data:`BACKENDS`.

    reference   the readable reference (``_reference.py``), NumPy or PyTorch; forms every step
    sdpa        torch.nn.functional.scaled_dot_product_attention (fused, no (Lq, Lk) matrix
                unless a mask or bias has to be passed as one): ``_backend_sdpa.py``
    flex        torch's FlexAttention under torch.compile: qkv's mask rules as cached block
                masks, score modifiers as its score_mod; on CPU, where torch has no
                backward, trained with the tiled kernel's backward (auto: on CUDA for mask
                rules, on CPU for mask rules called again with one shape): ``_backend_flex.py``
    tiled       qkv.kernels.tiled_attention (O(L) memory, masks skip empty blocks):
                ``_backend_tiled.py``

The names a call accepts, the reports of ``explain_dispatch``, the order auto tries them in
and the tests' parametrisations (``tests/support/backends.py``) come from :data:`BACKENDS`.
Adding a backend is one module with its :class:`~qkv.attention._backend.Backend` and one
entry here.
"""

from __future__ import annotations

from qkv.attention import _backend
from qkv.attention._backend import (
    MEMORY_FRACTION,
    REFERENCE_COPIES,
    Backend,
    BackendName,
    itemsize,
    size_text,
)
from qkv.attention._backend_flex import FLEX
from qkv.attention._backend_sdpa import SDPA
from qkv.attention._backend_tiled import TILED
from qkv.attention._options import Call
from qkv.attention._reference import attend_call

__all__ = ["BACKENDS", "Backend", "BackendName", "name_width", "planned", "stepwise"]


def _reference_refusal(call: Call, auto: bool) -> str | None:
    need = call.scores_elements() * itemsize(call) * REFERENCE_COPIES
    free = _backend.available_memory(call.query)
    if free is not None and need > free * MEMORY_FRACTION:
        return (
            f"would form (Lq, Lk) matrices of {size_text(need)}, too much for "
            f"{size_text(free)} free"
        )
    if auto and call.torch and not call.return_weights and call.recorder.trace is None:
        return "slower than the fused kernels when neither weights nor a trace are asked for"
    return None


REFERENCE = Backend(
    "reference",
    "the readable reference; forms every step",
    _reference_refusal,
    attend_call,
    fast=False,
    records_steps=True,
    runs="NumPy and PyTorch",
)

BACKENDS: dict[str, Backend] = {b.name: b for b in (REFERENCE, SDPA, FLEX, TILED)}
"""The registered backends: the names a call accepts, the rows of a dispatch report, and
the order auto tries the fast ones in (a backend whose ``first(call)`` holds goes first)."""


def stepwise() -> str:
    """The name of the backend that forms every step (the first that ``records_steps``)."""
    return next(name for name, b in BACKENDS.items() if b.records_steps)


def planned() -> str:
    """The name of the backend whose plain calls are kept as plans (``plans``)."""
    return next(name for name, b in BACKENDS.items() if b.plans)


def name_width() -> int:
    """The width of the name column of a dispatch report: the registry's longest name."""
    return max(len(name) for name in BACKENDS)
