"""qkv.intervene while decoding with a cache: every step equals the edited full pass.

A patch copies a recorded head at the positions of the call's queries (and, for weights, at
the positions of its keys). Decoding with a cache, a call holds only the new queries, and a
sliding-window cache holds only the last keys: the positions must count the tokens the
window let go. Prompt of four tokens, then one token a step; window 3 and no window; a
qkv.nn model and Hugging Face models with sliding-window layers (through ``generate``, left
padding). The tolerance is derived from the model itself: the full pass in float32 against
float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv
from qkv.edits import Edit, patch, record, set_weights
from qkv.masks import sliding_window

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 6], [4, 4, 6, 1, 0, 2, 5, 9]])
OTHER = torch.tensor([[3, 3, 1, 8, 2, 9, 9, 0], [7, 0, 5, 5, 6, 1, 2, 4]])
PROMPT = 4
EPS_RATIO = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps


class Tiny(torch.nn.Module):
    """Embedding, two blocks (GQA, RoPE, causal; a window of ``window`` tokens), a linear
    head. ``caches``: decode with one KV cache per block."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 16)
        self.blocks = torch.nn.ModuleList(
            qkv.nn.TransformerBlock(16, num_heads=4, num_kv_heads=2, positional="rope")
            for _ in range(2)
        )
        self.head = torch.nn.Linear(16, 10)
        self.window = window

    def forward(self, ids: torch.Tensor, caches: list[qkv.nn.KVCache] | None = None) -> Any:
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            if caches is not None:
                x = block(x, is_causal=True, cache=caches[i])
            elif self.window is None:
                x = block(x, is_causal=True)
            else:
                x = block(x, mask=sliding_window(self.window - 1))
        return self.head(x)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt, then one token a step, with a cache: the logits of every position."""
        caches = [qkv.nn.KVCache(max_length=self.window) for _ in self.blocks]
        steps = [self(ids[:, :PROMPT], caches)]
        steps += [self(ids[:, i : i + 1], caches) for i in range(PROMPT, ids.shape[1])]
        return torch.cat(steps, dim=1)


def _tolerance(run: Any) -> dict[torch.dtype, float]:
    """Per dtype: a few times float32's own error on this run (float32 against float64),
    and that scaled to float64's precision."""
    spread = float((run(torch.float32) - run(torch.float64)).abs().max())
    assert spread > 0
    return {torch.float32: 8 * spread, torch.float64: 8 * spread * EPS_RATIO}


def _tiny_edits(model: Tiny, what: str) -> list[Edit]:
    source = record(model, OTHER, what=what)
    return [patch(0, 1, source, what=what), patch(1, 2, source, what=what)]


@pytest.mark.parametrize("window", [3, None], ids=["window 3", "no window"])
@pytest.mark.parametrize("what", ["context", "weights"])
def test_patching_while_decoding_equals_the_full_pass(what: str, window: int | None) -> None:
    def full(dtype: torch.dtype) -> torch.Tensor:
        model = Tiny(window).to(dtype).eval()
        with torch.no_grad(), qkv.intervene(model, *_tiny_edits(model, what)):
            out: torch.Tensor = model(IDS)
        return out

    tolerance = _tolerance(full)
    for dtype in (torch.float32, torch.float64):
        model = Tiny(window).to(dtype).eval()
        with torch.no_grad():
            plain = model(IDS)
            with qkv.intervene(model, *_tiny_edits(model, what)):
                whole, steps = model(IDS), model.decode(IDS)
        assert (whole - plain).abs().max() > 1e-2  # the patch changes the logits
        for position in range(IDS.shape[1]):  # token by token
            gap = (steps[:, position] - whole[:, position]).abs().max()
            assert gap <= tolerance[dtype], (dtype, position, float(gap))


class Decoder(torch.nn.Module):
    """A model whose forward decodes with caches: what ``record`` runs while decoding."""

    def __init__(self, tiny: Tiny) -> None:
        super().__init__()
        self.tiny = tiny

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tiny.decode(ids)


@pytest.mark.parametrize("what", ["context", "weights"])
def test_a_recording_made_while_decoding_equals_the_full_pass_one(what: str) -> None:
    """Each call's rows go to their positions, a windowed call's weights to its keys'."""
    model = Tiny(3).to(torch.float64).eval()
    full = record(model, OTHER, what=what)
    decoded = record(Decoder(model), OTHER, what=what)
    held = full.contexts if what == "context" else full.weights
    got = decoded.contexts if what == "context" else decoded.weights
    for layer in (0, 1):
        for head in range(4):
            torch.testing.assert_close(got[layer][head], held[layer][head], atol=1e-12, rtol=0)
    if what == "weights":  # the window: no weight before position i - 2
        assert (held[1][0].tril(-3) == 0).all() and (held[1][0].diagonal(-2, 1, 2) > 0).all()


def test_set_weights_in_a_window_counts_the_tokens_it_let_go() -> None:
    """A row over all the positions up to the query: its weights inside the window apply,
    weights on keys the window let go are refused in one line."""
    model = Tiny(3).to(torch.float64).eval()
    row = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.2, 0.3], dtype=torch.float64)
    with torch.no_grad(), qkv.intervene(model, set_weights(1, 0, 6, row)):
        whole, steps = model(IDS[:, :7]), model.decode(IDS[:, :7])
        plain = Tiny(3).to(torch.float64).eval()(IDS[:, :7])
    assert (whole - plain)[:, 6].abs().max() > 1e-2
    torch.testing.assert_close(steps, whole, atol=1e-12, rtol=0)
    gone = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0], dtype=torch.float64)
    with (
        torch.no_grad(),
        qkv.intervene(model, set_weights(1, 0, 6, gone)),
        pytest.raises(ValueError, match=r"^set_weights.*keys 0 to 2, which the cache's window"),
    ):
        model.decode(IDS[:, :7])


def _causal_lm(family: str, dtype: torch.dtype) -> Any:
    from tests.hf.test_hf_tracing import _causal_lm as build

    model = build(family).eval().to(dtype)
    if dtype == torch.float64 and "gpt_oss" in family:
        model.config._experts_implementation = "eager"  # torch's grouped_mm: no float64
    return model


HF_IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
HF_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # left padding
HF_SOURCE = torch.tensor([[7, 3, 9, 12, 5, 30, 2, 8, 4, 9], [2, 40, 41, 42, 6, 8, 1, 3, 5, 7]])
NEW = 4


def _full_pass(model: Any, edits: list[Edit], sequences: torch.Tensor) -> torch.Tensor:
    """The logits of one pass over whole sequences (the prompt's left padding, positions
    counted as ``generate`` counts them), from the prompt's last token on."""
    mask = torch.cat((HF_MASK, HF_MASK.new_ones(2, NEW)), dim=1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad(), qkv.intervene(model, *edits):
        whole = model(sequences, attention_mask=mask, position_ids=positions).logits
    return whole[:, HF_IDS.shape[1] - 1 : -1]  # type: ignore[no-any-return]


def _generated(model: Any, edits: list[Edit]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with a cache under ``edits``: the logits of each new token, and those
    of the full pass over the sequence it made."""
    with torch.no_grad(), qkv.intervene(model, *edits):
        out = model.generate(
            HF_IDS,
            attention_mask=HF_MASK,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    steps = torch.stack(out.logits, dim=1)  # (B, NEW, V): the logits after each position
    return steps, _full_pass(model, edits, out.sequences)


def _patches(model: Any, what: str) -> list[Edit]:
    source = record(model, HF_SOURCE, what=what)
    return [patch(0, 1, source, what=what), patch(1, 0, source, what=what)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral (sliding window)", "gpt_oss (sinks)"])
@pytest.mark.parametrize("what", ["context", "weights"])
def test_patching_inside_generate_equals_the_full_pass(family: str, what: str) -> None:
    """Window 3 (every layer of Mistral's, every other of gpt-oss's): the cache lets tokens
    go from the second new token on. transformers' own decoding is not float64-exact (its
    rotary angles are float32): the tolerance also allows the unedited model's gap."""
    fixed = torch.cat((HF_IDS, torch.tensor([[17, 18, 19, 20], [21, 22, 23, 24]])), dim=1)

    def full(dtype: torch.dtype) -> torch.Tensor:
        model = _causal_lm(family, dtype)
        return _full_pass(model, _patches(model, what), fixed)

    tolerance = _tolerance(full)
    for dtype in (torch.float32, torch.float64):
        model = _causal_lm(family, dtype)
        steps, plain = _generated(model, [])
        allowed = max(tolerance[dtype], 4 * float((steps - plain).abs().max()))
        steps, whole = _generated(model, _patches(model, what))
        assert (whole - plain).abs().max() > 1e-3  # the patches change the logits
        for step in range(NEW):  # token by token
            gap = (steps[:, step] - whole[:, step]).abs().max()
            assert gap <= allowed, (dtype, step, float(gap))
