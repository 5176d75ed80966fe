"""qkv as the attention of an nnsight 0.8 ``LanguageModel``, against the same model on
transformers' eager attention.

The model is loaded from a local folder (``LanguageModel(folder, dispatch=True)``). The
intervention is nnsight's head ablation as its tutorials write it: the input of the
output projection (``o_proj.input`` / ``c_proj.input``, the heads' concatenated
contexts) set to zero for one head's slice, and the saved values and logits must equal
the eager model's within 1e-5 in float32; the pattern ``qkv.tracing`` recomputes must
equal eager's ``output_attentions`` within 1e-6.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from nnsight import LanguageModel
from nnsight.modeling.transformers import TransformersModel
from transformers import AutoTokenizer

import qkv
from qkv.interp import use_qkv
from tests.interp.conftest import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "the cat sat on the mat and the dog ran"
HEAD = 1  # ablated; head size 8: features 8..15 of the output projection's input


def load(folder: Path, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LanguageModel's deprecation notice in nnsight 0.8
        return LanguageModel(str(folder), device_map="cpu", dispatch=True, **kwargs)


def blocks(model: Any) -> Any:
    inner = model.model if hasattr(model, "model") else model.transformer
    return inner.layers if hasattr(inner, "layers") else inner.h


def ablate_and_read(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """nnsight: head ``HEAD`` of layer 0 zeroed; layer 1's attention output and the logits
    saved."""
    layers = blocks(model)
    first = layers[0].self_attn if hasattr(layers[0], "self_attn") else layers[0].attn
    second = layers[1].self_attn if hasattr(layers[1], "self_attn") else layers[1].attn
    out = first.o_proj if hasattr(first, "o_proj") else first.c_proj
    with torch.no_grad(), model.trace(PROMPT):
        out.input[:, :, 8 * HEAD : 8 * HEAD + 8] = 0.0
        attention = second.output[0].save()
        logits = model.lm_head.output.save()
    return attention, logits


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, folders: dict[str, Path]) -> tuple[Any, Any]:
    """(the model on eager attention, the same model switched to qkv)."""
    folder = folders[request.param]
    fast = load(folder)
    use_qkv(fast)
    return load(folder, attn_implementation="eager"), fast


def test_an_intervention_equals_eager(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    assert fast._module.config._attn_implementation == "qkv"
    attention_eager, logits_eager = ablate_and_read(eager)
    attention_fast, logits_fast = ablate_and_read(fast)
    with torch.no_grad(), eager.trace(PROMPT):
        clean = eager.lm_head.output.save()
    assert float((logits_eager - clean).abs().max()) > 1e-3  # the ablation changes the answer
    assert float((attention_fast - attention_eager).abs().max()) <= 1e-5
    assert float((logits_fast - logits_eager).abs().max()) <= 1e-5


def test_tracing_gives_eager_pattern_inside_an_nnsight_trace(pair: tuple[Any, Any]) -> None:
    eager, fast = pair
    with qkv.tracing(model=fast, layers=-1, heads=[2, 0], queries=-1) as t, fast.trace(PROMPT):
        pass
    ids = eager.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        attentions = eager._module(ids, output_attentions=True).attentions
    last = qkv.hf.attention_modules(fast._module)[-1][0]  # its module path in transformers
    assert t.layer_names() == [last] and last.endswith(("layers.1.self_attn", "h.1.attn"))
    rows = torch.from_numpy(t["weights"].value)  # (B, 2 heads, 1 row, N)
    assert rows.shape == (1, 2, 1, ids.shape[1])
    assert float((rows - attentions[-1][:, [2, 0]][:, :, [-1]]).abs().max()) <= 1e-6
    assert t.calls[0].meta["backend"] == "sdpa"  # the model ran the fast path


def test_restore_gives_back_the_previous_attention(folders: dict[str, Path]) -> None:
    model = TransformersModel(  # nnsight 0.8's name for LanguageModel
        str(folders["llama"]), task="text-generation", device_map="cpu", dispatch=True
    )
    switch = use_qkv(model)
    assert switch.tool == "nnsight" and model._module.config._attn_implementation == "qkv"
    switch.restore()
    switch.restore()  # once
    assert model._module.config._attn_implementation == "sdpa"


def test_a_model_not_yet_dispatched_is_switched_once_its_weights_are_real(
    folders: dict[str, Path],
) -> None:
    folder = folders["llama"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LanguageModel(
            str(folder), tokenizer=AutoTokenizer.from_pretrained(folder), device_map="cpu"
        )
    assert not model.dispatched  # built on the meta device until its first run
    use_qkv(model)
    assert model.dispatched and model._module.config._attn_implementation == "qkv"
    with qkv.tracing(model=model, heads=0, queries=-1) as t, model.trace(PROMPT):
        pass
    assert {c.meta["backend"] for c in t.calls} == {"sdpa"}
