"""Packed sequences (``cu_seqlens``) under ``torch.compile(fullgraph=True)`` (issue 38 §4):
``MultiHeadAttention(...)(x, cu_seqlens=...)`` and ``qkv.varlen_attention`` give eager's
outputs and gradients, and eager gives each sequence's own result in float64; the offsets'
values are checked when the graph runs. Then what packing refuses, each with the hint that
fits it, and offsets on the wrong device.

Graphs compile with the ``aot_eager`` backend (dynamo's capture and AOTAutograd without
generated code), as in ``tests/nn/test_compile.py``. The per-sequence truth follows
flash-attn's varlen tests (Dao-AILab/flash-attention ``tests/test_flash_attn.py``: packed
sequences against each sequence alone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import qkv
from qkv import masks
from qkv.nn import KVCache, MultiHeadAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 2e-6
"""Compiled against eager in float32."""

LENGTHS = [3, 6, 1, 4]
CU = torch.tensor([0, 3, 9, 10, 14], dtype=torch.int32)
X = torch.randn(1, 14, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _fresh_compiler() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _output_and_grads(
    run: Callable[..., torch.Tensor], module: torch.nn.Module, x: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``run(x, **kw)`` and the gradients of a weighted sum of it for x and the module's
    parameters."""
    leaf = x.detach().clone().requires_grad_()
    params = list(module.parameters())
    out = run(leaf, **kw)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), [leaf, *params])
    return out.detach(), list(grads)


MODULES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (constructor options, forward options)
    "causal, RoPE restarting in each sequence, GQA": (
        {"positional": "rope", "num_kv_heads": 2},
        {"is_causal": True},
    ),
    "ALiBi": ({"positional": "alibi"}, {}),
    "a rule in packed positions, offsets as a list": (
        {},
        {"mask": masks.sliding_window(1), "cu_seqlens": CU.tolist()},
    ),
}


@pytest.mark.parametrize("options", list(MODULES.values()), ids=list(MODULES))
def test_multi_head_attention_with_cu_seqlens_compiles_as_eager(
    options: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    made, call = options
    call = {"cu_seqlens": CU, **call}
    torch.manual_seed(1)
    module = MultiHeadAttention(16, 4, **made)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    got, got_grads = _output_and_grads(compiled, module, X, **call)
    want, want_grads = _output_and_grads(module, module, X, **call)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
    # eager, in float64: each sequence as if it were alone
    double = module.double()
    packed = double(X.double(), **call)
    rule = call.get("mask")
    pieces = torch.split(X.double(), LENGTHS, dim=1)
    alone = [double(p, mask=rule, is_causal=call.get("is_causal", False)) for p in pieces]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-12)


def test_offsets_are_checked_when_the_module_graph_runs() -> None:
    module = torch.compile(MultiHeadAttention(16, 4), fullgraph=True, backend="aot_eager")
    module(X, cu_seqlens=CU)
    with pytest.raises(
        ValueError, match=r"^MultiHeadAttention: cu_seqlens ends at 13 but query has 14 tokens"
    ):
        module(X, cu_seqlens=torch.tensor([0, 3, 9, 10, 13], dtype=torch.int32))


Q = torch.randn(14, 4, 8, generator=torch.Generator().manual_seed(2))
KV = torch.randn(14, 2, 8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "options", [{"is_causal": True}, {"window_size": (1, 2)}], ids=["causal", "window"]
)
def test_varlen_attention_compiles_as_eager(options: dict[str, Any]) -> None:
    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = qkv.varlen_attention(q, k, v, CU, CU, 6, 6, **options)
        return out

    compiled = torch.compile(varlen, fullgraph=True, backend="aot_eager")
    results = []
    for run in (compiled, varlen):
        leaves = [x.clone().requires_grad_() for x in (Q, KV, KV * 0.5)]
        out = run(*leaves)
        grads = torch.autograd.grad((out * out).sum(), leaves)
        results.append((out.detach(), grads))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
    # eager against each sequence alone, float64 (the sliding window of the same extent)
    causal = options.get("is_causal", False)
    left, right = options.get("window_size", (None, None))
    for a, b in zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True):
        q, k = Q[a:b].double().transpose(0, 1), KV[a:b].double().transpose(0, 1)
        rule = None if causal else masks.sliding_window(left, right)
        alone = qkv.scaled_dot_product_attention(
            q, k, k * 0.5, is_causal=causal, mask=rule, enable_gqa=True
        )
        torch.testing.assert_close(want[a:b], alone.transpose(0, 1).float(), atol=TOL, rtol=TOL)


def test_varlen_offsets_are_checked_when_the_graph_runs() -> None:
    compiled = torch.compile(qkv.varlen_attention, fullgraph=True, backend="aot_eager")
    compiled(Q, KV, KV, CU, CU, 6, 6)
    with pytest.raises(
        ValueError, match=r"^varlen_attention: max_seqlen_q must be an integer ≥ the longest "
    ):
        compiled(Q, KV, KV, CU, CU, 5, 6)


# -- what packing refuses, each with its own hint --------------------------------------------

ALLOWED = torch.rand(14, 14, generator=torch.Generator().manual_seed(4)) > 0.5
REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "cross-attention": (
        {"key": torch.randn(1, 14, 16)},
        r"takes self-attention only .* got a key\. Hint: .* qkv\.varlen_attention\(q, k, v, "
        r"cu_seqlens_q, cu_seqlens_k",
    ),
    "a cache": (
        {"cache": KVCache()},
        r"takes no KV cache \(a cache holds one sequence per batch row\)\. Hint: train or "
        r"prefill packed without cache=",
    ),
    "key padding": (
        {"key_padding_lengths": [14]},
        r"takes no key_padding_lengths \(packed sequences have no padding: cu_seqlens gives "
        r"their lengths\)\. Hint: drop key_padding_lengths",
    ),
    "a mask tensor": (
        {"mask": ALLOWED},
        r"takes a mask only as a qkv\.masks rule in packed positions, got a torch\.bool "
        r"tensor of shape \(14, 14\)\. Hint: .* masks\.from_function\(lambda b, h, q, kv: "
        r"allowed\[q, kv\]\)",
    ),
    "a batch": (
        {"x": torch.randn(2, 14, 16)},
        r"takes a query of batch 1, \(1, T, E\), got \(2, 14, 16\)\. Hint: pack the sequences",
    ),
    "offsets on meta": (
        {"cu_seqlens": CU.to("meta")},
        r"^MultiHeadAttention: cu_seqlens is on the meta device, which holds no values",
    ),
}


@pytest.mark.parametrize(("change", "says"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_each_refusal_of_packing_has_its_own_hint(change: dict[str, Any], says: str) -> None:
    arguments: dict[str, Any] = {"x": X, "cu_seqlens": CU, **change}
    x = arguments.pop("x")
    with pytest.raises(ValueError, match=says) as caught:
        MultiHeadAttention(16, 4)(x, **arguments)
    assert "\n" not in str(caught.value)


def test_the_mask_tensor_hint_works() -> None:
    """What the hint for a mask tensor says to write: a rule reading the tensor."""
    torch.manual_seed(5)
    module = MultiHeadAttention(16, 4).double()
    allowed = ALLOWED | torch.eye(14, dtype=torch.bool)
    rule = masks.from_function(lambda b, h, q, kv: allowed[q, kv])
    packed = module(X.double(), cu_seqlens=CU, mask=rule)
    first = module(X.double()[:, :3], mask=allowed[:3, :3])
    torch.testing.assert_close(packed[:, :3], first, rtol=0, atol=1e-12)


def test_offsets_on_another_device_than_the_query_are_named() -> None:
    """cu_seqlens on the CPU for a query on ``meta`` (no CUDA needed to see the check)."""
    module = MultiHeadAttention(16, 4).to("meta")
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention: cu_seqlens is on cpu but the query on meta; expected one "
        r"device\. Hint: cu_seqlens\.to\(query\.device\)\.$",
    ):
        module(X.to("meta"), cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"^varlen_attention: cu_seqlens_q is on cpu but the "):
        qkv.varlen_attention(Q.to("meta"), KV.to("meta"), KV.to("meta"), CU, CU, 6, 6)


def test_the_offsets_operator_passes_torchs_checks() -> None:
    """``qkv::packed_offsets``: schema, fake implementation and AOT dispatch (opcheck)."""
    from qkv.attention import _packed_graph  # noqa: F401  (registers the operator)

    words = "cu_seqlens|query|demo|max_seqlen|queries"
    torch.library.opcheck(torch.ops.qkv.packed_offsets.default, (CU, 14, 6, words))
    assert torch.ops.qkv.packed_offsets(CU, 14, 6, words).dtype == torch.int64
