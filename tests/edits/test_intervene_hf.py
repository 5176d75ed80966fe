"""qkv.intervene on Hugging Face models: every edit equals the hand-written eager oracle.

The oracle (tests/edits/oracle.py) is the model's own eager attention with a forward
pre-hook on the edited layer's output projection that edits the same slice of its input.
Every family qkv traces, left padding, float32 (1e-5) and float64 (1e-10); compared on the
real (non-padding) tokens, as tests/hf compares tracing with eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv
from qkv.edits import Recording, ablate, patch, record, scale, set_weights
from qkv.hf import attention_modules
from tests.edits.oracle import OracleEdit, oracle, record_eager
from tests.hf.test_hf_tracing import PADDING, _configs, _family, _inputs, _real
from tests.support.edit_cases import CASES

FAMILIES = list(_configs())
KINDS = tuple(CASES)  # every case of every kind of edit in the registry
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
SOURCE_IDS = torch.tensor([[7, 3, 9, 12, 5, 30], [2, 40, 41, 42, 6, 8]])


def _model(family: str, dtype: torch.dtype) -> tuple[Any, str]:
    model = _family(family).to(dtype)
    if getattr(model.config, "init_std", None) is not None:  # BART, Whisper: weights of
        generator = torch.Generator().manual_seed(2)  # std 0.02 make an edit invisible
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                weight = torch.randn(module.weight.shape, generator=generator) * 0.3
                module.weight.data.copy_(weight)
    if dtype == torch.float64 and "gpt_oss" in family:
        model.config._experts_implementation = "eager"  # torch's grouped_mm: no float64
    return model, _configs()[family][2]


def _cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _source_inputs(kind: str, mask: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Other inputs of the same shapes: the run a patch copies from."""
    inputs = _cast(_inputs(kind, mask), dtype)
    for name in ("input_ids", "decoder_input_ids"):
        if name in inputs:
            inputs[name] = SOURCE_IDS
    for name in ("input_features", "pixel_values"):
        if name in inputs:
            inputs[name] = inputs[name].flip(-1) * 0.5
    return inputs


def _hidden(output: Any) -> list[torch.Tensor]:
    return [
        getattr(output, f)
        for f in ("last_hidden_state", "encoder_last_hidden_state")
        if getattr(output, f, None) is not None
    ]


class _Run:
    """One head of one layer of a family's model, for a case of
    ``tests/support/edit_cases.py``: qkv's recordings and the eager oracle's."""

    def __init__(self, model: Any, layer: int, head: int, inputs: Any, source: Any) -> None:
        self.model, self.layer, self.head = model, layer, head
        self.inputs, self.source = inputs, source
        self.dtype = model.dtype
        self.generator = torch.Generator().manual_seed(3)

    @property
    def keys(self) -> int:
        """Lk of the edited call: a row of its keys."""
        shapes = record(self.model, self.inputs, layers=self.layer, heads=self.head, what="weights")
        return int(shapes.weights[self.layer][self.head].shape[-1])

    @property
    def key_mask(self) -> torch.Tensor | None:
        """No weight on padding keys, whose values differ."""
        return PADDING["left"].all(0) if self.keys == PADDING["left"].shape[1] else None

    @property
    def width(self) -> int:
        recorded = record(self.model, self.inputs, layers=self.layer, heads=self.head)
        return int(recorded.contexts[self.layer][self.head].shape[-1])

    def record(self, what: str) -> Recording:
        return record(self.model, self.source, layers=self.layer, heads=self.head, what=what)

    def eager(self, what: str) -> torch.Tensor:
        context, weights = record_eager(
            self.model, lambda: self.model(**self.source), self.layer, self.head
        )
        found: torch.Tensor = context if what == "context" else weights
        return found


def _edits(
    model: Any, kind: str, layer: int, head: int, inputs: Any, source_inputs: Any
) -> tuple[Any, OracleEdit]:
    """The qkv edit and the oracle's edit of one case."""
    run = _Run(model, layer, head, inputs, source_inputs)
    ours, value = CASES[kind].make(run, layer, head)
    causal = bool(getattr(attention_modules(model)[layer][1], "is_causal", False))
    query, extra = CASES[kind].query, {"queries_last": causal}
    return ours, OracleEdit(kind, layer, head, value, query=query, extra=extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_edit_equals_the_eager_oracle(family: str, kind: str, dtype: torch.dtype) -> None:
    model, family_kind = _model(family, dtype)
    mask = PADDING["left"]
    inputs = _cast(_inputs(family_kind, mask), dtype)
    source_inputs = _source_inputs(family_kind, mask, dtype)
    layers = len(attention_modules(model))
    implementation = model.config._attn_implementation
    for layer, head in ((0, 1), (layers - 1, 3)):
        ours_edit, their_edit = _edits(model, kind, layer, head, inputs, source_inputs)
        with torch.no_grad():
            if layer == 0:
                with qkv.intervene(model):  # unedited (eager may give NaN in float64)
                    plain = model(**inputs)
            with qkv.intervene(model, ours_edit):
                ours = model(**inputs)
            with oracle(model, their_edit):
                theirs = model(**inputs)
        for got, want, before in zip(_hidden(ours), _hidden(theirs), _hidden(plain), strict=True):
            real = _real(got.shape[1], family_kind, mask)
            assert (got - want)[real].abs().max() <= TOLERANCE[dtype], (layer, head)
            if layer == 0:  # the edit changed something: the test can fail
                assert (got - before)[real].abs().max() > 3 * TOLERANCE[dtype]
    assert model.config._attn_implementation == implementation  # restored


def test_an_edit_of_one_query_head_leaves_the_heads_sharing_its_kv_head() -> None:
    """GQA (4 query heads, 2 key/value heads): editing head 1 leaves head 0, which shares
    its key/value head, and the others exactly as the fast kernel computed them."""
    model = _family("llama (GQA)")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    before = record(model, ids, layers=0)
    source = record(model, torch.tensor([[11, 12, 13, 14, 15, 16]]), layers=0, what="weights")
    for edit in (
        ablate(0, 1),
        patch(0, 1, source, what="weights"),
        set_weights(0, 1, 3, [1 / 6] * 6),
    ):
        with qkv.intervene(model, edit):
            after = record(model, ids, layers=0)
        for head in (0, 2, 3):
            assert torch.equal(after.contexts[0][head], before.contexts[0][head]), (edit, head)
        assert not torch.equal(after.contexts[0][1], before.contexts[0][1])


def _causal_lm(family: str, dtype: torch.dtype = torch.float32) -> Any:
    from tests.hf.test_hf_tracing import _causal_lm as build

    return build(family).eval().to(dtype)


@pytest.mark.parametrize("family", ["llama (GQA)", "mistral (sliding window)", "gpt_oss (sinks)"])
def test_generate_with_a_cache_equals_the_oracle(family: str) -> None:
    """Greedy decoding with a cache (one query per step after the prompt): the logits of
    every step equal the eager oracle's, with a context edit and a weight edit."""
    model = _causal_lm(family)
    ids, mask = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]), PADDING["left"]
    row = torch.tensor([0.0, 0.0, 0.3, 0.1, 0.4, 0.2])  # none on the padding keys
    ours_edits = (ablate(0, 2), scale(1, 1, 3.0), set_weights(1, 0, 5, row))
    their_edits = (
        OracleEdit("zero", 0, 2),
        OracleEdit("scale", 1, 1, 3.0),
        OracleEdit("row", 1, 0, row, query=5, extra={"queries_last": True}),
    )
    settings = {"max_new_tokens": 4, "do_sample": False, "output_logits": True}
    settings["return_dict_in_generate"] = True
    with torch.no_grad():
        with qkv.intervene(model, *ours_edits):
            ours = model.generate(ids, attention_mask=mask, **settings)
        with oracle(model, *their_edits):
            theirs = model.generate(ids, attention_mask=mask, **settings)
        plain = model.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == 4
    for got, want in zip(ours.logits, theirs.logits, strict=True):
        assert (got - want).abs().max() <= 1e-5
    assert (ours.logits[0] - plain.logits[0]).abs().max() > 1e-3


def test_a_causal_lm_gives_the_oracle_logits_in_float64() -> None:
    model = _causal_lm("llama (GQA)", torch.float64)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    source = record(model, torch.tensor([[9, 9, 3, 4, 20, 1]]), what="weights")
    _, weights = record_eager(model, lambda: model(torch.tensor([[9, 9, 3, 4, 20, 1]])), 1, 2)
    with torch.no_grad():
        with qkv.intervene(model, patch(1, 2, source, what="weights"), ablate(0, 0)):
            ours = model(ids).logits
        with oracle(model, OracleEdit("weights", 1, 2, weights), OracleEdit("zero", 0, 0)):
            theirs = model(ids).logits
    assert (ours - theirs).abs().max() <= 1e-10


def test_a_trace_inside_shows_the_edited_numbers_and_the_edits() -> None:
    model = _family("llama (GQA)")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    row = [0.0, 0.5, 0.0, 0.0, 0.0, 0.5]
    edits = (ablate(1, 1), set_weights(1, 2, -1, row))
    with (
        torch.no_grad(),
        qkv.intervene(model, *edits),
        qkv.tracing(model=model, layers=1, heads=[1, 2], queries=[-1]) as t,
    ):
        model(ids)
    (call,) = t.calls
    assert call.meta["edits"] == [
        {"edit": "ablate", "head": 1, "how": "zero"},
        {"edit": "set_weights", "head": 2, "query": -1},
    ]
    context = t["context"]
    assert context.index is not None and context.index["head"] == [1, 2]
    assert (context.value[:, 0] == 0).all()  # head 1 ablated, in the trace too
    assert t["weights"].value[0, 1, 0].tolist() == pytest.approx(row)
    with torch.no_grad(), qkv.tracing(model=model, layers=1, heads=[2], queries=[-1]) as plain:
        model(ids)
    assert "edits" not in plain.calls[0].meta
    assert t["weights"].value[0, 1, 0].tolist() != pytest.approx(
        plain["weights"].value[0, 0, 0].tolist()
    )


def _run_edited(model: Any, *edits: Any, ids: torch.Tensor | None = None) -> None:
    """Enter an intervene block with ``edits`` (and run the model on ``ids``)."""
    with torch.no_grad(), qkv.intervene(model, *edits):
        if ids is not None:
            model(ids)


def test_edits_are_checked_against_the_model() -> None:
    model = _family("llama (GQA)")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with pytest.raises(ValueError, match=r"ablate\(layer=5, head=0\): layer 5 does not exist"):
        _run_edited(model, ablate(5, 0))
    with pytest.raises(ValueError, match=r"has 4 query heads\. Hint: choose a head from 0 to 3"):
        _run_edited(model, ablate(0, 4))
    with pytest.raises(ValueError, match=r"no attention layer is named 'layers\.9'"):
        _run_edited(model, scale("layers.9", 0, 2.0))
    with pytest.raises(TypeError, match="edit 0 is a str, not an edit"):
        _run_edited(model, "ablate")
    source = record(model, torch.tensor([[5, 6, 7]]), layers=0, heads=1)
    with pytest.raises(ValueError, match=r"holds no context of that head .*\(0, 1\)"):
        _run_edited(model, patch(1, 1, source))
    with pytest.raises(ValueError, match="reaches position 5 but the recording holds 3"):
        _run_edited(model, patch(0, 1, source), ids=ids)
    with pytest.raises(ValueError, match=r"weights of shape \(4,\) for a row of 6 keys"):
        _run_edited(model, set_weights(0, 1, 2, [0.25] * 4), ids=ids)
    assert model.config._attn_implementation == "sdpa"


def test_edit_arguments_are_checked_when_written() -> None:
    with pytest.raises(TypeError, match="head must be a query head index"):
        ablate(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer must be an integer or a module path"):
        scale(1.5, 0, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"how=.mean. needs mean=\.\.\., got none"):
        ablate(0, 0, how="mean")
    with pytest.raises(ValueError, match="how must be 'zero' or 'mean', got 'max'"):
        ablate(0, 0, how="max")
    with pytest.raises(TypeError, match="factor must be a finite number, got nan"):
        scale(0, 0, float("nan"))
    with pytest.raises(ValueError, match="weights must hold finite numbers"):
        set_weights(0, 0, 1, [0.5, float("inf")])
    with pytest.raises(ValueError, match=r"weights must have shape \(Lk,\) or \(B, Lk\)"):
        set_weights(0, 0, 1, torch.ones(1, 2, 3))
    with pytest.raises(TypeError, match="source must be a recording, got dict"):
        patch(0, 0, {})  # type: ignore[arg-type]
