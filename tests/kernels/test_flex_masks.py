"""qkv's masks and score modifiers as FlexAttention's block masks and score_mod (issue 19),
tested on CPU: the BlockMask from a rule's block structure allows exactly the rule's pairs,
the cache returns the same BlockMask for the same key, compiled FlexAttention's forward
(which runs on CPU in torch ≥ 2.5) matches the float64 reference, and the sinks come right
from FlexAttention's log-sum-exp.

Compiling takes seconds per new rule, modifier and shape: one compiled case runs by
default, every modifier under the ``slow`` marker; every rule compiled is in
tests/kernels/test_flex_compiled_rules.py (its own file, so that ``--dist loadfile`` can
give the two files to two workers).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import array_api_compat.torch as torch_xp
import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from qkv.attention import _options
from qkv.kernels import _flex_masks
from qkv.kernels._flex import block_mask_rule
from qkv.kernels._flex_masks import (
    BlockMaskCache,
    fingerprint,
    flex_block_mask,
    torch_score_mod,
)
from qkv.masks._scores import as_score_mod
from tests.support.flex_cases import BATCH, HEADS, inputs, mask_cases, score_cases

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:return_lse is deprecated"),
]

L = 300  # two full blocks of 128 and a ragged one
LQ, LK = 130, 300  # Lq ≠ Lk: bottom-right alignment matters


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    out: torch.Tensor = qkv.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), enable_gqa=True, backend="reference", **options
    )
    return out


# -- block masks from the rules' block structure (no compilation) -----------------------------


@pytest.mark.parametrize(("q_len", "kv_len"), [(L, L), (LQ, LK)])
def test_the_block_mask_allows_exactly_the_pairs_of_the_rule(q_len: int, kv_len: int) -> None:
    """Full blocks, partial blocks with mask_mod, empty blocks: the pairs torch's kernel would
    allow are the rule's, for every rule qkv ships (and B, H where the rule depends on them)."""
    for name, rule in mask_cases(q_len, kv_len).items():
        block_mask = flex_block_mask(rule, None, q_len, kv_len, batch=BATCH, heads=HEADS)
        as_torch_uses_it = block_mask_rule(block_mask)
        got = as_torch_uses_it.dense(q_len, kv_len, batch=BATCH, heads=HEADS, xp=torch_xp)
        want = rule.dense(q_len, kv_len, batch=BATCH, heads=HEADS, xp=torch_xp)
        assert torch.equal(got, want), name


def test_the_block_mask_skips_the_blocks_the_rule_leaves_empty() -> None:
    """A sliding window of 70 keys over 1024 queries: only the diagonal band of blocks is
    visited (partial or full), as the rule's hint says; a rule without a hint has every block
    partial."""
    window = flex_block_mask(masks.sliding_window(70), None, 1024)
    visited = window.kv_num_blocks + window.full_kv_num_blocks  # (1, 1, 8)
    assert visited.flatten().tolist() == [1] + [2] * 7
    no_hint = flex_block_mask(masks.from_function(lambda b, h, q, kv: q >= kv), None, 300)
    assert no_hint.kv_num_blocks.flatten().tolist() == [3, 3, 3]
    assert no_hint.full_kv_num_blocks.flatten().tolist() == [0, 0, 0]


def test_score_mod_adds_the_bias_then_applies_the_modifier() -> None:
    """qkv's order (scaled score + bias, then the modifier), read at broadcast indices."""
    bias = torch.arange(6.0).reshape(1, 1, 2, 3)  # broadcast over B and H
    mod = torch_score_mod(masks.softcap(2.0), 2, 3, bias)
    assert mod is not None
    b, h, q, kv = (torch.tensor(i) for i in (1, 3, 1, 2))
    got = mod(torch.tensor(0.5), b, h, q, kv)
    assert torch.allclose(got, 2.0 * torch.tanh(torch.tensor(5.5) / 2.0))
    assert torch_score_mod(None, 2, 3) is None
    with pytest.raises(ValueError, match=r"bias must have 4 dimensions"):
        torch_score_mod(None, 2, 3, torch.zeros(2, 3))


# -- the cache ---------------------------------------------------------------------------------


def test_the_cache_returns_the_same_block_mask_for_the_same_key() -> None:
    cache = BlockMaskCache(size=2)
    rule = masks.sliding_window(10)
    shape: dict[str, Any] = {"batch": 1, "heads": 2, "q_len": 256, "kv_len": 256, "device": "cpu"}
    first = cache.block_mask(rule, **shape)
    assert cache.block_mask(rule, **shape) is first
    assert (cache.hits, cache.misses) == (1, 1)
    longer = cache.block_mask(rule, **{**shape, "q_len": 512, "kv_len": 512})
    assert longer is not first
    assert tuple(longer.seq_lengths) == (512, 512)
    equal_rule = cache.block_mask(masks.sliding_window(10), **shape)  # made anew, equal
    assert equal_rule is first
    assert cache.block_mask(masks.sliding_window(11), **shape) is not first
    assert len(cache) == 2  # bounded: the least recently used entry went
    assert cache.block_mask(rule, **{**shape, "q_len": 512, "kv_len": 512}) is not longer
    keyed = cache.block_mask(masks.causal(), key=("mine", True), **shape)
    assert cache.block_mask(masks.causal(), key=("mine", True), **shape) is keyed
    cache.clear()
    assert len(cache) == 0


def test_the_cache_keeps_one_score_mod_function_per_modifier() -> None:
    """The same function object for the same (or an equal) modifier and lengths: torch.compile
    does not recompile for it. A bias is read at each call: the function stays when it
    changes in place, and another tensor gets another function."""
    cache = BlockMaskCache(size=4)
    softcap = masks.softcap(3.0)
    assert cache.score_mod(softcap, 8, 8) is cache.score_mod(softcap, 8, 8)
    assert cache.score_mod(masks.softcap(3.0), 8, 8) is cache.score_mod(softcap, 8, 8)
    assert cache.score_mod(masks.softcap(2.0), 8, 8) is not cache.score_mod(softcap, 8, 8)
    assert cache.score_mod(softcap, 8, 9) is not cache.score_mod(softcap, 8, 8)
    bias = torch.zeros(1, 1, 8, 8)
    with_bias = cache.score_mod(None, 8, 8, bias)
    bias.add_(1.0)
    assert cache.score_mod(None, 8, 8, bias) is with_bias
    assert cache.score_mod(None, 8, 8, bias.clone()) is not with_bias
    with pytest.raises(ValueError, match=r"size must be ≥ 1"):
        BlockMaskCache(size=0)


def test_equal_rules_made_anew_share_a_key_and_different_ones_do_not() -> None:
    """What qkv's modules do at every step: the rules are new objects, equal in content."""
    ids = [0] * 100 + [1] * 200
    same = [
        (masks.document(ids) & masks.causal(), masks.document(list(ids)) & masks.causal()),
        (masks.document(torch.tensor(ids)), masks.document(torch.tensor(ids))),
        (masks.key_padding([3, 5]), masks.key_padding(torch.tensor([3, 5]).tolist())),
        (masks.alibi(4), masks.alibi(4)),
        (masks.prefix_lm([2, 9]), masks.prefix_lm([2, 9])),
    ]
    for first, second in same:
        assert fingerprint(first) == fingerprint(second), first
    different = [
        (masks.document(ids), masks.document(ids[::-1])),
        (masks.key_padding([3, 5]), masks.key_padding([3, 6])),
        (masks.causal(), masks.causal("bottom-right")),
        (masks.causal(), ~masks.causal()),
        (masks.alibi(4), masks.alibi(8)),
        (masks.sliding_window(3) & masks.causal(), masks.sliding_window(3) | masks.causal()),
    ]
    for first, second in different:
        assert fingerprint(first) != fingerprint(second), (first, second)
    slopes = torch.ones(4, requires_grad=True)  # learnable: by identity, not by content
    learned = masks.score_function(lambda s, b, h, q, kv: s - slopes[h], "learned")
    assert fingerprint(learned) == fingerprint(learned)
    other = torch.ones(4, requires_grad=True)
    assert fingerprint(learned) != fingerprint(
        masks.score_function(lambda s, b, h, q, kv: s - other[h], "learned")
    )


def test_a_model_step_after_the_first_builds_no_block_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The combined rule (``mask & causal()``, a new object at every call) and a key padding
    rule made anew at each step find the BlockMask built at the first step."""
    cache = BlockMaskCache()
    monkeypatch.setattr(_flex_masks, "BLOCK_MASKS", cache)
    monkeypatch.setattr(_flex_masks, "run_flex", _eager_flex)
    monkeypatch.setattr(_options, "is_cuda", lambda device: True)
    q, k, v = inputs(L, L, dtype=torch.float64)
    for _ in range(3):
        padding = masks.key_padding([250, 300])
        qkv.scaled_dot_product_attention(
            q, k, v, mask=padding, is_causal=True, enable_gqa=True, backend="flex"
        )
    assert (cache.misses, cache.hits) == (1, 2)


# -- compiled FlexAttention's forward on CPU ------------------------------------------------------


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out: torch.Tensor = qkv.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, backend="flex", **options
        )
    return out


def test_compiled_flex_forward_matches_the_float64_reference() -> None:
    """Packed causal documents with a soft-cap, GQA, float32: the backend's compiled
    FlexAttention forward on CPU against the reference in float64."""
    q, k, v = inputs(L, L)
    rule = mask_cases(L, L)["documents-causal"]
    options: dict[str, Any] = {"mask": rule, "score_mod": masks.softcap(4.0)}
    got = _flex(q, k, v, **options)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, k, v, **options), atol=2e-6, rtol=0)


@pytest.mark.slow
def test_compiled_flex_forward_matches_the_reference_for_every_modifier() -> None:
    q, k, v = inputs(LQ, LK)
    for name, modifier in score_cases().items():
        options: dict[str, Any] = {
            "score_mod": modifier,
            "is_causal": True,
            "causal_alignment": "bottom-right",
        }
        got = _flex(q, k, v, **options)
        want = _reference(q, k, v, **options)
        torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=0, msg=name)


def _additive(modifier: Any) -> bool:
    as_mod = as_score_mod(modifier)
    return as_mod is not None and as_mod.additive


@pytest.mark.slow
def test_every_additive_modifier_as_flexs_score_mod_matches_the_reference() -> None:
    """The ScoreMod itself (ALiBi's rule, not the bias array the backend makes of it at
    these sizes) inside compiled FlexAttention, with a bottom-right causal block mask and
    no GQA. Only the additive modifiers: the backend hands every other one to FlexAttention
    as this same ScoreMod, so the test above compiles and checks it already (each modifier
    costs a compilation of seconds)."""
    q, k, v = inputs(LQ, LK, kv_heads=HEADS)
    rule = masks.causal("bottom-right")
    block_mask = _flex_masks.flex_block_mask(rule, None, LQ, LK)
    additive = {n: m for n, m in score_cases().items() if _additive(m)}
    assert set(additive) == {"alibi", "alibi-top-left"}
    for name, modifier in additive.items():
        score_mod = _flex_masks.torch_score_mod(as_score_mod(modifier), LQ, LK)
        got = _flex_masks.run_flex(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=None,
            enable_gqa=False,
            return_lse=False,
        )
        want = _reference(q, k, v, mask=rule, score_mod=modifier)
        torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=0, msg=name)


def test_half_precision_goes_through_compiled_flex() -> None:
    q, k, v = inputs(L, L, dtype=torch.bfloat16)
    got = _flex(q, k, v, mask=masks.sliding_window(70))
    assert got.dtype == torch.bfloat16
    want = _reference(q, k, v, mask=masks.sliding_window(70))
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=0)


# -- sinks from the log-sum-exp, and the backend's own path, with an eager oracle ----------------


def _eager_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    score_mod: Callable[..., Any] | None,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
) -> Any:
    """torch's flex_attention without compiling (float64 on CPU, with the lse): stands in
    for the compiled CUDA kernel, so the flex backend's own code runs here."""
    from torch.nn.attention.flex_attention import flex_attention

    eager: Callable[..., Any] = flex_attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eager(
            query,
            key,
            value,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            return_lse=return_lse,
        )


@pytest.fixture
def flex_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flex backend as it runs on CUDA (sinks, bias), with eager flex for the kernel."""
    monkeypatch.setattr(_flex_masks, "run_flex", _eager_flex)
    monkeypatch.setattr(_options, "is_cuda", lambda device: True)


@pytest.mark.usefixtures("flex_as_on_cuda")
def test_sinks_from_flexs_log_sum_exp_equal_the_reference_in_float64() -> None:
    """out · σ(lse − sink): the same numbers as the reference's extra softmax term, with a
    −inf sink (no sink) and a fully masked row (all attention to the sink: zeros)."""
    q, k, v = inputs(L, L, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0], dtype=torch.float64)
    rule = masks.sliding_window(40) & ~masks.key_padding([0, 5])  # rows with no key
    options: dict[str, Any] = {"mask": rule, "sinks": sinks, "score_mod": masks.alibi(HEADS)}
    got = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="flex", **options)
    torch.testing.assert_close(got, _reference(q, k, v, **options), atol=1e-12, rtol=0)


@pytest.mark.usefixtures("flex_as_on_cuda")
def test_a_bias_array_rides_in_the_score_mod() -> None:
    q, k, v = inputs(LQ, LK, dtype=torch.float64)
    bias = torch.randn(1, HEADS, LQ, LK, dtype=torch.float64)
    options: dict[str, Any] = {
        "mask": masks.causal("bottom-right"),
        "bias": bias,
        "score_mod": masks.softcap(3),
    }
    got = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="flex", **options)
    torch.testing.assert_close(got, _reference(q, k, v, **options), atol=1e-12, rtol=0)


@pytest.mark.usefixtures("flex_as_on_cuda")
def test_a_masked_nan_is_kept_out_by_redoing_the_call_on_the_tiled_kernel() -> None:
    q, k, v = inputs(L, L, dtype=torch.float64)
    v = v.clone()
    v[:, :, -1] = float("nan")  # the last key: masked out for every query but the last
    rule = masks.causal()
    got = qkv.scaled_dot_product_attention(q, k, v, mask=rule, enable_gqa=True, backend="flex")
    assert bool(torch.isfinite(got[:, :, :-1]).all())
    assert bool(torch.isnan(got[:, :, -1]).all())


WIDTH = 4  # a module-level name a rule reads


def test_what_a_rule_reads_besides_its_closure_is_part_of_its_key() -> None:
    """A dictionary, or a module-level name, that the rule reads: change it, and the rule
    gets another block mask (an unchanged one finds the same)."""
    global WIDTH
    settings = {"width": 3}
    by_dict = masks.from_function(lambda b, h, q, kv: q - kv < settings["width"], "dict")
    before = fingerprint(by_dict)
    assert fingerprint(by_dict) == before
    settings["width"] = 5
    assert fingerprint(by_dict) != before
    by_name = masks.from_function(lambda b, h, q, kv: q - kv < WIDTH, "global")
    first = fingerprint(by_name)
    WIDTH = 9
    try:
        assert fingerprint(by_name) != first
    finally:
        WIDTH = 4
    assert fingerprint(by_name) == first


def test_a_rules_own_caches_do_not_change_its_key() -> None:
    """``document`` keeps its id tables per device, and a mask the rules it was combined with:
    both fill up as the rule is used, and must not make an equal rule miss."""
    ids = [0] * 40 + [1] * 60
    used, fresh = masks.document(ids), masks.document(ids)
    before = fingerprint(used)
    used.dense(100, 100, xp=torch_xp)  # fills the document's tables for torch on the CPU
    masks.with_causal(used, True)  # and the mask's combinations
    assert fingerprint(used) == before == fingerprint(fresh)


def test_a_built_in_rule_keeps_its_ids_and_is_hashed_once() -> None:
    """A document rule copies its ids: the caller's tensor edited in place afterwards
    changes neither the rule nor its key, and the rule, which never changes, is hashed once
    while it lives (hashing its ids again cost milliseconds per call). A rule made from the
    edited ids is another rule, with another key. Buffers that one rule reads several times
    are hashed once per key."""
    ids = torch.tensor([0] * 150 + [1] * 150)
    rule = masks.document(ids) & masks.causal()
    before, dense = fingerprint(rule), rule.dense(300, 300)
    assert fingerprint(masks.document(ids.clone()) & masks.causal()) == before
    ids[100:] = 2
    assert fingerprint(rule) == before and np.array_equal(rule.dense(300, 300), dense)
    assert fingerprint(masks.document(ids) & masks.causal()) != before
    assert fingerprint(rule) is fingerprint(rule)  # kept, not hashed again
    grid = np.arange(12).reshape(3, 4)  # one buffer read in two orders: two keys
    same = masks.from_function(lambda b, h, q, kv: (grid[0, 0] + grid[0, 0]) > q, "same")
    turned = grid.T
    other = masks.from_function(lambda b, h, q, kv: (grid[0, 0] + turned[0, 0]) > q, "other")
    assert fingerprint(same) != fingerprint(other)


def test_compiled_flex_leaves_room_for_many_rules_and_never_lowers_the_limit() -> None:
    """torch.compile's default of 8 compilations per function sent qkv's ninth rule to
    uncompiled flex_attention: O(L²) memory and about 1 TFLOP/s on an H200 (issue 30)."""
    import torch._dynamo.config as dynamo

    _flex_masks.compiled_flex.cache_clear()
    try:
        with dynamo.patch(recompile_limit=8, accumulated_recompile_limit=100_000):
            _flex_masks.compiled_flex(static=True)
            assert dynamo.recompile_limit >= _flex_masks.RECOMPILE_LIMIT >= 256
            assert dynamo.accumulated_recompile_limit == 100_000  # a higher one is kept
    finally:
        _flex_masks.compiled_flex.cache_clear()
