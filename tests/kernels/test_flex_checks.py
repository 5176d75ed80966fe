"""One clear line for what flex_attention and the other entries cannot take (issue 24 §4, §5;
issue 25 §3, §4): a per-batch mask made for another batch, a NaN or infinite scale, a score
modifier that returns no scores, a call whose block plan would not fit in memory; and the
empty sequences the tiled kernel now takes. The hostile sizes run in a child process with a
memory and a time limit, so that a failure cannot take the test run down.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from qkv.attention._backends import BackendName
from qkv.distributed import ring_attention
from qkv.kernels import tiled_attention
from tests.support.backends import backend_names
from tests.support.isolated import run_code_isolated

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randn(batch, 2, length, 8, generator=torch.Generator().manual_seed(0))


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(error.value)
    assert "\n" not in text and "Hint:" in text, text
    return text


# -- per-batch masks made for another batch (issue 25 §3) -------------------------------------


def _on(backend: str) -> Callable[[Any, Any], Any]:
    return lambda x, m: qkv.scaled_dot_product_attention(x, x, x, mask=m, backend=backend)


ENTRIES: dict[str, Callable[[Any, Any], Any]] = {
    **{name: _on(name) for name in backend_names(compiled=True, auto=True)},
    "reference-numpy": lambda x, m: qkv.scaled_dot_product_attention(
        x.numpy(), x.numpy(), x.numpy(), mask=m
    ),
    "tiled_attention": lambda x, m: tiled_attention(x, x, x, mask=m),
    "flex_attention": lambda x, m: qkv.flex_attention(x, x, x, block_mask=m),
    "ring_attention": lambda x, m: ring_attention(x, x, x, mask=m),
    "dense": lambda x, m: m.dense(16, 16, batch=x.shape[0]),
}

PER_BATCH = {
    "key_padding": (masks.key_padding([3, 4, 5]), "key_padding has 3 lengths"),
    "key_padding-short": (masks.key_padding([3]), "key_padding has 1 length "),
    "prefix_lm": (masks.prefix_lm([1, 2, 3]), "prefix_lm has 3 prefixes"),
    "document": (
        masks.document([[0] * 16] * 3),
        "document has segment_ids for 3 sequences",
    ),
    "combined": (masks.causal() & masks.key_padding([3, 4, 5]), "key_padding has 3 lengths"),
}


@pytest.mark.parametrize("mask_name", list(PER_BATCH))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_per_batch_mask_for_another_batch_is_refused_everywhere(
    entry: str, mask_name: str
) -> None:
    """key_padding([3, 4, 5]) on a batch of 2 used the first two lengths silently (one too
    few was an error, and qkv.nn refused the same mismatch)."""
    mask, said = PER_BATCH[mask_name]
    with pytest.raises(ValueError, match="but the batch has 2 elements") as error:
        ENTRIES[entry](_inputs(batch=2), mask)
    assert said in _one_line(error)


def test_a_per_batch_mask_of_the_right_batch_runs_and_a_2d_input_is_batch_one() -> None:
    x = _inputs(batch=3)
    out = qkv.scaled_dot_product_attention(x, x, x, mask=masks.key_padding([3, 4, 5]))
    assert out.shape == x.shape
    single = x[0, 0].numpy()  # (L, D): no batch axis, a batch of one
    qkv.scaled_dot_product_attention(single, single, single, mask=masks.key_padding([5]))
    with pytest.raises(ValueError, match="key_padding has 2 lengths but the batch has 1 elem"):
        qkv.scaled_dot_product_attention(single, single, single, mask=masks.key_padding([5, 6]))


# -- scale (issue 24 §5) ---------------------------------------------------------------------


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("entry", ["flex_attention", "tiled_attention", "sdpa"])
def test_a_scale_that_is_not_finite_is_refused(entry: str, scale: float) -> None:
    """flex_attention(scale=nan) returned all-NaN."""
    x = _inputs()
    call = {
        "flex_attention": lambda: qkv.flex_attention(x, x, x, scale=scale),
        "tiled_attention": lambda: tiled_attention(x, x, x, scale=scale),
        "sdpa": lambda: qkv.scaled_dot_product_attention(x, x, x, scale=scale),
    }[entry]
    with pytest.raises(TypeError, match=r"scale must be a finite number or None") as error:
        call()
    assert repr(scale) in _one_line(error)


# -- score modifiers that return no scores (issue 24 §5) -------------------------------------

RETURNS: dict[str, tuple[Callable[..., Any], str]] = {
    "None": (lambda s, b, h, q, kv: None, "returned None"),
    "float": (lambda s, b, h, q, kv: 1.0, "returned float 1.0"),
    "int": (lambda s, b, h, q, kv: 3, "returned int 3"),
    "wrong-shape": (lambda s, b, h, q, kv: torch.zeros(3), "returned an array of shape (3,)"),
    "extra-axis": (lambda s, b, h, q, kv: s[..., None], "returned an array of shape (2, 2, "),
}


@pytest.mark.parametrize("backend", ["flex_attention", "tiled", "reference"])
@pytest.mark.parametrize("name", list(RETURNS))
def test_a_score_mod_that_returns_no_scores_is_one_line(name: str, backend: str) -> None:
    """A score_mod returning None, a number or the wrong shape ended in torch-internal
    tracebacks ('NoneType' object has no attribute 'expand'); now one line naming
    score_mod and what it returned."""
    score_mod, said = RETURNS[name]
    x = _inputs()
    chosen: BackendName = "tiled" if backend == "tiled" else "reference"

    def call() -> Any:
        if backend == "flex_attention":
            return qkv.flex_attention(x, x, x, score_mod)
        return qkv.scaled_dot_product_attention(x, x, x, score_mod=score_mod, backend=chosen)

    with pytest.raises(ValueError, match="score_mod must return the modified scores") as error:
        call()
    assert said in _one_line(error)


def test_a_score_mod_that_broadcasts_over_an_index_is_taken() -> None:
    """A result that ignores some index (shape (1, 1, 1, Lk)) broadcasts to the scores: the
    same as the full one (it wrote into a stride-0 view before)."""
    x = _inputs()

    def by_key(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.where(kv % 3 == 0, 0.0, -1.0)

    def full(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s * 0 + torch.where(kv % 3 == 0, 0.0, -1.0)

    torch.testing.assert_close(
        qkv.flex_attention(x, x, x, by_key), qkv.flex_attention(x, x, x, full)
    )


def test_chained_indexing_on_numpy_is_one_line_naming_the_supported_form() -> None:
    """On PyTorch tensors qkv evaluates such a score_mod per element, as torch does
    (tests/peers/test_flex_upstream.py); NumPy arrays cannot be, so one line says how to
    write it."""
    x = _inputs().numpy()
    bias = np.zeros((2, 16))
    with pytest.raises(ValueError, match=r"bias\[b, q_idx\] rather than bias\[b\]\[q_idx\]"):
        qkv.scaled_dot_product_attention(x, x, x, score_mod=lambda s, b, h, q, kv: s + bias[b][q])
    out = qkv.scaled_dot_product_attention(x, x, x, score_mod=lambda s, b, h, q, kv: s + bias[b, q])
    assert out.shape == x.shape


def test_a_score_mods_own_error_reaches_the_user_unchanged() -> None:
    x = _inputs()

    def broken(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        raise KeyError("my table has no such entry")

    with pytest.raises(KeyError, match="my table has no such entry"):
        qkv.flex_attention(x, x, x, broken)


# -- empty sequences -------------------------------------------------------------------------


def test_empty_sequences_give_empty_or_zero_results() -> None:
    """tiled_attention with Lq = 0 or Lk = 0 divided by zero (ZeroDivisionError); now, as a
    row with no key: an empty output, or zeros with lse −inf."""
    x = _inputs()
    none = x[:, :, :0]
    out, lse = tiled_attention(none, x, x, return_lse=True)
    assert out.shape == (2, 2, 0, 8) and lse.shape == (2, 2, 0)
    out, lse = tiled_attention(x, none, none, return_lse=True)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


# -- sizes: check before allocating (issue 24 §4) --------------------------------------------


@pytest.mark.slow
def test_ten_million_stride_zero_tokens_are_refused_before_anything_is_allocated() -> None:
    """A stride-0 input of 10⁷ tokens (64 bytes of data) with sliding_window(0) made the
    block plan ask for 22.7 GiB (numpy's ArrayMemoryError); now one line with the number of
    blocks, under 3 GiB of address space and in well under a second of work."""
    result = run_code_isolated(
        """
import torch, qkv
x = torch.randn(1, 1, 1, 16).expand(1, 1, 10**7, 16)
try:
    qkv.flex_attention(x, x, x, block_mask=qkv.masks.sliding_window(0))
    result = {'error': None}
except ValueError as error:
    result = {'error': 'ValueError', 'message': str(error)}
for call in (
    lambda: qkv.scaled_dot_product_attention(x, x, x, backend='tiled'),
    lambda: qkv.kernels.tiled_attention(x, x, x, block_q=16, block_kv=16),
):
    try:
        call()
    except ValueError as error:
        result.setdefault('others', []).append(str(error))
"""
    )
    assert result["error"] == "ValueError", result
    message = result["message"]
    assert "\n" not in message and "Hint:" in message
    assert "Lq = 10,000,000 and Lk = 10,000,000 are too long" in message
    assert "at most 16,777,216" in message
    assert len(result.get("others", [])) == 2, result
