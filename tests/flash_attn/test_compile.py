"""``torch.compile(fullgraph=True)`` over ``qkv.flash_attn``'s functions (issue 38 §4): the
same outputs, log-sum-exps, probabilities and gradients as eager, and eager the same as
flash-attn's semantics in float64.

The float64 truth is ``tests/flash_attn/reference.py`` (after flash-attn's
``attention_ref`` in Dao-AILab/flash-attention ``tests/test_flash_attn.py``), run per
sequence for the packed forms. Graphs are compiled with the ``aot_eager`` backend: dynamo's
capture with ``fullgraph=True`` and AOTAutograd, without generating code (seconds a case).
Offsets are tensors the graph cannot read while it is traced: their values are checked when
the graph runs, with eager's one-line errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from qkv.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from tests.flash_attn.reference import alibi_bias, attention_ref, cu_seqlens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 2e-6
"""Compiled against eager, float32: the same kernels, or the same formula in another order
(a few units of float32 rounding on values of order 1)."""

REF_TOL = 1e-5
"""Eager float32 against the float64 reference on these small shapes."""


@pytest.fixture(autouse=True)
def _fresh_compiler() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _draw(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _outputs_and_grads(
    fn: Callable[..., Any], inputs: list[torch.Tensor], rest: tuple[Any, ...], kw: dict[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What ``fn(*inputs, *rest, **kw)`` returns (a tensor or a tuple) and the gradients of
    a weighted sum of its output for ``inputs``, the dropout drawn from seed 0."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(0)
    result = fn(*leaves, *rest, **kw)
    results = list(result) if isinstance(result, tuple) else [result]
    out = results[0]
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return [r.detach() for r in results], list(grads)


def _compiled_equals_eager(
    fn: Callable[..., Any], inputs: list[torch.Tensor], *rest: Any, **kw: Any
) -> list[torch.Tensor]:
    """Compile ``fn`` with fullgraph=True; its results and gradients equal eager's. Returns
    eager's results."""
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, got_grads = _outputs_and_grads(compiled, inputs, rest, kw)
    want, want_grads = _outputs_and_grads(fn, inputs, rest, kw)
    assert len(got) == len(want)
    for a, b in zip(got + got_grads, want + want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
    return want


# -- padded batches --------------------------------------------------------------------------

Q, K, V = _draw(2, 5, 4, 8, seed=1), _draw(2, 7, 2, 8, seed=2), _draw(2, 7, 2, 8, seed=3)
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])

BATCHED: dict[str, dict[str, Any]] = {
    "causal, fewer queries than keys, GQA (SDPA in the graph)": {"causal": True},
    "local window": {"window_size": (2, 1)},
    "softcap, ALiBi, causal, probabilities (the dense form in the graph)": {
        "softcap": 3.0,
        "alibi_slopes": SLOPES,
        "causal": True,
        "return_attn_probs": True,
    },
}


@pytest.mark.parametrize("options", list(BATCHED.values()), ids=list(BATCHED))
def test_flash_attn_func_compiles_as_eager(options: dict[str, Any]) -> None:
    eager = _compiled_equals_eager(flash_attn_func, [Q, K, V], **options)
    window = (-1, 0) if options.get("causal") else options.get("window_size", (-1, -1))
    bias = None
    if "alibi_slopes" in options:
        bias = alibi_bias(SLOPES, 5, 7, torch.full((2,), 5), torch.full((2,), 7))
    out, weights, lse = attention_ref(
        Q, K, V, window=window, softcap=options.get("softcap", 0.0), bias=bias
    )
    torch.testing.assert_close(eager[0], out, atol=REF_TOL, rtol=REF_TOL)
    if options.get("return_attn_probs"):
        torch.testing.assert_close(eager[2], weights, atol=REF_TOL, rtol=REF_TOL)
        lse_ref = lse + (SLOPES[:, None] * torch.arange(5)[None, :] + 2 * SLOPES[:, None])
        torch.testing.assert_close(
            eager[1].double(), lse_ref.to(torch.float64), atol=REF_TOL, rtol=REF_TOL
        )


def test_dropout_in_the_graph_drops_what_eager_drops() -> None:
    """The same seed, the same weights dropped: outputs and gradients equal eager's."""
    _compiled_equals_eager(flash_attn_func, [Q, K, V], dropout_p=0.3, causal=True)


def test_the_packed_batch_forms_compile() -> None:
    qkv = torch.stack((Q, Q, Q), dim=2)  # (B, L, 3, H, D)
    kv = torch.stack((K, V), dim=2)  # (B, Lk, 2, Hkv, D)
    got = _compiled_equals_eager(flash_attn_qkvpacked_func, [qkv], causal=True)
    torch.testing.assert_close(got[0], flash_attn_func(Q, Q, Q, causal=True), atol=TOL, rtol=TOL)
    got = _compiled_equals_eager(flash_attn_kvpacked_func, [Q, kv], softcap=2.0)
    torch.testing.assert_close(got[0], flash_attn_func(Q, K, V, softcap=2.0), atol=TOL, rtol=TOL)


# -- packed sequences ------------------------------------------------------------------------

LENGTHS_Q, LENGTHS_K = [2, 3, 1], [4, 5, 1]
CU_Q, CU_K = cu_seqlens(LENGTHS_Q), cu_seqlens(LENGTHS_K)
PQ, PK, PV = _draw(6, 4, 8, seed=4), _draw(10, 2, 8, seed=5), _draw(10, 2, 8, seed=6)


def _reference_packed(options: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The float64 reference, sequence by sequence: output (total_q, H, D) and weights."""
    outs, weights = [], []
    for s, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K, strict=True)):
        q = PQ[None, int(CU_Q[s]) : int(CU_Q[s + 1])]
        k, v = (x[None, int(CU_K[s]) : int(CU_K[s + 1])] for x in (PK, PV))
        bias = None
        if "alibi_slopes" in options:
            bias = alibi_bias(SLOPES, lq, lk, torch.tensor([lq]), torch.tensor([lk]))
        window = options.get("window_size", (-1, -1))
        out, w, _ = attention_ref(
            q,
            k,
            v,
            causal=options.get("causal", False),
            window=window,
            softcap=options.get("softcap", 0.0),
            bias=bias,
        )
        outs.append(out[0])
        weights.append(w[0])
    return torch.cat(outs), weights


PACKED: dict[str, dict[str, Any]] = {
    "causal, GQA": {"causal": True},
    "window, softcap, ALiBi, probabilities": {
        "window_size": (1, 2),
        "softcap": 4.0,
        "alibi_slopes": SLOPES,
        "return_attn_probs": True,
    },
}


@pytest.mark.parametrize("options", list(PACKED.values()), ids=list(PACKED))
def test_flash_attn_varlen_func_compiles_as_eager(options: dict[str, Any]) -> None:
    eager = _compiled_equals_eager(
        flash_attn_varlen_func, [PQ, PK, PV], CU_Q, CU_K, 3, 5, **options
    )
    out, weights = _reference_packed(options)
    torch.testing.assert_close(eager[0], out, atol=REF_TOL, rtol=REF_TOL)
    if options.get("return_attn_probs"):
        probs = eager[2]  # (batch, H, max_q, max_k), zero beyond each sequence
        assert probs.shape == (3, 4, 3, 5)
        for s, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K, strict=True)):
            torch.testing.assert_close(
                probs[s, :, :lq, :lk], weights[s], atol=REF_TOL, rtol=REF_TOL
            )
            assert not probs[s, :, lq:].any() and not probs[s, :, :, lk:].any()


def test_the_packed_varlen_forms_compile() -> None:
    cu = cu_seqlens([2, 4])
    qkv = _draw(6, 3, 2, 8, seed=7)
    got = _compiled_equals_eager(flash_attn_varlen_qkvpacked_func, [qkv], cu, 4, causal=True)
    q, k, v = qkv[None, 2:].unbind(2)
    alone = flash_attn_func(q, k, v, causal=True)[0]  # the second sequence alone
    torch.testing.assert_close(got[0][2:], alone, atol=TOL, rtol=TOL)
    kv = torch.stack((PK, PV), dim=1)
    _compiled_equals_eager(
        flash_attn_varlen_kvpacked_func, [PQ, kv], CU_Q, CU_K, 3, 5, dropout_p=0.25
    )


def test_offsets_are_checked_when_the_graph_runs() -> None:
    """The graph reads no offset while traced; a wrong one fails when it runs, as eager."""
    compiled = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    compiled(PQ, PK, PV, CU_Q, CU_K, 3, 5)
    wrong = torch.tensor([0, 3, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: cu_seqlens_q must start at 0 "):
        compiled(PQ, PK, PV, wrong, CU_K, 3, 5)
    with pytest.raises(ValueError, match=r"max_seqlen_k must be an integer ≥ the longest "):
        compiled(PQ, PK, PV, CU_Q, CU_K, 3, 4)


def test_offsets_of_the_wrong_kind_fail_while_traced() -> None:
    """Dtype and shape are checked while dynamo traces: eager's ValueError (quoted by
    dynamo's own error under fullgraph=True)."""
    says = r"cu_seqlens_q must be integers of shape \(B \+ 1,\), got float32 of shape \(4,\)"
    strict = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=says):
        strict(PQ, PK, PV, CU_Q.float(), CU_K, 3, 5)
    torch._dynamo.reset()
    lenient = torch.compile(flash_attn_varlen_func, backend="aot_eager")
    with pytest.raises(ValueError, match=says):
        lenient(PQ, PK, PV, CU_Q.float(), CU_K, 3, 5)


def test_paged_keys_run_outside_the_graph_and_fullgraph_says_why() -> None:
    """With ``block_table`` the number of keys is cu_seqlens_k's last value: a graph break."""
    pages = torch.randperm(4, generator=torch.Generator().manual_seed(8))
    table = pages.view(2, 2).to(torch.int32)  # two sequences, two pages of 4 each
    k_pages, v_pages = _draw(4, 4, 2, 8, seed=9), _draw(4, 4, 2, 8, seed=10)
    cu_q, cu_k = cu_seqlens([2, 3]), cu_seqlens([5, 8])
    q = PQ[:5]
    args = (q, k_pages, v_pages, cu_q, cu_k, 3, 8)
    strict = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"block_table runs outside the compiled graph"):
        strict(*args, block_table=table)
    torch._dynamo.reset()
    lenient = torch.compile(flash_attn_varlen_func, backend="aot_eager")
    expected = flash_attn_varlen_func(*args, block_table=table)
    torch.testing.assert_close(lenient(*args, block_table=table), expected)
