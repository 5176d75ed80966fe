"""Every mask rule qkv ships, through the flex backend's compiled FlexAttention forward on
CPU, against the float64 reference (issue 19; the block masks, the cache and the modifiers
are in tests/kernels/test_flex_masks.py).

Each rule and shape is one compilation of seconds (dynamic=False on CPU), so each rule is
compiled once, at the shape that tells the most: Lq ≠ Lk (130 × 300), where bottom-right
alignment differs from top-left and the last block of queries (2 rows) and of keys (44) is
ragged. The rules that need Lq = Lk (packed documents) are compiled at 300 × 300. Every rule
at both shapes is still checked without compiling (the BlockMask's pairs, in
test_flex_masks.py), and the compiled square path by its float64 and half-precision cases.
"""

from __future__ import annotations

import pytest
import torch

from qkv.masks import Mask
from tests.kernels.test_flex_masks import LK, LQ, L, _flex, _reference
from tests.support.flex_cases import inputs, mask_cases

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:return_lse is deprecated"),
]


def _compiled_cases(q_len: int, kv_len: int) -> dict[str, Mask]:
    """The rules to compile at (Lq, Lk): all at Lq ≠ Lk; at Lq = Lk those the other lacks."""
    cases = mask_cases(q_len, kv_len)
    if q_len == kv_len:
        rectangular = mask_cases(LQ, LK)
        cases = {name: rule for name, rule in cases.items() if name not in rectangular}
    return cases


def test_every_rule_is_compiled_at_one_of_the_two_shapes() -> None:
    """No rule of tests/support/flex_cases.py is left out, and the square shape adds some."""
    square, rectangular = _compiled_cases(L, L), _compiled_cases(LQ, LK)
    assert set(square) | set(rectangular) == set(mask_cases(L, L))
    assert set(square) == {"documents-causal", "documents-per-batch"}


@pytest.mark.slow
@pytest.mark.parametrize(("q_len", "kv_len"), [(LQ, LK), (L, L)])
def test_compiled_flex_forward_matches_the_reference_for_every_rule(
    q_len: int, kv_len: int
) -> None:
    q, k, v = inputs(q_len, kv_len)
    for name, rule in _compiled_cases(q_len, kv_len).items():
        got = _flex(q, k, v, mask=rule)
        want = _reference(q, k, v, mask=rule)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0, msg=name)
