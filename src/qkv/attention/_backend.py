"""What every backend of attention is: the :class:`Backend` record, and what backends share
(the (B, H, L, D) view of a call, the refusals common to PyTorch kernels, memory).

A backend takes a checked :class:`~qkv.attention._options.Call`, says what it refuses (and
why) and runs it. Its facts are fields, read by the plan, the reports, the tests and the
docs, never its name. The registry is :data:`qkv.attention._backends.BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qkv._array import Array, library
from qkv._memory import available_memory as process_memory
from qkv.attention._options import Call
from qkv.masks import Mask

__all__ = [
    "MEMORY_FRACTION",
    "REFERENCE_COPIES",
    "Backend",
    "BackendName",
    "Notes",
    "available_memory",
    "common_refusal",
    "four",
    "four_mask",
    "half_name",
    "itemsize",
    "refusal_error",
    "shape4",
    "size_text",
    "three",
]

BackendName = str
"""``"auto"`` or the name of a backend in the registry (checked when a call is made: the
registry is the one list of names, so the type does not repeat it)."""

MEMORY_FRACTION = 0.25
"""The share of the free memory a backend may fill with (Lq, Lk) matrices (the reference's
steps, a full trace) before auto looks elsewhere."""

REFERENCE_COPIES = 5
"""(Lq, Lk) matrices the reference holds at once: scores, scaled, masked, weights, and
softmax's temporaries."""


@dataclass(frozen=True)
class Notes:
    """What a dispatch report adds when a backend runs a call: its lines, and on CUDA the
    kernel torch picks for it (``Dispatch.sdpa_kernel``)."""

    lines: tuple[str, ...] = ()
    kernel: str | None = None


@dataclass(frozen=True)
class Backend:
    """A backend: its name, a one-line description, what it refuses, how it runs, and the
    facts that the plan, its reports, the tests and the docs read (never its name).

    ``refusal(call, auto)`` returns None when the backend can run the call, else the reason
    in a few words; ``auto`` is True when the choice is the plan's (a backend may then
    refuse calls it could run, but slowly). ``run(call)`` returns (context, weights or
    None).

    Auto's part: ``fast`` backends are tried in the registry's order (the reference is not
    one: auto takes it for NumPy, weights and traces); one whose ``first(call)`` holds is
    tried before the others, and ``why(call)`` is auto's reason when it runs.
    ``on_auto(call)`` sees every call auto plans (flex counts a rule's calls on CPU, to
    compile only for repeated ones).

    Its facts:

    - ``records_steps``: it forms every step of the call through the call's recorder (the
      weights, a trace): auto's choice for NumPy inputs, weights and traces, and the one
      that records the selected rows of a call another backend ran;
    - ``checks_output(call)``: its output of this call is looked at for a NaN or ±inf of a
      masked-out key, and the call redone on the tiled kernel if one got through;
    - ``compiles``: its first call of each (rule, shape, dtype) compiles (seconds), so the
      tests run it on a few shapes rather than on every drawn case;
    - ``half_in``: the dtype it computes float16 and bfloat16 inputs in, the result rounded
      back (within half a unit of the half type); None: it hands them to its kernel as they
      are (within a few units), and ``notes`` say how;
    - ``plans``: a plain torch call it runs is kept as a plan (``_plans.py``) and the next
      call of that signature goes straight to it; ``prepare(call)`` is what it works out
      once per plan, handed to ``run`` as ``call.prepared``;
    - ``runs``: the libraries, devices and dtypes it takes, in words (the kernels page's
      table);
    - ``notes(call)``: what a report adds when it runs the call (:class:`Notes`);
    - ``in_graph(call, auto)``: its form inside a ``torch.compile`` graph (reading no
      value): the result, or why it cannot run the call there; None: it runs outside the
      graph (``_compiled.py``).
    """

    name: str
    description: str
    refusal: Callable[[Call, bool], str | None]
    run: Callable[[Call], tuple[Array, Array | None]]
    why: Callable[[Call], str] = lambda call: "runs this call"
    first: Callable[[Call], bool] | None = None
    on_auto: Callable[[Call], None] | None = None
    fast: bool = True
    records_steps: bool = False
    checks_output: Callable[[Call], bool] = lambda call: False
    compiles: bool = False
    half_in: str | None = "float32"
    plans: bool = False
    prepare: Callable[[Call], Any] | None = None
    runs: str = "PyTorch"
    notes: Callable[[Call], Notes] = lambda call: Notes()
    in_graph: Callable[[Call, bool], tuple[Array, Array | None] | str] | None = None


def common_refusal(call: Call, what: str) -> str | None:
    """Why a PyTorch kernel (``what``) refuses the call: NumPy inputs, weights asked for,
    more than four dimensions; else None."""
    if not call.torch:
        return "needs PyTorch tensors; these are NumPy arrays"
    if call.return_weights:
        return f"weights asked for: {what} never forms them"
    if len(call.lead) > 2:
        return f"{len(call.lead) + 2} dimensions: it takes at most (B, H, L, D)"
    return None


def refusal_error(requested: str, why: str) -> ValueError:
    """The error of asking for a backend that cannot run the call."""
    return ValueError(
        f"backend={requested!r} cannot run this call: {why}. Hint: backend='auto' "
        "picks one that can; qkv.explain_dispatch(...) shows why each is refused."
    )


def half_name(call: Call) -> str | None:
    """ "float16" or "bfloat16" for half-precision inputs, else None."""
    name = str(call.query.dtype).removeprefix("torch.")
    return name if name in ("float16", "bfloat16") else None


# -- memory --------------------------------------------------------------------------------


def available_memory(like: Array) -> int | None:
    """Free memory in bytes where ``like`` lives (None when unknown): the CUDA device's, else
    what this process may still allocate (:func:`qkv._memory.available_memory`)."""
    if library(like) == "torch" and like.device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(like.device)
        return int(free)
    return process_memory()


def itemsize(call: Call) -> int:
    size = getattr(call.query, "itemsize", None)
    if size is None:
        size = call.query.element_size()
    return max(int(size), 4)


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- layouts -------------------------------------------------------------------------------


def four(x: Any, lead: tuple[str, ...]) -> Any:
    """(…lead, L, D) → (B, H, L, D), as a view."""
    if lead == ():
        return x[None, None]
    if lead == ("batch",):
        return x[:, None]
    if lead == ("head",):
        return x[None]
    return x


def shape4(shape: Any, lead: tuple[str, ...]) -> tuple[int, ...]:
    """The (B, H, L, D) shape of an array of ``shape`` with axes (…lead, L, D), as
    :func:`four` views it."""
    dims = tuple(shape)
    if lead == ():
        return (1, 1, *dims)
    if lead == ("batch",):
        return (dims[0], 1, *dims[1:])
    if lead == ("head",):
        return (1, *dims)
    return dims


def three(x: Any, lead: tuple[str, ...]) -> Any:
    """(B, H, L, D) → the caller's layout (the inverse of :func:`four`)."""
    if lead == ():
        return x[0, 0]
    if lead == ("batch",):
        return x[:, 0]
    if lead == ("head",):
        return x[0]
    return x


def four_mask(x: Any, lead: tuple[str, ...]) -> Any:
    """A mask or bias array broadcastable to (…lead, Lq, Lk) → to (B, H, Lq, Lk)."""
    if x is None or isinstance(x, Mask):
        return x
    ndim = len(lead) + 2
    x = x.reshape((1,) * (ndim - x.ndim) + tuple(x.shape))
    return four(x, lead)
