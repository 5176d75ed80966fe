"""qkv.intervene on models of qkv.nn modules: every edit equals a hand-written oracle.

The oracle edits the input of the layer's ``out_proj`` with a forward pre-hook (head h is the
slice h·D:(h+1)·D), taking the values from ``v_proj``'s output; the run is qkv's untouched
forward. GQA (4 query heads, 2 key/value heads), RoPE, causal; float32 and float64.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import torch

import qkv
from qkv.edits import Recording, ablate, head_means, record, scale, set_weights
from qkv.nn import MultiHeadAttention
from tests.support.edit_cases import CASES, HeadView, edited

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 8], [4, 4, 6, 1, 0, 2, 5]])
OTHER = torch.tensor([[3, 3, 1, 8, 2, 9, 9], [7, 0, 5, 5, 6, 1, 2]])


class Tiny(torch.nn.Module):
    """Embedding, ``layers`` pre-norm blocks (GQA, RoPE, causal), a linear head; weights
    from ``seed``."""

    def __init__(self, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 16)
        self.blocks = torch.nn.ModuleList(
            qkv.nn.TransformerBlock(16, num_heads=4, num_kv_heads=2, positional="rope")
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(16, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, is_causal=True)
        out: torch.Tensor = self.head(x)
        return out


def _attn(model: Tiny, layer: int) -> MultiHeadAttention:
    return cast(qkv.nn.TransformerBlock, model.blocks[layer]).attn


@contextmanager
def oracle(model: Tiny, layer: int, head: int, kind: str, value: Any = None) -> Iterator[None]:
    """The model with one case of ``tests/support/edit_cases.py`` applied by hooks."""
    attn = _attn(model, layer)
    seen: dict[str, torch.Tensor] = {}

    def keep_values(_: Any, __: Any, out: torch.Tensor) -> None:
        seen["V"] = out.view(out.shape[0], out.shape[1], attn.num_kv_heads, attn.head_dim)

    def edit(_: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        concat = args[0].clone()
        d = attn.head_dim
        part = slice(head * d, (head + 1) * d)
        v = seen["V"][:, :, head // (attn.num_heads // attn.num_kv_heads)]  # (B, L, D)
        concat[..., part] = edited(
            kind, HeadView(concat[..., part], v, 0), value, CASES[kind].query
        )
        return (concat,)

    handles = [
        attn.v_proj.register_forward_hook(keep_values),
        attn.out_proj.register_forward_pre_hook(edit),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _source(model: Tiny, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, L, D) context of one head on OTHER (the out_proj input) and its (B, L, L)
    weights (the reference's, through qkv.tracing)."""
    attn = _attn(model, layer)
    seen = {}

    def keep(_: Any, args: tuple[torch.Tensor, ...]) -> None:
        seen["context"] = args[0][..., head * attn.head_dim : (head + 1) * attn.head_dim]

    handle = attn.out_proj.register_forward_pre_hook(keep)
    with torch.no_grad(), qkv.tracing(model=model, layers=layer, heads=head) as t:
        model(OTHER)
    handle.remove()
    return seen["context"], torch.from_numpy(t["weights"].value[:, 0]).to(seen["context"])


class _Run:
    """One head of one layer of Tiny, for a case of ``tests/support/edit_cases.py``."""

    def __init__(self, model: Tiny, layer: int, head: int) -> None:
        self.model, self.layer, self.head = model, layer, head
        self.dtype = next(model.parameters()).dtype
        self.generator = torch.Generator().manual_seed(3)
        self.width, self.keys, self.key_mask = _attn(model, layer).head_dim, IDS.shape[1], None

    def record(self, what: str) -> Recording:
        return record(self.model, OTHER, what=what)

    def eager(self, what: str) -> torch.Tensor:
        context, weights = _source(self.model, self.layer, self.head)
        return context if what == "context" else weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", CASES)
def test_every_edit_equals_the_oracle(kind: str, dtype: torch.dtype) -> None:
    """Every case of every kind of edit in the registry (tests/support/edit_cases.py)."""
    model = Tiny().to(dtype).eval()
    for layer, head in ((0, 1), (1, 2)):
        ours, theirs = CASES[kind].make(_Run(model, layer, head), layer, head)
        with torch.no_grad():
            plain = model(IDS)
            with qkv.intervene(model, ours):
                got = model(IDS)
            with oracle(model, layer, head, kind, theirs):
                want = model(IDS)
        assert (got - want).abs().max() <= TOLERANCE[dtype], (layer, head)
        assert (got - plain).abs().max() > 3 * TOLERANCE[dtype]


def test_mean_ablation_uses_the_mean_over_the_prompts() -> None:
    model = Tiny().eval()
    means = head_means(model, [IDS, OTHER])
    contexts = [record(model, ids, layers=1).contexts[1][2] for ids in (IDS, OTHER)]
    expected = torch.cat([c.reshape(-1, 4) for c in contexts]).mean(0)
    torch.testing.assert_close(means.means[1][2], expected, atol=1e-6, rtol=0)
    assert means.tokens == 28
    with torch.no_grad():
        with qkv.intervene(model, ablate(1, 2, how="mean", mean=means)):
            got = model(IDS)
        with oracle(model, 1, 2, "mean", expected):
            want = model(IDS)
    assert (got - want).abs().max() <= 1e-5


def test_decoding_with_a_cache_applies_the_edit_at_each_step() -> None:
    """A KV cache: one token at a time gives the logits of the edited full pass."""
    model = Tiny().eval()
    attn = _attn(model, 0)
    x = torch.randn(1, 5, 16)
    edit = set_weights(0, 3, 4, [0.5, 0.5, 0.0, 0.0, 0.0])
    with torch.no_grad(), qkv.intervene(model, edit, scale(0, 0, 0.5)):
        full = attn(x, is_causal=True)
        cache = qkv.nn.KVCache()
        steps = [attn(x[:, i : i + 1], is_causal=True, cache=cache) for i in range(5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=0)


def test_a_trace_shows_the_edited_concat_and_output() -> None:
    model = Tiny().eval()
    with (
        torch.no_grad(),
        qkv.intervene(model, ablate(0, 1)),
        qkv.tracing(model=model, layers=0, steps=["context", "concat"]) as t,
    ):
        model(IDS)
    (call,) = t.calls
    assert call.meta["edits"] == [{"edit": "ablate", "head": 1, "how": "zero"}]
    assert (t["context"].value[:, 1] == 0).all()
    assert (t["concat"].value[..., 4:8] == 0).all() and (t["concat"].value[..., :4] != 0).any()


def test_intervene_blocks_nest_and_the_model_comes_back() -> None:
    model = Tiny().eval()
    with torch.no_grad():
        plain = model(IDS)
        with qkv.intervene(model, scale(0, 1, 2.0)), qkv.intervene(model, scale(0, 1, 1.5)):
            nested = model(IDS)
        with qkv.intervene(model, scale(0, 1, 3.0)):
            once = model(IDS)
        after = model(IDS)
    torch.testing.assert_close(nested, once, atol=1e-6, rtol=0)
    assert torch.equal(after, plain)
