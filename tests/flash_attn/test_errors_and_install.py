"""Bad input gets one line naming the argument; ``install()`` serves ``import flash_attn``
explicitly and reversibly, and leaves a real flash-attn alone unless asked."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import qkv
import qkv.flash_attn as fa


def _q(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


CU = torch.tensor([0, 2, 5], dtype=torch.int32)
INT32 = torch.int32


def _b(**options: Any) -> Any:
    """flash_attn_func on (1, 4, 2, 8) tensors."""
    return fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8), **options)


def _v(q: torch.Tensor, cu_q: torch.Tensor = CU, max_q: int = 3, **options: Any) -> Any:
    """flash_attn_varlen_func of q over (5, 2, 8) keys in sequences of 2 and 3."""
    return fa.flash_attn_varlen_func(q, _q(5, 2, 8), _q(5, 2, 8), cu_q, CU, max_q, 3, **options)


def _c(q_shape: tuple[int, ...], cache: tuple[int, ...], **kw: Any) -> Any:
    """flash_attn_with_kvcache of a zero q on zero caches."""
    return fa.flash_attn_with_kvcache(_q(*q_shape), _q(*cache), _q(*cache), **kw)


BAD: list[tuple[str, Callable[[], Any], str]] = [
    (
        "gqa",
        lambda: fa.flash_attn_func(_q(1, 4, 6, 8), _q(1, 4, 4, 8), _q(1, 4, 4, 8)),
        "k has 4 heads, which must divide q's 6 heads",
    ),
    (
        "dtype",
        lambda: fa.flash_attn_func(
            _q(1, 4, 2, 8), _q(1, 4, 2, 8, dtype=torch.float64), _q(1, 4, 2, 8)
        ),
        "k is torch.float64 but q is torch.float32",
    ),
    (
        "int dtype",
        lambda: fa.flash_attn_func(*(torch.zeros(1, 4, 2, 8, dtype=torch.int64),) * 3),
        "q must be float16, bfloat16, float32 or float64, got torch.int64",
    ),
    (
        "layout",
        lambda: fa.flash_attn_func(_q(4, 2, 8), _q(4, 2, 8), _q(4, 2, 8)),
        "q must be (batch, seqlen, nheads, headdim), got shape (4, 2, 8)",
    ),
    ("varlen layout", lambda: _v(_q(1, 5, 2, 8)), "q must be (total, nheads, headdim)"),
    ("cu_seqlens total", lambda: _v(_q(6, 2, 8)), "cu_seqlens_q ends at 5 but q has 6 tokens"),
    (
        "cu_seqlens count",
        lambda: _v(_q(5, 2, 8), torch.tensor([0, 5], dtype=INT32), 5),
        "cu_seqlens_q has 2 entries and cu_seqlens_k 3",
    ),
    (
        "cu_seqlens order",
        lambda: _v(_q(5, 2, 8), torch.tensor([0, 4, 2, 5])),
        "cu_seqlens_q must start at 0 and never decrease",
    ),
    (
        "max_seqlen",
        lambda: _v(_q(5, 2, 8), max_q=2),
        "max_seqlen_q must be an integer ≥ the longest sequence's queries (3), got 2",
    ),
    (
        "cu_seqlens device",
        lambda: _v(_q(5, 2, 8), CU.to("meta")),
        "cu_seqlens_q is on the meta device, which holds no values",
    ),
    (
        "cu_seqlens float",
        lambda: _v(_q(5, 2, 8), CU.float()),
        "cu_seqlens_q must be integers of shape (B + 1,), got float32 of shape (3,)",
    ),
    (
        "block_table varlen",
        lambda: _v(_q(5, 2, 8), block_table=torch.zeros(2, 1, dtype=INT32)),
        "with block_table, k and v must be pages of one shape",
    ),
    (
        "block_table",
        lambda: _c(
            (1, 1, 2, 8), (4, 256, 2, 8), block_table=torch.zeros(1, 1, dtype=torch.float32)
        ),
        "block_table must be integers of shape (1, max_num_blocks_per_seq)",
    ),
    (
        "block_table with cache_batch_idx",
        lambda: _c(
            (1, 1, 2, 8),
            (4, 256, 2, 8),
            block_table=torch.zeros(1, 1, dtype=INT32),
            cache_batch_idx=torch.zeros(1, dtype=INT32),
        ),
        "cache_batch_idx cannot be combined with block_table",
    ),
    (
        "varlen page outside",
        lambda: fa.flash_attn_varlen_func(
            _q(5, 2, 8),
            _q(2, 4, 2, 8),
            _q(2, 4, 2, 8),
            CU,
            CU,
            3,
            3,
            block_table=torch.tensor([[0], [7]], dtype=INT32),
        ),
        "block_table[1] holds page 7, outside k's 2 pages",
    ),
    ("window", lambda: _b(window_size=(3,)), "window_size must be two integers (left, right)"),
    ("alibi", lambda: _b(alibi_slopes=torch.zeros(3)), "alibi_slopes must be (2,) or (1, 2)"),
    ("dropout", lambda: _b(dropout_p=1.0), "dropout_p must be in [0, 1), got 1.0"),
    (
        "qkvpacked",
        lambda: fa.flash_attn_qkvpacked_func(_q(1, 4, 2, 2, 8)),
        "qkv must be (batch, seqlen, 3, nheads, headdim), got shape (1, 4, 2, 2, 8)",
    ),
    (
        "cache too short",
        lambda: _c((1, 1, 2, 8), (1, 4, 2, 8), k=_q(1, 2, 2, 8), v=_q(1, 2, 2, 8), cache_seqlens=3),
        "cache_seqlens[0] = 3 plus 2 new tokens does not fit the cache's 4 positions",
    ),
    (
        "cache_batch_idx",
        lambda: _c(
            (1, 1, 2, 8),
            (2, 4, 2, 8),
            cache_seqlens=1,
            cache_batch_idx=torch.tensor([2], dtype=INT32),
        ),
        "cache_batch_idx[0] = 2 is outside the cache's 2 rows",
    ),
    (
        "cache gqa",
        lambda: _c((1, 1, 3, 8), (1, 4, 2, 8)),
        "k_cache has 2 heads, which must divide q's 3 heads",
    ),
]


@pytest.mark.parametrize(("case", "call", "says"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_input_is_one_line_naming_the_argument(
    case: str, call: Callable[[], Any], says: str
) -> None:
    with pytest.raises(ValueError, match=r"^flash_attn_") as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and says in message
    assert message.startswith("flash_attn_")


@pytest.fixture
def clean_modules() -> Iterator[None]:
    """No flash_attn in sys.modules before or after (and qkv's uninstalled)."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] == "flash_attn"}
    yield
    fa.uninstall()
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_attn"]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.mark.usefixtures("clean_modules")
def test_install_serves_flash_attn_code_and_uninstall_undoes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fa._install, "_real_flash_attn", lambda: None)
    served = qkv.flash_attn.install()
    assert set(served) == {
        "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
        "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
    }  # fmt: skip
    assert fa.installed()
    assert importlib.util.find_spec("flash_attn") is not None
    from flash_attn.flash_attn_interface import (  # type: ignore[import-not-found]
        flash_attn_with_kvcache,
    )

    import flash_attn  # type: ignore[import-not-found]
    from flash_attn import flash_attn_varlen_func

    assert flash_attn_varlen_func is fa.flash_attn_varlen_func
    assert flash_attn_with_kvcache is fa.flash_attn_with_kvcache
    q = torch.randn(1, 4, 2, 8)
    assert torch.equal(
        flash_attn.flash_attn_func(q, q, q, causal=True), fa.flash_attn_func(q, q, q, causal=True)
    )
    fa.uninstall()
    assert not fa.installed() and "flash_attn" not in sys.modules
    assert "flash_attn.flash_attn_interface" not in sys.modules


@pytest.mark.usefixtures("clean_modules")
def test_install_leaves_an_imported_flash_attn_alone_unless_asked() -> None:
    real = types.ModuleType("flash_attn")
    real.__file__ = "/site-packages/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    with pytest.raises(
        RuntimeError, match=r"a real flash-attn is installed .*install\(replace=True\)"
    ):
        fa.install()
    assert sys.modules["flash_attn"] is real
    fa.install(replace=True)
    assert sys.modules["flash_attn"].flash_attn_func is fa.flash_attn_func
    fa.uninstall()
    assert sys.modules["flash_attn"] is real


@pytest.mark.usefixtures("clean_modules")
def test_install_refuses_an_importable_flash_attn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flash-attn on the path (not imported yet) is found the way import would find it."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError) as caught:
        fa.install()
    assert "\n" not in str(caught.value) and "flash_attn" not in sys.modules


MODEL = '''
"""A causal self-attention block as code written for flash-attn has it (the shape of GPT
blocks that call flash_attn_qkvpacked_func on (batch, seqlen, 3, nheads, headdim))."""
import torch
from flash_attn import flash_attn_qkvpacked_func


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, width, heads, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, seqlen, width = x.shape
        qkv = self.qkv(x).view(batch, seqlen, 3, self.heads, width // self.heads)
        y = flash_attn_qkvpacked_func(
            qkv, self.dropout if self.training else 0.0, causal=True
        )
        return self.out(y.reshape(batch, seqlen, width))
'''


@pytest.mark.usefixtures("clean_modules")
def test_code_written_for_flash_attn_runs_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that imports flash_attn at its top runs after install(), with the output
    and gradients of the same block on torch's SDPA."""
    monkeypatch.setattr(fa._install, "_real_flash_attn", lambda: None)
    (tmp_path / "fa_block.py").write_text(MODEL, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    fa.install()
    import fa_block  # type: ignore[import-not-found]

    torch.manual_seed(0)
    block = fa_block.CausalSelfAttention(32, 4).double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    out = block(x)
    qkv = block.qkv(x).view(2, 9, 3, 4, 8).permute(2, 0, 3, 1, 4)  # (3, B, H, L, D)
    sdpa = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    expected = block.out(sdpa.transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    monkeypatch.delitem(sys.modules, "fa_block")
