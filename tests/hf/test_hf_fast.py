"""qkv.tracing(model=hf_model) on the fast path: a traced layer recomputes only its rows.

Without ``output_attentions``, every attention layer runs on the fast path (torch's SDPA, or
qkv's tiled kernel for softcap and sinks), the traced ones included; a traced layer then
recomputes only the selected heads and query rows on the reference. The outputs must still
equal the model's ``eager`` implementation on the real tokens, and the recorded rows must
equal eager's weights and the full reference trace, to 1e-6 in float32.

The families are the tiny random-weight models of ``test_hf_tracing.py`` (imported, not
copied). The expectation that ``output_attentions=True`` needs the eager path, and that
other implementations return no weights, follows transformers' own attention tests
(``tests/test_modeling_common.py``, ``test_attention_outputs``), restated here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv.attention import _long_trace, _reference
from qkv.hf import attention_modules, qkv_attention_forward
from tests.hf.test_hf_tracing import (
    FAMILIES,
    IDS,
    PADDING,
    _configs,
    _eager,
    _family,
    _inputs,
    _real,
)

TOL = 1e-6


def _eager_weights(out: Any) -> list[torch.Tensor]:
    """eager's weights, one (B, H, Lq, Lk) tensor per attention call, in the order the model
    calls its attention modules (encoder, then each decoder layer's self- and
    cross-attention)."""
    encoder = list(getattr(out, "encoder_attentions", None) or ())
    decoder = list(getattr(out, "decoder_attentions", None) or out.attentions or ())
    cross = list(getattr(out, "cross_attentions", None) or ())
    if cross:
        decoder = [w for pair in zip(decoder, cross, strict=True) for w in pair]
    return [*encoder, *decoder]


def _assert_as_exact_as_eager(
    model: Any,
    kind: str,
    mask: torch.Tensor,
    field: str,
    ours: torch.Tensor,
    theirs: torch.Tensor,
    real: torch.Tensor,
) -> None:
    """Beyond 1e-6 of eager, the output must be float32 rounding: no farther from eager
    run in float64 than eager itself in float32 is (Gemma2's norms after attention magnify
    the last bits of the tiled kernel's softcapped sums; eager's own error is of that
    size), and within 2e-6 of it."""
    truth = getattr(_eager(copy.deepcopy(model).double(), kind, mask), field)
    eager_error = (theirs.double() - truth)[real].abs().max().item()
    our_error = (ours.double() - truth)[real].abs().max().item()
    assert (ours - theirs)[real].abs().max() <= 2 * TOL, field
    assert our_error <= 1.5 * eager_error, (field, our_error, eager_error)


def _forward(model: Any, kind: str, mask: torch.Tensor, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(**_inputs(kind, mask), **kwargs)


@pytest.mark.parametrize("padding", sorted(PADDING))
@pytest.mark.parametrize("family", FAMILIES)
def test_traced_layers_run_fast_and_their_rows_equal_eager(family: str, padding: str) -> None:
    model = _family(family)
    kind = _configs()[family][2]
    mask = PADDING[padding]
    eager = _eager(model, kind, mask)  # with output_attentions=True
    with qkv.tracing(model=model, heads=1, queries=-1) as fast:
        got = _forward(model, kind, mask)
    # every layer is traced, and every one ran on a fast backend
    backends = {call.meta["backend"] for call in fast.calls}
    assert len(fast.calls) == len(attention_modules(model))
    assert backends == ({"tiled"} if family.startswith(("gemma2", "gpt_oss")) else {"sdpa"})
    for field in ("last_hidden_state", "encoder_last_hidden_state"):
        if getattr(eager, field, None) is not None:
            ours, theirs = getattr(got, field), getattr(eager, field)
            real = _real(ours.shape[1], kind, mask)
            if (ours - theirs)[real].abs().max() > TOL:
                _assert_as_exact_as_eager(model, kind, mask, field, ours, theirs, real)
    # each call's recorded row: head 1, the last query row, as eager weighs it
    expected = _eager_weights(eager)
    assert len(expected) == len(fast.calls)
    for call, theirs in zip(fast.calls, expected, strict=True):
        weights = next(s for s in call.steps if s.name == "weights")
        assert weights.index is not None
        assert weights.index["head"] == [1] and weights.index["query"] == [theirs.shape[2] - 1]
        assert weights.value.shape == (2, 1, 1, theirs.shape[-1])
        row = torch.from_numpy(weights.value[:, 0, 0])
        torch.testing.assert_close(row, theirs[:, 1, -1], atol=TOL, rtol=0)
    # every step equals the trace the reference records when it forms all the weights
    with qkv.tracing(model=model, heads=1, queries=-1) as full:
        _forward(model, kind, mask, output_attentions=True)
    assert {call.meta["backend"] for call in full.calls} == {"reference"}
    for ours_call, full_call in zip(fast.calls, full.calls, strict=True):
        assert [s.name for s in ours_call.steps] == [s.name for s in full_call.steps]
        for ours_step, full_step in zip(ours_call.steps, full_call.steps, strict=True):
            assert ours_step.value.shape == full_step.value.shape, ours_step.name
            assert ours_step.index == full_step.index, ours_step.name
            np.testing.assert_allclose(
                ours_step.value, full_step.value, atol=TOL, rtol=0, err_msg=ours_step.name
            )
        ours_sink, full_sink = ours_call.meta.get("sink"), full_call.meta.get("sink")
        assert (ours_sink is None) == (full_sink is None) == ("sinks" not in family)
        if ours_sink is not None and full_sink is not None:  # each row's share of the sink
            assert ours_sink["index"] == full_sink["index"]
            np.testing.assert_allclose(ours_sink["share"], full_sink["share"], atol=TOL, rtol=0)


class _LargestTensor(TorchDispatchMode):
    """The largest storage (bytes) any PyTorch operation produced inside the block; a view
    (a broadcast mask) counts as the storage it shares, not as its shape."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.what = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                size = tensor.untyped_storage().nbytes()
                if size > self.largest:
                    self.largest, self.what = size, f"{func} {tuple(tensor.shape)}"
        return out


@contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread: the tiled kernel then runs in the caller's thread, where the probe
    sees its operations."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _largest(model: Any, inputs: dict[str, torch.Tensor], **tracing: Any) -> tuple[int, str]:
    """The largest tensor a forward pass forms: traced (``tracing`` given, with
    ``output_attentions`` among them if wanted) or untraced on qkv's implementation."""
    probe = _LargestTensor()
    wants = bool(tracing.pop("output_attentions", False))
    if tracing:
        with torch.no_grad(), qkv.tracing(model=model, **tracing), probe:
            model(**inputs, output_attentions=wants)
    else:
        previous = model.config._attn_implementation
        model.set_attn_implementation("qkv")
        try:
            with torch.no_grad(), probe:
                model(**inputs)
        finally:
            model.set_attn_implementation(previous)
    return probe.largest, probe.what


@pytest.mark.parametrize(
    "family",
    [
        "llama (GQA)",
        "mistral (sliding window)",
        "gemma2 (softcap)",
        "gpt_oss (sinks)",
        "t5 (position bias, cross-attention)",
    ],
)
def test_one_traced_row_never_forms_a_full_score_matrix(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing one head's last row adds no (B, H, N, N) tensor to the forward pass: the
    reference runs once, on (B, 1, 1, D) queries, and the largest tensor formed is the
    fast path's own (the mask, the kernel's scratch, T5's position bias)."""
    n = 512
    model = _family(family)
    heads = model.config.num_attention_heads if "t5" not in family else model.config.num_heads
    ids = torch.randint(0, 60, (1, n), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids}
    if "t5" in family:
        inputs["decoder_input_ids"] = ids
    seen: dict[str, list[tuple[int, ...]]] = {"all rows": [], "rows": []}

    def counting(kind: str, attend: Any) -> Any:
        def wrapped(xp: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            seen[kind].append(tuple(query.shape))
            return attend(xp, query, *args, **kwargs)

        return wrapped

    for module, kind in ((_reference, "all rows"), (_long_trace, "rows")):
        monkeypatch.setattr(module, "attend", counting(kind, vars(module)["attend"]))
    select = {"layers": -1, "heads": 0, "queries": -1}
    with _one_thread():
        traced, what = _largest(model, inputs, **select)
        dim = getattr(model.config, "d_kv", None) or model.config.head_dim
        assert seen == {"all rows": [], "rows": [(1, 1, 1, dim)]}
        untraced, _ = _largest(model, inputs)
        full, full_what = _largest(model, inputs, **select, output_attentions=True)
    scores_bytes = heads * n * n * 4  # one float32 (1, H, N, N) matrix
    assert len(seen["all rows"]) == len(attention_modules(model))  # output_attentions
    assert full >= scores_bytes, full_what  # the probe sees a full matrix when one is formed
    assert traced <= untraced, what
    if "t5" not in family:  # T5 forms its (1, H, N, N) position bias itself
        # at most one (N, N) float32 matrix: what transformers' mask functions form
        assert traced <= scores_bytes // heads, what


def test_an_exactly_causal_mask_runs_as_is_causal() -> None:
    """transformers' boolean mask becomes ``is_causal`` only when it is exactly causal (as
    its own SDPA path skips the mask), so that the fused kernel skips the blocks above the
    diagonal; padding keeps the mask, and a mask changed in place is looked at again."""
    model = _family("llama (GQA)")
    with torch.no_grad(), qkv.tracing(model=model, layers=0, heads=0, queries=-1) as t:
        model(IDS)
        model(IDS, attention_mask=PADDING["left"])
    plain, padded = t.calls
    assert (plain.meta["causal"], plain.meta["mask"]) == (True, None)
    assert (padded.meta["causal"], padded.meta["mask"]) == (False, "boolean array (2, 1, 6, 6)")
    attention = model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    causal, _ = qkv_attention_forward(attention, q, k, v, mask)
    mask[0, 0, 0, 4] = True  # the same tensor, no longer causal
    changed, _ = qkv_attention_forward(attention, q, k, v, mask)
    for got, allowed in ((causal, mask.tril()), (changed, mask)):
        expected = qkv.attention.reference_attention(q, k, v, mask=allowed, enable_gqa=True)
        torch.testing.assert_close(got, expected.transpose(1, 2), atol=TOL, rtol=0)
    assert not torch.allclose(causal, changed)
