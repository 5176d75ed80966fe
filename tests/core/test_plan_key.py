"""Every field of the plan key counts: change one, and the call gets a plan of its own.

A plain call repeated with one signature runs the plan of its first call
(``attention/_plans.py``). A fact of the call missing from the key would let a call run the
plan of another: dropping ``causal_alignment`` from the key once passed every plan test. The
fields come from the key's definition (``PlanKey._fields``); a field without a change here
fails the guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

import qkv
from qkv.attention._plans import PLANS, PlanKey, plain_signature


@dataclass(frozen=True)
class Spec:
    """One call: its tensors' shapes, dtypes, devices and gradient flags, its options."""

    shapes: tuple[tuple[int, ...], ...] = ((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    dtypes: tuple[torch.dtype, ...] = (torch.float64,) * 3
    devices: tuple[str, ...] = ("cpu",) * 3
    grads: tuple[bool, ...] = (False,) * 3
    grad_mode: bool = True
    options: dict[str, Any] = field(
        default_factory=lambda: {
            "is_causal": True,
            "causal_alignment": "bottom-right",
            "scale": None,
            "enable_gqa": False,
            "backend": "auto",
        }
    )

    def tensors(self, seed: int = 0) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for shape, dtype, device, grad in zip(
            self.shapes, self.dtypes, self.devices, self.grads, strict=True
        ):
            if device == "meta":
                x = torch.empty(shape, dtype=dtype, device="meta")
            else:
                x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            out.append(x.requires_grad_(grad))
        return out

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of scaled_dot_product_attention, as the dispatcher sees
        them (defaults included)."""
        return {
            "mask": None,
            "bias": None,
            "score_mod": None,
            "sinks": None,
            "generator": None,
            "trace": None,
            "return_weights": False,
            "dropout_p": 0.0,
            **self.options,
        }

    def signature(self) -> PlanKey | None:
        q, k, v = self.tensors()
        with torch.set_grad_enabled(self.grad_mode):
            return plain_signature(q, k, v, self.arguments())

    def run(self, seed: int) -> torch.Tensor:
        q, k, v = self.tensors(seed)
        with torch.set_grad_enabled(self.grad_mode):
            out: torch.Tensor = qkv.scaled_dot_product_attention(q, k, v, **self.options)
        return out.detach()


BASE = Spec()


def _at(items: tuple[Any, ...], i: int, new: Any) -> tuple[Any, ...]:
    return tuple(new if j == i else x for j, x in enumerate(items))


def _option(name: str, value: Any) -> Callable[[Spec], Spec]:
    return lambda s: replace(s, options={**s.options, name: value})


CHANGES: dict[str, Callable[[Spec], Spec]] = {
    "query_shape": lambda s: replace(s, shapes=_at(s.shapes, 0, (1, 2, 4, 8))),
    "key_shape": lambda s: replace(s, shapes=_at(s.shapes, 1, (1, 2, 6, 8))),
    "value_shape": lambda s: replace(s, shapes=_at(s.shapes, 2, (1, 2, 5, 4))),
    "query_dtype": lambda s: replace(s, dtypes=_at(s.dtypes, 0, torch.float32)),
    "key_dtype": lambda s: replace(s, dtypes=_at(s.dtypes, 1, torch.float32)),
    "value_dtype": lambda s: replace(s, dtypes=_at(s.dtypes, 2, torch.float32)),
    "query_device": lambda s: replace(s, devices=_at(s.devices, 0, "meta")),
    "key_device": lambda s: replace(s, devices=_at(s.devices, 1, "meta")),
    "value_device": lambda s: replace(s, devices=_at(s.devices, 2, "meta")),
    "query_grad": lambda s: replace(s, grads=_at(s.grads, 0, True)),
    "key_grad": lambda s: replace(s, grads=_at(s.grads, 1, True)),
    "value_grad": lambda s: replace(s, grads=_at(s.grads, 2, True)),
    "grad_mode": lambda s: replace(s, grad_mode=False),
    "is_causal": _option("is_causal", False),
    "causal_alignment": _option("causal_alignment", "top-left"),
    "scale": _option("scale", 0.25),
    "enable_gqa": _option("enable_gqa", True),
    "backend": _option("backend", "sdpa"),
}
"""For each field of the key, a call that differs from ``BASE`` in that fact alone."""

RUNS_ALONE = {
    "query_shape",
    "value_shape",
    "query_grad",
    "key_grad",
    "value_grad",
    "grad_mode",
    "is_causal",
    "causal_alignment",
    "scale",
    "enable_gqa",
    "backend",
}
"""The changes that make a call qkv runs (the others are refused, or need a device this
machine lacks): these also run, planned and unplanned."""


@pytest.fixture(autouse=True)
def _no_plans() -> None:
    PLANS.clear()


def test_every_field_of_the_key_has_a_change() -> None:
    missing = sorted(set(PlanKey._fields) - set(CHANGES))
    unknown = sorted(set(CHANGES) - set(PlanKey._fields))
    assert not missing, f"fields of PlanKey with no change in CHANGES: {missing}"
    assert not unknown, f"CHANGES names no field of PlanKey: {unknown}"
    assert RUNS_ALONE.issubset(CHANGES)
    assert "causal_alignment" in RUNS_ALONE  # the field whose loss once went unseen


@pytest.mark.parametrize("name", PlanKey._fields)
def test_changing_one_fact_changes_that_field_of_the_key(name: str) -> None:
    base, changed = BASE.signature(), CHANGES[name](BASE).signature()
    assert base is not None and changed is not None
    differ = [f for f in PlanKey._fields if getattr(base, f) != getattr(changed, f)]
    assert differ == [name]
    assert changed != base and hash(changed) != hash(base)


@pytest.mark.parametrize("name", sorted(RUNS_ALONE))
def test_a_call_that_differs_in_one_field_gets_its_own_plan(name: str) -> None:
    """The planned call gives the numbers of its own options, not of the plan before it."""
    changed = CHANGES[name](BASE)
    want = changed.run(seed=1)  # unplanned: checked and dispatched in full
    PLANS.clear()
    BASE.run(seed=0)  # plans the base signature
    assert len(PLANS) == 1
    changed.run(seed=0)  # plans its own (or, with the field dropped, runs the base's)
    assert len(PLANS) == 2
    got = changed.run(seed=1)  # a planned call
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_changes_that_run_alone_give_other_numbers() -> None:
    """So the comparison above can fail: a change of causality, alignment or scale changes
    the output (Lq = 3 < Lk = 5, causal, bottom-right)."""
    base = BASE.run(seed=1)
    for name in ("is_causal", "causal_alignment", "scale"):
        PLANS.clear()
        assert (CHANGES[name](BASE).run(seed=1) - base).abs().max() > 1e-3, name
