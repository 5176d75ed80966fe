"""The probes of ``--kind flash`` and what the student's FlashAttention gave on them.

:func:`flash_probes` are float32-exact inputs (module help of :mod:`~qkv.check._flash`);
:func:`call_probe` calls a function or an autograd Function on one in this process, and
:func:`remote` does it through the student's sandboxed process; either gives a :class:`Got`
(O, L found among what it returned or saved, the gradients of its own backward, or the
error), which :mod:`~qkv.check._flash` judges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from qkv.check._flash_slips import oracle
from qkv.check._function_file import FlashCall, FlashCallError
from qkv.check._function_run import raised

__all__ = [
    "CONTRACTS",
    "FlashProbe",
    "Got",
    "call_probe",
    "flash_probes",
    "has_backward",
    "is_autograd",
    "remote",
]

Array = NDArray[np.float64]

CONTRACTS: dict[str, str] = {
    "full": "every probe: causal and not, any length, n_q ≠ n_k, several heads",
    "cs336": "CS336 part (a): is_causal may be ignored; (batch, n, d) with power-of-2 lengths ≥ 16",
}
"""The assignments' contracts ``--contract`` names; nothing outside one is marked wrong."""


@dataclass(frozen=True)
class FlashProbe:
    """One input: its name, Q, K, V and dO (float64 values exact in float32), causal."""

    name: str
    q: Array
    k: Array
    v: Array
    d_out: Array
    causal: bool

    @property
    def label(self) -> str:
        """The name with Q's and K's shapes."""
        shape = tuple(self.q.shape)
        if self.k.shape != self.q.shape:
            return f"{self.name}, Q {shape}, K {tuple(self.k.shape)}"
        return f"{self.name}, Q {shape}"

    def in_contract(self, contract: str) -> bool:
        """Whether the assignment's contract covers it."""
        if contract == "full":
            return True
        n_q, n_k = self.q.shape[-2], self.k.shape[-2]
        power = all(n >= 16 and n & (n - 1) == 0 for n in (n_q, n_k))
        return power and not self.causal and self.q.ndim == 3


def _draw(rng: np.random.Generator, *shape: int) -> Array:
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


def flash_probes() -> tuple[FlashProbe, ...]:
    """The probes, small first (the slips are tried on them in this order)."""
    rng = np.random.default_rng(37)

    def probe(name: str, b: tuple[int, ...], nq: int, nk: int, d: int, causal: bool) -> FlashProbe:
        q, k, v = _draw(rng, *b, nq, d), _draw(rng, *b, nk, d), _draw(rng, *b, nk, d)
        return FlashProbe(name, q, k, v, _draw(rng, *b, nq, d), causal)

    jump = probe("scores that jump by 1000 at key 128", (1,), 256, 256, 16, False)
    jump.q[..., 0] = 50.0
    jump.k[..., 0] = np.where(np.arange(256) >= 128, 80.0, 0.0)
    return (
        probe("n_q = 20, n_k = 100", (2,), 20, 100, 16, False),
        probe("a last block of one row", (2,), 65, 65, 16, False),
        probe("a length not a multiple of the block", (2,), 100, 100, 16, False),
        probe("several heads, causal", (1, 2), 80, 80, 16, True),
        probe("causal, a last block of one row", (2,), 97, 97, 16, True),
        probe("the course's shape", (2,), 128, 128, 64, False),
        probe("causal, d = 64", (1,), 130, 130, 64, True),
        jump,
    )


@dataclass
class Got:
    out: Array | None = None
    lse: Array | None = None
    grads: tuple[Array, Array, Array] | None = None
    error: str | None = None
    backward_error: str | None = None


def _numpy(value: Any) -> Array:
    return np.asarray(value.detach().cpu().to(dtype=_torch().float64).numpy(), dtype=np.float64)


def _torch() -> Any:
    import torch

    return torch


def is_autograd(fn: Any) -> bool:
    torch = _torch()
    return isinstance(fn, type) and issubclass(fn, torch.autograd.Function)


def has_backward(fn: Any) -> bool:
    torch = _torch()
    own = getattr(fn, "backward", None)
    return own is not None and own is not getattr(torch.autograd.Function, "backward", None)


def _saved_lse(out: Any, probe: FlashProbe) -> Array | None:
    """L among the saved tensors of O's ``ctx``: the one of shape (batch[, heads], n_q)
    closest to the oracle's."""
    saved = getattr(getattr(out, "grad_fn", None), "saved_tensors", ())
    return _best_lse([_numpy(t) for t in saved], probe)


def _best_lse(candidates: Sequence[Array], probe: FlashProbe) -> Array | None:
    """The candidate for L of shape (batch[, heads], n_q) closest to the oracle's."""
    want = oracle(probe.q, probe.k, probe.v, causal=probe.causal)[1]
    best: tuple[float, Array] | None = None
    for got in candidates:
        if got.shape != want.shape:
            continue
        with np.errstate(invalid="ignore"):
            gap = float(np.nanmax(np.abs(got - want))) if np.isfinite(got).any() else math.inf
        if best is None or gap < best[0]:
            best = (gap, got)
    return None if best is None else best[1]


def call_probe(fn: Any, probe: FlashProbe, autograd: bool, grads: bool) -> Got:
    torch = _torch()
    inputs = [
        torch.tensor(x, dtype=torch.float32, requires_grad=autograd)
        for x in (probe.q, probe.k, probe.v)
    ]
    try:
        result = fn.apply(*inputs, probe.causal) if autograd else fn(*inputs, probe.causal)
    except Exception as exc:  # the student's code may raise anything
        return Got(error=f"raised {raised(exc)}")
    out = result[0] if isinstance(result, tuple | list) and result else result
    if not isinstance(out, torch.Tensor):
        return Got(error=f"returned {type(result).__name__}, not a tensor")
    got = Got(out=_numpy(out))
    if isinstance(result, tuple | list) and len(result) > 1 and not autograd:
        lse = result[1]
        got.lse = _numpy(lse) if isinstance(lse, torch.Tensor) else None
    elif autograd:
        got.lse = _saved_lse(out, probe)
    if grads and out.requires_grad:
        try:
            out.backward(torch.tensor(probe.d_out, dtype=torch.float32))
            found = [x.grad for x in inputs]
            if all(g is not None for g in found):
                got.grads = (_numpy(found[0]), _numpy(found[1]), _numpy(found[2]))
        except NotImplementedError:
            pass  # part (a): no backward yet
        except Exception as exc:  # the student's backward may raise anything
            got.backward_error = f"raised {raised(exc)} in backward"
    return got


def remote(call: FlashCall) -> Callable[[FlashProbe], Got]:
    """The probes' calls through the student's sandboxed process."""

    def run(probe: FlashProbe) -> Got:
        try:
            reply = call([probe.q, probe.k, probe.v, probe.d_out], probe.causal)
        except FlashCallError as error:
            return Got(error=str(error))
        raised_back = reply.backward_raised
        return Got(
            out=reply.out,
            lse=_best_lse(reply.lse, probe),
            grads=reply.grads,
            backward_error=None if raised_back is None else f"raised {raised_back} in backward",
        )

    return run
