"""One case maker per mask rule of the registry (:data:`qkv.masks.RULES`): the one list
the tests draw rules from. ``tests/core/test_masks_blocks.py`` (block structure against
the dense mask), ``tests/kernels/test_tiled.py`` (the tiled kernel against the reference)
and ``tests/support/flex_cases.py`` (FlexAttention) take every rule of the registry
through :func:`drawn`; ``tests/core/test_registry.py`` fails when a rule has no case
here. A new rule adds its case here, and nowhere else in ``tests/``.

A case draws one instance of its rule for a batch ``b``, ``lq`` queries and ``lk`` keys
from ``rng`` (``hypothesis.strategies.randoms()`` in the property tests, a seeded
``random.Random`` elsewhere).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from qkv import masks

ALIGNMENTS: tuple[masks.Alignment, ...] = ("top-left", "bottom-right")


def _window(rng: random.Random, b: int, lq: int, lk: int) -> masks.Mask:
    reach = max(lk // 2, 5)
    before, after = rng.randint(0, reach), rng.randint(0, reach // 2)
    return masks.sliding_window(before, after, alignment=rng.choice(ALIGNMENTS))


def _document(rng: random.Random, b: int, lq: int, lk: int) -> masks.Mask:
    q_ids = sorted(rng.randint(0, 3) for _ in range(lq))
    kv_ids = sorted(rng.randint(0, 3) for _ in range(lk))
    return masks.document(q_ids, kv_ids)


def _function(rng: random.Random, b: int, lq: int, lk: int) -> masks.Mask:
    """A rule of the user's: without a hint, or with a block hint (a causal rule)."""
    if rng.random() < 0.5:
        return masks.from_function(lambda b, h, q, kv: (q * kv + h) % 2 == 0, "parity")
    return masks.from_function(
        lambda b, h, q, kv: kv <= q,
        "hinted causal",
        blocks=lambda b, h, q0, q1, k0, k1: (k0 <= q1 - 1, k1 - 1 <= q0),
    )


RULE_CASES: dict[str, Callable[[random.Random, int, int, int], masks.Mask]] = {
    "full": lambda rng, b, lq, lk: masks.full(),
    "causal": lambda rng, b, lq, lk: masks.causal(rng.choice(ALIGNMENTS)),
    "sliding_window": _window,
    "key_padding": lambda rng, b, lq, lk: masks.key_padding([rng.randint(0, lk) for _ in range(b)]),
    "prefix_lm": lambda rng, b, lq, lk: masks.prefix_lm(
        rng.randint(0, lk),
        alignment=rng.choice(ALIGNMENTS),
    ),
    "document": _document,
    "from_function": _function,
}
"""A case of each rule of :data:`qkv.masks.RULES`, by the rule's name."""


def case_of(name: str) -> Callable[[random.Random, int, int, int], masks.Mask]:
    """The case maker of the registry's rule ``name`` (a rule without one raises, naming
    this file)."""
    if name not in RULE_CASES:
        raise KeyError(f"no case in tests/support/mask_cases.py for the rule {name!r}")
    return RULE_CASES[name]


def drawn(rng: random.Random, b: int, lq: int, lk: int) -> dict[str, masks.Mask]:
    """One instance of every rule of the registry, by name."""
    return {name: case_of(name)(rng, b, lq, lk) for name in masks.RULES}


def draw_rule(rng: random.Random, b: int, lq: int, lk: int) -> masks.Mask:
    """One instance of one rule of the registry, the rule chosen by ``rng``."""
    return case_of(rng.choice(sorted(masks.RULES)))(rng, b, lq, lk)
