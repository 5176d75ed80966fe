"""What ``qkv.flex_attention`` says of a ``score_mod`` or ``mask_mod`` that does not act on
each score alone (issue 38 §1): a result of the wrong shape was used without a word, an
integer result ended in torch's RuntimeError; now each is one line naming the argument, what
came and a hint. Functions that torch's FlexAttention takes still run, with torch's numbers.

torch's semantics are the oracle: ``torch.nn.attention.flex_attention`` calls score_mod and
mask_mod one score at a time (its eager forward, on CPU, for the forward values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import qkv
from qkv import masks

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning"),
]

Q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
BIAS = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))


def test_a_score_mod_of_the_wrong_shape_is_named() -> None:
    """A sum over the keys: (B, H, Lq) scores, which broadcast against a square block."""
    says = r"^flex_attention: score_mod must return the modified scores, an array that "
    says += r"broadcasts to the scores' shape \(1, 2, 5, 7\); score_mod returned an array of "
    with pytest.raises(ValueError, match=says + r"shape \(1, 2, 5\)\. Hint: return an "):
        qkv.flex_attention(Q, Q, Q, score_mod=lambda s, b, h, q, kv: s.sum(-1))


WRONG_SHAPE: dict[str, tuple[Callable[..., Any], str]] = {
    "a kept dimension": (
        lambda s, b, h, q, kv: s.amax(-1, keepdim=True),
        r"returned shape \(1, 2, 5, 1\)",
    ),
    "a row-wise shift": (
        lambda s, b, h, q, kv: s - s.amax(-1, keepdim=True),
        r"returned other values than one at a time",
    ),
}


@pytest.mark.parametrize(("score_mod", "says"), list(WRONG_SHAPE.values()), ids=list(WRONG_SHAPE))
def test_a_score_mod_that_is_not_elementwise_is_named(
    score_mod: Callable[..., Any], says: str
) -> None:
    start = r"^flex_attention: score_mod must act on each score alone, .*on scores of shape "
    with pytest.raises(ValueError, match=start + r"\(1, 2, 5, 7\) it " + says) as caught:
        qkv.flex_attention(Q, Q, Q, score_mod=score_mod)
    assert "\n" not in str(caught.value) and "Hint: no sum, mean or max" in str(caught.value)


@pytest.mark.parametrize(
    ("score_mod", "says"),
    [
        (
            lambda s, b, h, q, kv: q - kv,
            r"got torch\.int64 of shape \(1, 1, 5, 7\)\. Hint: convert",
        ),
        (lambda s, b, h, q, kv: q >= kv, r"got torch\.bool .* Hint: a boolean is a mask"),
    ],
    ids=["integers", "booleans"],
)
def test_a_score_mod_returning_integers_is_named(score_mod: Callable[..., Any], says: str) -> None:
    with pytest.raises(TypeError, match=r"^flex_attention: score_mod must return floating-point "
                       r"scores, " + says):  # fmt: skip
        qkv.flex_attention(Q, Q, Q, score_mod=score_mod)


def test_a_mask_mod_that_is_not_elementwise_is_named() -> None:
    """torch builds the BlockMask one position at a time (``any`` of one value is the
    value); qkv would evaluate it on broadcast blocks, where ``any`` is one boolean."""

    def causal_any(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv).any()

    block_mask = create_block_mask(causal_any, None, None, 8, 8, device="cpu")
    says = r"^flex_attention: the mask_mod of block_mask must act on each score alone, .* "
    with pytest.raises(ValueError, match=says + r"returned shape \(\)\. Hint: no any\(\)"):
        qkv.flex_attention(Q, Q, Q, block_mask=block_mask)


def test_a_mask_rule_returning_integers_is_named() -> None:
    rule = masks.from_function(lambda b, h, q, kv: (q >= kv).int(), "causal ints")
    says = r"^flex_attention: block_mask from_function\(causal ints\) must return booleans "
    with pytest.raises(TypeError, match=says + r"\(True = may attend\), got torch\.int32"):
        qkv.flex_attention(Q, Q, Q, block_mask=rule)


FINE: dict[str, Callable[..., Any]] = {
    "relative positions, no score (a broadcast shape)": lambda s, b, h, q, kv: (q - kv) * 0.5,
    "a bias table": lambda s, b, h, q, kv: s + BIAS[h, q, kv],
    "chained indexing, as torch allows": lambda s, b, h, q, kv: s + BIAS[h][q][kv],
    "a constant": lambda s, b, h, q, kv: torch.tensor(0.25),
}


@pytest.mark.parametrize("score_mod", list(FINE.values()), ids=list(FINE))
def test_score_mods_torch_takes_give_torchs_numbers(score_mod: Callable[..., Any]) -> None:
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 8, 8, device="cpu")
    got = qkv.flex_attention(Q, Q, Q, score_mod=score_mod, block_mask=block_mask)
    want = torch_flex(Q, Q, Q, score_mod=score_mod, block_mask=block_mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
