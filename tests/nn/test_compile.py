"""``torch.compile(..., fullgraph=True)`` over qkv.nn modules: the same numbers as eager.

Most cases compile with the ``aot_eager`` backend: torch.compile's own graph capture
(dynamo, fullgraph) and autograd (AOTAutograd) run as with inductor, without generating C++,
so that each case takes seconds. One case runs inductor, as a model builder would (slow).
A graph break fails ``fullgraph=True``: before qkv was compiled, every module here broke the
graph three times (the trace lookup, the array namespace, the NaN check).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import qkv
from qkv import masks
from qkv.attention._backends import BackendName
from qkv.nn import MultiHeadAttention, TransformerBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _fresh_compiler() -> Iterator[None]:
    """Each test compiles from scratch (no cache limit reached by the tests before it)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(
    run: Callable[..., torch.Tensor],
    module: torch.nn.Module,
    call: Callable[[Callable[..., torch.Tensor]], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output of ``call(run)`` and the gradients of its sum for ``module``'s parameters,
    by name (``run``: the module, or the module compiled)."""
    module.zero_grad()
    torch.manual_seed(0)
    out = call(run)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _same_as_eager(
    module: torch.nn.Module,
    call: Callable[[Callable[..., torch.Tensor]], torch.Tensor],
    *,
    backend: str = "aot_eager",
    tol: float = 1e-6,
) -> None:
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    got, got_grads = _run(compiled, module, call)
    expected, expected_grads = _run(module, module, call)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert got_grads.keys() == expected_grads.keys() and expected_grads
    for name, grad in expected_grads.items():
        # equal_nan: a NaN input reaches a projection's weight gradient (0 · NaN), in both
        torch.testing.assert_close(got_grads[name], grad, atol=tol, rtol=tol, equal_nan=True)


X = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(0))
FLOAT_MASK = torch.randn(7, 7, generator=torch.Generator().manual_seed(1)).masked_fill(
    torch.eye(7, dtype=torch.bool).roll(1, 0), -torch.inf
)

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (constructor options, forward options)
    "causal, RoPE, GQA (SDPA in the graph, checked)": (
        {"positional": "rope", "num_kv_heads": 2},
        {"is_causal": True},
    ),
    "unmasked": ({}, {}),
    "float mask (a bias)": ({}, {"mask": FLOAT_MASK}),
    "key padding tensor and a rule": (
        {},
        {"key_padding_lengths": torch.tensor([5, 7]), "mask": masks.sliding_window(3)},
    ),
    "ALiBi": ({"positional": "alibi"}, {"is_causal": True}),
    "sinks and dropout (the tiled kernel's operator)": (
        {"sinks": True, "dropout": 0.2},
        {"is_causal": True},
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_multi_head_attention_compiles_whole_forward_and_backward(case: str) -> None:
    options, forward = CASES[case]
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, **options)
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.normal_()
    x = X.clone().requires_grad_()
    _same_as_eager(module, lambda m: m(x, **forward))
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


@pytest.mark.slow
def test_transformer_block_compiles_with_inductor() -> None:
    """docs/nn.md's example, with inductor (torch.compile's default backend)."""
    torch.manual_seed(0)
    block = TransformerBlock(64, 8, num_kv_heads=2, positional="rope")
    x = torch.randn(2, 10, 64)
    _same_as_eager(block, lambda m: m(x, is_causal=True), backend="inductor", tol=1e-5)


def test_masked_nan_stays_out_of_compiled_outputs_and_gradients() -> None:
    """A NaN in a padded key: SDPA's output in the graph is refused and the tiled kernel
    redoes the call, as in eager; the gradients stay finite."""
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 2)
    memory = torch.randn(2, 6, 16)
    memory[1, 5] = torch.nan  # padding: element 1 has 5 keys
    x = X[:, :5].clone().requires_grad_()
    _same_as_eager(module, lambda m: m(x, memory, key_padding_lengths=[6, 5]))
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_the_public_function_compiles_whole() -> None:
    q, k, v = (torch.randn(1, 4, 6, 8, requires_grad=True) for _ in range(3))
    mask = masks.key_padding([4])

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = qkv.scaled_dot_product_attention(q, k, v, mask=mask, is_causal=True)
        return out

    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, attend(q, k, v), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_the_compiled_output_follows_the_querys_memory_layout(backend: BackendName) -> None:
    """A query made as x.view(B, L, H, D).transpose(1, 2): the output has the query's order
    of strides, compiled as eagerly (issue 25 §4.2), so the view back to (B, L, H·D) needs
    no copy; the tiled kernel's operator itself returns a contiguous output, as its fake
    implementation says."""
    x = torch.randn(2, 6, 4 * 8)
    q = x.view(2, 6, 4, 8).transpose(1, 2)

    def attend(q: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = qkv.scaled_dot_product_attention(
            q, q, q, dropout_p=0.0, is_causal=True, backend=backend
        )
        return out

    eager = attend(q)
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(q)
    torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-6)
    assert got.stride() == eager.stride() == (192, 8, 32, 1)
    assert got.transpose(1, 2).view(2, 6, 32).shape == (2, 6, 32)


def test_values_the_graph_cannot_read_are_checked_when_it_runs() -> None:
    """Key padding lengths out of range: the same ValueError as eager, from the graph."""
    module = torch.compile(MultiHeadAttention(16, 4), fullgraph=True, backend="aot_eager")
    module(X, key_padding_lengths=torch.tensor([7, 7]))
    with pytest.raises(ValueError, match=r"key_padding_lengths must be between 0 and the key "
                       r"length Lk = 7, got \[7, 9\]"):  # fmt: skip
        module(X, key_padding_lengths=torch.tensor([7, 9]))


def test_weights_run_outside_the_graph_and_fullgraph_says_why() -> None:
    module = MultiHeadAttention(16, 4)
    strict = torch.compile(module, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"weights are asked for"):  # dynamo's Unsupported
        strict(X, need_weights=True)
    torch._dynamo.reset()
    lenient = torch.compile(module, backend="aot_eager")  # a graph break, then as eager
    out, weights = lenient(X, need_weights=True)
    expected, expected_weights = module(X, need_weights=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, expected_weights)


def test_a_compiled_model_traced_records_under_its_own_layer_names() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(TransformerBlock(16, 4), TransformerBlock(16, 4))
    compiled = torch.compile(model, backend="aot_eager")
    compiled(X)  # compiled once, untraced
    with qkv.tracing(model=compiled, layers=-1, heads=[1]) as trace:
        out = compiled(X)
    assert trace.layer_names() == ["1.attn"]
    with qkv.tracing(model=model, layers=-1, heads=[1]) as eager_trace:
        expected = model(X)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(
        torch.as_tensor(trace["weights"].value), torch.as_tensor(eager_trace["weights"].value)
    )
