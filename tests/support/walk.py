"""The walk of the query through qkv: which functions of qkv receive it, in order.

A *stop* is a call of a function defined in qkv's source whose arguments hold the query
or a view of it (a tensor on its storage, a NumPy array sharing its memory), directly, in
a tuple or list, or in a field of an object (a dataclass, a named tuple) such as the checked
``Call``. A stop in ``kernels/`` or in the reference (``attention/_reference.py``) is the
math: what runs inside it is the kernel's own, and not counted. A *return* is a stop in
a module the walk had already left. ``docs/architecture.md``
("How one call flows") states the counts that ``tests/core/test_walk.py`` keeps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

import qkv

ROOT = Path(qkv.__file__).parent


@dataclass(frozen=True)
class Walk:
    """The stops of one call: (module path relative to src/qkv, function name) each."""

    stops: tuple[tuple[str, str], ...]

    @property
    def modules(self) -> list[str]:
        """The modules in the order the walk enters them (a module again after a return)."""
        entered: list[str] = []
        for module, _ in self.stops:
            if not entered or entered[-1] != module:
                entered.append(module)
        return entered

    @property
    def returns(self) -> int:
        """Stops in a module the walk had already left."""
        left: set[str] = set()
        count = 0
        entered = self.modules
        for before, module in pairwise(entered):
            left.add(before)
            count += module in left
        return count

    def entries(self, module: str) -> int:
        """How many times the walk enters ``module``."""
        return self.modules.count(module)

    def __str__(self) -> str:
        lines = [f"{m}:{f}" for m, f in self.stops]
        return "\n".join([*lines, f"{len(self.stops)} stops, {self.returns} returns"])


def _holds(value: Any, query: Any) -> bool:
    if value is query:
        return True
    if isinstance(value, torch.Tensor) and isinstance(query, torch.Tensor):
        if value.is_nested or query.is_nested or value.device != query.device:
            return False
        return bool(value.untyped_storage().data_ptr() == query.untyped_storage().data_ptr())
    if isinstance(value, np.ndarray) and isinstance(query, np.ndarray):
        return bool(np.shares_memory(value, query))
    return False


def _carries(value: Any, query: Any, depth: int = 0) -> bool:
    if _holds(value, query):
        return True
    if depth >= 2:
        return False
    if isinstance(value, (tuple, list)):
        return any(_carries(v, query, depth + 1) for v in value[:8])
    fields = getattr(value, "__dataclass_fields__", None) or getattr(value, "_fields", None)
    if fields and not isinstance(value, type):
        return any(_carries(getattr(value, f, None), query, depth + 1) for f in fields)
    return False


def walk(run: Callable[[], Any], query: Any) -> Walk:
    """The stops of the query while ``run()`` runs (a call that receives ``query``)."""
    stops: list[tuple[str, str]] = []
    root = str(ROOT)

    math = tuple(str(ROOT / m) for m in MATH)

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        caller = frame.f_back
        while caller is not None:  # inside the math: the kernel's own
            if caller.f_code.co_filename.startswith(math):
                return
            caller = caller.f_back
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
        for name in code.co_varnames[:count]:
            if _carries(frame.f_locals.get(name), query):
                module = str(Path(code.co_filename).relative_to(ROOT))
                stops.append((module, code.co_name))
                return

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(previous)
    return Walk(tuple(stops))


MATH = ("kernels/", "attention/_reference.py")
"""Where the walk ends: the kernels and the reference compute the math."""
