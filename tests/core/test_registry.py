"""The backend registry is the one list (issue 27 §4): a backend added to
``qkv.attention.BACKENDS`` is accepted by name, listed in every report, tried by auto in the
registry's order and run by the tests' parametrisations, with no other edit."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

import qkv
from qkv import masks
from qkv.attention import BACKENDS
from qkv.attention._backends import Backend, Call, four, three
from qkv.attention._dispatch import _fast_order
from tests.support.backends import backend_names


def _run_echo(call: Call) -> tuple[torch.Tensor, None]:
    """A stand-in backend: the values' mean over the keys (not attention; only its name is
    under test)."""
    v = four(call.value, call.lead)
    return three(
        v.mean(dim=-2, keepdim=True).expand(-1, -1, call.query.shape[-2], -1), call.lead
    ), None


@pytest.fixture
def echo() -> Iterator[str]:
    """One more backend, registered by one entry in the registry, first for causal calls."""
    backend = Backend(
        "echo",
        "a stand-in",
        lambda call, auto: None if call.torch else "needs tensors",
        _run_echo,
        why=lambda call: "the stand-in runs causal calls",
        first=lambda call: call.options.is_causal,
    )
    BACKENDS["echo"] = backend
    try:
        yield "echo"
    finally:
        del BACKENDS["echo"]


def test_a_backend_added_to_the_registry_is_everywhere(echo: str) -> None:
    q = torch.ones(1, 2, 8, 4)
    # accepted by name, run, and listed in the report (last: the registry's order)
    out = qkv.scaled_dot_product_attention(q, q, 2 * q, backend=echo)
    assert torch.equal(out, 2 * q)
    report = qkv.explain_dispatch(q, q, q, backend=echo)
    assert report.backend == echo and [n for n, _ in report.reasons] == [*BACKENDS]
    # auto tries it in the registry's order, first where its rule says so, with its reason
    causal = qkv.explain_dispatch(q, q, q, is_causal=True)
    assert causal.backend == echo
    assert dict(causal.reasons)[echo] == "the stand-in runs causal calls"
    assert qkv.explain_dispatch(q, q, q).backend == "sdpa"
    assert "sdpa comes first" in dict(qkv.explain_dispatch(q, q, q).reasons)[echo]
    # and the tests' parametrisations take it
    assert echo in backend_names() and echo in backend_names(reference=False, auto=True)


def test_the_error_for_an_unknown_backend_lists_the_registry() -> None:
    q = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"one of \['flex', 'reference', 'sdpa', 'tiled'\]"):
        qkv.scaled_dot_product_attention(q, q, q, backend="flash")


def test_auto_order_is_the_registry_order_with_first_backends_moved_ahead() -> None:
    q = torch.ones(1, 2, 8, 4)
    call = qkv.attention._dispatch.make_call(q, q, q, mask=masks.causal())
    fast = [name for name, b in BACKENDS.items() if b.fast]
    assert list(_fast_order(call)) == fast  # on CPU nothing asks to go first
    first = replace(BACKENDS["tiled"], first=lambda call: True)
    saved = BACKENDS["tiled"]
    BACKENDS["tiled"] = first
    try:
        assert _fast_order(call)[0] == "tiled"
    finally:
        BACKENDS["tiled"] = saved


def test_the_parametrisations_follow_the_registry() -> None:
    compiled = {name for name, b in BACKENDS.items() if b.compiles}
    assert set(backend_names(compiled=True)) == set(BACKENDS)
    assert set(backend_names()) == set(BACKENDS) - compiled
    assert backend_names(reference=False, auto=True)[-1] == "auto"


# -- masks: every built-in rule is in each list of rules the tests draw from ---------------


def _mask_makers() -> set[str]:
    """The public functions of qkv.masks that make a Mask a user passes (the dropout
    pattern is qkv's own, ``with_causal`` combines existing rules)."""
    makers = set()
    for name in masks.__all__:
        made = getattr(masks, name)
        if inspect.isfunction(made) and inspect.signature(made).return_annotation in (
            "Mask",
            masks.Mask,
        ):
            makers.add(name)
    return makers - {"dropout_keep"}


@pytest.mark.parametrize(
    "where",
    [
        "tests.core.test_masks_blocks:_rules",
        "tests.kernels.test_tiled:_rule",
        "tests.support.flex_cases:mask_cases",
    ],
)
def test_every_mask_rule_is_in_the_tests_lists_of_rules(where: str) -> None:
    """A new rule in qkv.masks must join the rules these tests draw from (block structure
    against the dense mask, the tiled kernel against the reference, FlexAttention)."""
    module, name = where.split(":")
    source = inspect.getsource(getattr(importlib.import_module(module), name))
    missing = sorted(m for m in _mask_makers() if not re.search(rf"masks\.{m}\b", source))
    assert not missing, f"{where} draws no {missing}: add them there"
