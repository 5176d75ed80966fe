"""Hugging Face models with qkv in place of PyTorch's SDPA train exactly as with SDPA.

Issue 12 ("Done when"): tiny T5, BART, Llama and BERT models, built from configs (random
weights, nothing downloaded), run with ``attn_implementation="sdpa"``. transformers'
``sdpa_attention_forward`` (``transformers/integrations/sdpa_attention.py``) looks up
``torch.nn.functional.scaled_dot_product_attention`` at call time and passes it

- ``attn_mask``: ``None``, a boolean mask (True = may attend, as qkv), or a float mask that
  holds ``torch.finfo(dtype).min`` where a key is blocked (T5 adds its position bias to it);
- ``dropout_p``, ``scale`` (T5 passes 1.0: no scaling), ``is_causal`` (only without a mask;
  top-left, as qkv's default) and ``enable_gqa`` (Llama with fewer key/value heads).

Each model trains a few steps twice from the same weights on the same batch: once with torch's
function, once with it replaced (monkeypatch) by a wrapper that calls
:func:`qkv.scaled_dot_product_attention`. Batches are right-padded and left-padded; a
left-padded T5 decoder has rows whose keys all carry ``finfo.min`` (a padded query row under
the causal mask), which gave a NaN loss before issue 12's fixes. The losses must be finite and
equal to SDPA's to float32 accuracy, and so must the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

import qkv
from tests.support.backends import backend_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# torch's own function, bound before any test replaces it.
TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention

VOCAB = 24
BATCH, SEQ = 3, 7
STEPS = 3
# float32: one rounding is 6e-8; a few layers, a softmax and three optimizer steps stay within
# a few hundred of them (the two paths sum in different orders).
RTOL, ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class Case:
    """A tiny model and how to build its batch."""

    name: str
    build: Callable[[float], torch.nn.Module]  # dropout probability -> model
    seq2seq: bool = False
    causal_lm: bool = False


def _sdpa_model(cls: Any, config: transformers.PretrainedConfig) -> torch.nn.Module:
    """``cls`` built from ``config`` (random weights) with ``attn_implementation="sdpa"``."""
    model: transformers.PreTrainedModel = cls._from_config(config, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    return model


def _t5(dropout: float) -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=dropout,
        pad_token_id=0,
        eos_token_id=1,
    )
    return _sdpa_model(transformers.T5ForConditionalGeneration, config)


def _bart(dropout: float) -> torch.nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=dropout,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        decoder_start_token_id=2,
    )
    return _sdpa_model(transformers.BartForConditionalGeneration, config)


def _llama(dropout: float) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=32,
        attention_dropout=dropout,
        pad_token_id=0,
    )
    return _sdpa_model(transformers.LlamaForCausalLM, config)


def _bert(dropout: float) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
    )
    return _sdpa_model(transformers.BertForMaskedLM, config)


CASES = [
    Case("t5", _t5, seq2seq=True),
    Case("bart", _bart, seq2seq=True),
    Case("llama", _llama, causal_lm=True),
    Case("bert", _bert),
]


def _padding_mask(lengths: list[int], padding: str) -> torch.Tensor:
    """(B, SEQ) of 1 (token) and 0 (padding), the padding on the given side ("none": all 1)."""
    mask = torch.ones(len(lengths), SEQ, dtype=torch.long)
    if padding == "none":
        return mask
    for row, n in enumerate(lengths):
        pad = slice(n, None) if padding == "right" else slice(None, SEQ - n)
        mask[row, pad] = 0
    return mask


def _batch(case: Case, padding: str) -> dict[str, torch.Tensor]:
    """One fixed batch: rows of different lengths, padded on the ``padding`` side."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = _padding_mask([SEQ, 5, 2], padding)
    ids = ids.masked_fill(mask == 0, 0)
    if not case.seq2seq:
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
    dec_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    dec_mask = _padding_mask([4, SEQ, 3], padding)
    dec_ids = dec_ids.masked_fill(dec_mask == 0, 0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder_input_ids": dec_ids,
        "decoder_attention_mask": dec_mask,
        "labels": dec_ids.masked_fill(dec_mask == 0, -100),
    }


@dataclass
class Run:
    """What one training run gives: a loss per step and the gradients of the first step."""

    losses: list[float]
    grads: dict[str, torch.Tensor]


def _train(case: Case, padding: str, dropout: float = 0.0) -> Run:
    """``STEPS`` steps of SGD from the same weights (seed 0) on the same batch."""
    torch.manual_seed(0)
    model = case.build(dropout)
    batch = _batch(case, padding)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    run = Run([], {})
    model.train()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        run.losses.append(loss.item())
        if step == 0:
            run.grads = {
                name: p.grad.detach().clone()
                for name, p in model.named_parameters()
                if p.grad is not None
            }
        optimizer.step()
    return run


@dataclass(frozen=True)
class SdpaCall:
    """The arguments transformers passed, in short."""

    mask: str  # "none", "bool" or "float"
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    dropout_p: float


def qkv_in_place_of_sdpa(backend: str, calls: list[SdpaCall]) -> Callable[..., torch.Tensor]:
    """A stand-in for ``torch.nn.functional.scaled_dot_product_attention`` that runs qkv.

    torch's boolean ``attn_mask`` is True = may attend, as qkv's ``mask``; a float one is
    added to the scores, as qkv's ``bias``. Every call is recorded in ``calls``.
    """

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        is_bool = attn_mask is not None and attn_mask.dtype == torch.bool
        kind = "none" if attn_mask is None else "bool" if is_bool else "float"
        calls.append(SdpaCall(kind, is_causal, scale, enable_gqa, dropout_p))
        out: torch.Tensor = qkv.scaled_dot_product_attention(
            query,
            key,
            value,
            mask=attn_mask if is_bool else None,
            bias=None if is_bool else attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            dropout_p=dropout_p,
            backend=backend,
        )
        return out

    return sdpa


@contextmanager
def qkv_sdpa(backend: str) -> Iterator[list[SdpaCall]]:
    """Within the block, transformers' SDPA path runs qkv with ``backend``."""
    calls: list[SdpaCall] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            torch.nn.functional,
            "scaled_dot_product_attention",
            qkv_in_place_of_sdpa(backend, calls),
        )
        yield calls


_TORCH_RUNS: dict[tuple[str, str], Run] = {}


def _torch_run(case: Case, padding: str) -> Run:
    """The run with torch's own SDPA (computed once per model and padding)."""
    assert torch.nn.functional.scaled_dot_product_attention is TORCH_SDPA
    key = (case.name, padding)
    if key not in _TORCH_RUNS:
        _TORCH_RUNS[key] = _train(case, padding)
    return _TORCH_RUNS[key]


PADDINGS = ["right", "left", "none"]
# torch's own SDPA is the run compared against: qkv's sdpa backend would compare it with itself.
BACKENDS = [name for name in backend_names(auto=True) if name != "sdpa"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_trains_as_with_torch_sdpa(case: Case, padding: str, backend: str) -> None:
    """Same losses (finite) and same first-step gradients as with torch's SDPA."""
    expected = _torch_run(case, padding)
    with qkv_sdpa(backend) as calls:
        got = _train(case, padding)
    assert calls, "transformers did not call torch.nn.functional.scaled_dot_product_attention"
    assert all(math.isfinite(loss) for loss in got.losses), got.losses
    assert all(math.isfinite(loss) for loss in expected.losses), expected.losses
    torch.testing.assert_close(got.losses, expected.losses, rtol=RTOL, atol=ATOL)
    assert got.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        torch.testing.assert_close(
            got.grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=_about(name)
        )


def _about(name: str) -> Callable[[str], str]:
    """assert_close's message, prefixed with the parameter's name."""
    return lambda message: f"gradient of {name}: {message}"


def test_the_models_pass_every_kind_of_argument() -> None:
    """The cases above reach what transformers passes: no mask with ``is_causal``, boolean and
    float (``finfo.min``) masks, ``scale`` 1.0 (T5), ``enable_gqa`` (Llama), one call per
    attention layer and step. Run on the reference, which is quick."""
    seen: dict[str, list[SdpaCall]] = {}
    for case in CASES:
        for padding in PADDINGS:
            with qkv_sdpa("reference") as calls:
                _train(case, padding)
            seen[f"{case.name}/{padding}"] = calls
    every = [call for calls in seen.values() for call in calls]
    assert {call.mask for call in every} == {"none", "bool", "float"}
    assert any(call.is_causal and call.mask == "none" for call in every)
    assert any(call.enable_gqa for call in seen["llama/none"])
    assert any(call.scale == 1.0 for call in seen["t5/left"])
    assert all(call.mask == "float" for call in seen["t5/left"])  # the position bias
    # T5 and BART: encoder self, decoder self and cross attention in each of 2 layers.
    assert len(seen["t5/right"]) == len(seen["bart/right"]) == 2 * 3 * STEPS


@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_t5_with_dropout_trains_with_finite_losses(backend: str) -> None:
    """With attention dropout (which qkv draws with its own pattern, not torch's random
    numbers, so the losses differ from SDPA's) a left-padded T5 still has finite losses and
    gradients; ``auto`` picks the tiled kernel for dropout."""
    with qkv_sdpa(backend) as calls:
        run = _train(CASES[0], "left", dropout=0.2)
    assert any(call.dropout_p == 0.2 for call in calls)
    assert all(math.isfinite(loss) for loss in run.losses), run.losses
    assert all(bool(torch.isfinite(grad).all()) for grad in run.grads.values())
