"""Tracing Hugging Face models on a CUDA GPU (issue 30): one head and one query row of every
layer, recorded on the CPU, must equal the model's own ``eager`` implementation run on the
same GPU in float32, and the traced model's outputs must equal eager's.

The families are the tiny random-weight models of ``tests/hf/test_hf_tracing.py`` (imported,
not copied): grouped-query heads, sliding windows, softcapping, sinks, position bias,
cross-attention, audio and image inputs. The expectation that ``output_attentions=True``
returns eager's weights follows transformers' own ``test_attention_outputs``.

Needs a CUDA device; skipped elsewhere (tests/cuda/conftest.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers

import qkv
from tests.hf.test_hf_fast import _eager_weights
from tests.hf.test_hf_tracing import FAMILIES, PADDING, _configs, _family, _inputs, _real

pytestmark = pytest.mark.cuda

CUDA = "cuda"
TOL = 1e-5  # float32 on the GPU: SDPA's and eager's sums differ in their last bits


def _on_cuda(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.to(CUDA) for name, value in inputs.items()}


def _forward(model: Any, kind: str, mask: torch.Tensor, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(**_on_cuda(_inputs(kind, mask)), **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_traced_head_on_cuda_equals_eager_in_float32(family: str) -> None:
    model = _family(family).to(CUDA)
    kind = _configs()[family][2]
    mask = PADDING["left"]
    own = model.config._attn_implementation  # what the family runs by default (sdpa, eager)
    model.set_attn_implementation("eager")
    eager = _forward(model, kind, mask, output_attentions=True)
    model.set_attn_implementation(own)
    try:
        with qkv.tracing(model=model, heads=1, queries=-1) as trace:
            got = _forward(model, kind, mask)
    except ValueError as error:  # the family's attention in this transformers version
        if "AttentionInterface" not in str(error):
            raise
        pytest.skip(f"transformers {transformers.__version__}: {error}")
    assert trace.calls, "no attention call was traced"
    for field in ("last_hidden_state", "encoder_last_hidden_state"):
        if getattr(eager, field, None) is not None:
            ours, theirs = getattr(got, field), getattr(eager, field)
            assert ours.device.type == CUDA, field
            real = _real(ours.shape[1], kind, mask).to(CUDA)
            distance = float((ours - theirs)[real].abs().max())
            assert distance <= TOL, f"{field}: {distance:.3g} from eager"
    expected = _eager_weights(eager)
    assert len(expected) == len(trace.calls)
    for call, theirs in zip(trace.calls, expected, strict=True):
        weights = next(step for step in call.steps if step.name == "weights")
        assert isinstance(weights.value, np.ndarray), "the trace is not on the CPU"
        assert weights.index is not None and weights.index["head"] == [1]
        row = weights.value[:, 0, 0]
        np.testing.assert_allclose(
            row, theirs[:, 1, -1].cpu().numpy(), atol=TOL, rtol=0, err_msg=str(call.layer)
        )
