"""The C decode kernel (``qkv/kernels/_decode.c``, built by ``qkv.kernels._native``) against
the float64 reference of ``test_decode.py`` and against PyTorch's path, which it replaces
for float32 caches on the CPU.

The tolerance is flash-attn's rule (``tests/test_flash_attn.py`` of Dao-AILab/flash-attention,
read, not copied): the error against the float64 reference is at most a few times that of
the same computation done in float32 by another route (here PyTorch's path of
``decode_attention``, which is two BLAS products per partition).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from qkv.flash_attn import flash_attn_with_kvcache
from qkv.kernels import _decode, _native
from qkv.kernels._decode import decode_attention

from .test_decode import reference


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function running ``decode_attention`` by PyTorch's path (no C kernel)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with monkeypatch.context() as patch:
            patch.setattr(_decode, "library", lambda name: None)
            return decode_attention(*args, **kwargs)

    return run


def _check(out: torch.Tensor, other: torch.Tensor, exact: torch.Tensor) -> None:
    """``out`` (the C kernel) within 3 × the error of ``other`` (PyTorch's float32 path)
    against ``exact`` (float64), plus a few float32 roundings."""
    assert out.dtype == torch.float32 and out.shape == exact.shape
    base = (other.double() - exact).abs().max().item()
    assert base <= 5e-5  # PyTorch's path is right too (its own tests hold it to 1e-12 in f64)
    assert (out.double() - exact).abs().max().item() <= 3 * base + 4e-6


CASES = [  # (Lq, H, Hkv, D, Dv, causal): R = G·Lq query rows per head, 4 at a time, then 1
    (1, 32, 8, 128, 128, False),  # a decode step of a GQA model
    (1, 12, 4, 40, 24, True),  # G = 3, head dims off the vector width, Dv ≠ D
    (3, 6, 2, 64, 64, True),  # a few tokens, causal among them: R = 9
    (2, 5, 5, 16, 16, False),  # MHA, R = 2
    (1, 16, 1, 8, 8, True),  # MQA, R = 16, D below one vector
]


@pytest.mark.parametrize(("lq", "heads", "kv_heads", "dim", "dim_v", "causal"), CASES)
@pytest.mark.parametrize("partition", [48, None])
def test_c_kernel_on_a_contiguous_cache_with_left_padding_and_short_rows(
    lq: int, heads: int, kv_heads: int, dim: int, dim_v: int, causal: bool,
    partition: int | None, torch_path: Any,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(lq * 1000 + heads * 10 + dim)
    q = torch.randn(4, lq, heads, dim, generator=gen)
    k = torch.randn(4, 700, kv_heads, dim, generator=gen)
    v = torch.randn(4, 700, kv_heads, dim_v, generator=gen)
    starts, ends = [0, 13, 0, 5], [700, 300, lq, 5]  # full, left-padded, short, empty
    out, lse = decode_attention(
        q, k, v, starts=starts, ends=ends, causal=causal, partition=partition, return_lse=True
    )
    other, _ = torch_path(q, k, v, starts=starts, ends=ends, causal=causal, partition=partition)
    exact, exact_lse = reference(q, k, v, starts, ends, causal)
    _check(out, other, exact)
    assert lse is not None and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=2e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool(torch.all(lse[3] == -math.inf))


def test_c_kernel_reads_shuffled_pages_and_nothing_past_a_row_s_end(torch_path: Any) -> None:
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(3, 1, 8, 32, generator=gen)
    pages_k = torch.randn(50, 16, 2, 32, generator=gen)
    pages_v = torch.randn(50, 16, 2, 32, generator=gen)
    table = torch.randperm(50, generator=gen)[:45].view(3, 15)
    ends = [240, 17, 100]
    for b, end in enumerate(ends):  # stale pages past the end hold NaN
        for page in table[b, -(-end // 16) :].tolist():
            pages_k[page], pages_v[page] = math.nan, math.nan
    for b, end in enumerate(ends):  # and so does the rest of each row's last page
        page, at = int(table[b, (end - 1) // 16]), end % 16
        if at:
            pages_k[page, at:], pages_v[page, at:] = math.nan, math.nan
    out, _ = decode_attention(q, pages_k, pages_v, ends=ends, block_table=table, partition=40)
    other, _ = torch_path(q, pages_k, pages_v, ends=ends, block_table=table, partition=48)
    k, v = pages_k[table].flatten(1, 2), pages_v[table].flatten(1, 2)
    exact, _ = reference(q, k.nan_to_num(), v.nan_to_num(), [0, 0, 0], ends, False)
    assert not bool(out.isnan().any())
    _check(out, other, exact)


def test_c_kernel_follows_cache_rows_and_a_nan_it_reads_reaches_the_output(
    torch_path: Any,
) -> None:
    """flash-attn's ``cache_batch_idx``: batch row b reads cache row rows[b]. A NaN inside the
    keys a row reads makes that key/value head's outputs NaN, as in the reference; the other
    heads and rows keep their numbers."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 1, 8, 16, generator=gen)
    k = torch.randn(5, 90, 2, 16, generator=gen)
    v = torch.randn(5, 90, 2, 16, generator=gen)
    k[4, 30, 1, 3] = math.nan  # cache row 4, key/value head 1
    out, _ = decode_attention(q, k, v, rows=[4, 0], ends=[90, 60])
    other, _ = torch_path(q, k, v, rows=[4, 0], ends=[90, 60])
    assert torch.equal(out.isnan(), other.isnan())
    assert bool(out[0, :, 4:].isnan().all()) and not bool(out[0, :, :4].isnan().any())
    exact, _ = reference(q, k[[4, 0]], v[[4, 0]], [0, 0], [90, 60], False)
    keep = ~out.isnan()  # (the reference here turns a NaN row's weights into zeros)
    _check(out[keep].view(1, -1), other[keep].view(1, -1), exact[keep].view(1, -1))


def test_c_kernel_scores_far_apart_give_zero_weights_not_noise(torch_path: Any) -> None:
    """The kernel's own exp: scores hundreds apart (a large softmax scale) underflow to
    weight 0 and the largest keeps weight 1, as in float64."""
    gen = torch.Generator().manual_seed(13)
    q, k = torch.randn(1, 1, 4, 32, generator=gen), torch.randn(1, 500, 4, 32, generator=gen)
    v = torch.randn(1, 500, 4, 32, generator=gen)
    out, lse = decode_attention(q, k, v, scale=40.0, return_lse=True)
    other, _ = torch_path(q, k, v, scale=40.0)
    exact, exact_lse = reference(q, k, v, [0], [500], False, scale=40.0)
    _check(out, other, exact)
    assert lse is not None
    torch.testing.assert_close(lse.double(), exact_lse, rtol=2e-6, atol=0)


def test_c_kernel_gives_the_same_bits_on_one_thread_or_two() -> None:
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(2, 1, 8, 64, generator=gen)
    k, v = torch.randn(2, 3000, 2, 64, generator=gen), torch.randn(2, 3000, 2, 64, generator=gen)
    before = torch.get_num_threads()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            results.append(decode_attention(q, k, v, ends=[3000, 1111], partition=256)[0])
        finally:
            torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


def test_flash_attn_with_kvcache_runs_the_c_kernel_for_float32(monkeypatch: Any) -> None:
    """The public call reaches the C kernel (and only it computes) for a float32 cache."""
    calls = []
    real = _decode._in_products

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_decode, "_in_products", counted)
    q, k, v = torch.randn(1, 1, 8, 64), torch.randn(1, 256, 2, 64), torch.randn(1, 256, 2, 64)
    lengths = torch.tensor([200], dtype=torch.int32)
    flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)
    assert calls == []
    flash_attn_with_kvcache(q.double(), k.double(), v.double(), cache_seqlens=lengths)
    assert calls == [1]  # float64 runs PyTorch's path, exact to the reference


def test_the_build_lands_in_the_cache_folder_and_a_failed_one_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "built"))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    _native.library.cache_clear()
    try:
        assert _native.library("_decode") is None
        assert _native.why_not("_decode").startswith("false failed")
        assert list((tmp_path / "built" / "native").iterdir()) == []  # no half-built file
        monkeypatch.delenv("CC")
        _native.library.cache_clear()
        lib = _native.library("_decode")
        assert lib is not None and hasattr(lib, "qkv_decode_f32")
        assert [p.suffix for p in (tmp_path / "built" / "native").iterdir()] == [".so"]
        monkeypatch.setenv("QKV_NATIVE", "0")
        _native.library.cache_clear()
        assert _native.library("_decode") is None and _native.why_not("_decode") == "QKV_NATIVE=0"
    finally:
        _native.library.cache_clear()


def test_a_library_others_may_write_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache folder that other users can write (a shared /tmp) could hold their code under
    the built library's name: it is refused, and PyTorch's path runs."""
    shared = tmp_path / "shared"
    monkeypatch.setenv("QKV_CACHE_DIR", str(shared))
    _native.library.cache_clear()
    try:
        assert _native.library("_decode") is not None  # built, and ours
        (shared / "native").chmod(0o777)
        _native.library.cache_clear()
        assert _native.library("_decode") is None
        assert "not only writable by this user" in _native.why_not("_decode")
        q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
        out, _ = decode_attention(q, k, v)
        exact, _ = reference(q, k, v, [0], [64], False)
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5)
    finally:
        _native.library.cache_clear()


@pytest.mark.parametrize(
    ("lq", "causal", "left"),
    [(1, True, 0), (1, False, 37), (4, True, 5), (4, False, 60), (3, True, 300)],
)
def test_a_window_on_the_left_in_both_paths(
    lq: int, causal: bool, left: int, torch_path: Any
) -> None:  # fmt: skip
    """flash-attn's ``window_size=(left, 0 or -1)``: query i of row b sees keys from
    ends[b] − Lq + i − left on; keys before every query's window are not read at all."""
    gen = torch.Generator().manual_seed(15 + lq + left)
    q = torch.randn(3, lq, 8, 32, generator=gen)
    k, v = torch.randn(3, 400, 2, 32, generator=gen), torch.randn(3, 400, 2, 32, generator=gen)
    starts, ends = [0, 20, 0], [400, 250, 30]
    k[1, 20:50] = math.nan  # before row 1's window (when it is shorter than 200): never read
    far = [e - lq - left for e in ends]
    out, lse = decode_attention(
        q, k, v, starts=starts, ends=ends, causal=causal, left=left, partition=64,
        return_lse=True,
    )  # fmt: skip
    other, _ = torch_path(q, k, v, starts=starts, ends=ends, causal=causal, left=left, partition=64)
    exact, exact_lse = reference(q, k.nan_to_num(), v, starts, ends, causal, left=left)
    assert lse is not None
    if far[1] < 50:  # the window reaches the NaN keys: the reference sees them as 0
        exact = exact[[0, 2]]
        out, other, lse, exact_lse = out[[0, 2]], other[[0, 2]], lse[[0, 2]], exact_lse[[0, 2]]
    _check(out, other, exact)
    torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=2e-5)


def test_flash_attn_with_kvcache_decodes_a_sliding_window_in_the_kernel(monkeypatch: Any) -> None:
    """A Mistral-style decode step, window_size=(W − 1, 0), runs the split-KV kernel (it used
    to take the general path) and equals the float64 reference."""
    ran = []
    real = _decode.decode_attention

    def seen(*args: Any, **kwargs: Any) -> Any:
        ran.append(kwargs.get("left"))
        return real(*args, **kwargs)

    monkeypatch.setattr("qkv.flash_attn._kvcache.decode_attention", seen)
    gen = torch.Generator().manual_seed(16)
    q, k, v = (
        torch.randn(2, 1, 8, 64, generator=gen),
        torch.randn(2, 500, 2, 64),
        torch.randn(2, 500, 2, 64),
    )
    lengths = torch.tensor([500, 321], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, window_size=(127, 0))
    assert ran == [127]
    exact, _ = reference(q, k, v, [0, 0], [500, 321], True, left=127)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-5)


def test_a_compiler_that_hangs_is_stopped_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``CC`` that never ends, and starts a child that never ends: past the limit the whole
    group is killed, nothing is left in the cache folder, and the reason is one line
    without the build's temporary folder."""
    pid_file = tmp_path / "child.pid"
    compiler = tmp_path / "cc"
    compiler.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo hanging-cc 1.0; exit 0; fi\n'
        f"sleep 300 & echo $! > {pid_file}\n"
        "sleep 300\n"
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "built"))
    monkeypatch.setattr(_native, "_BUILD_SECONDS", 1.0)
    _native.library.cache_clear()
    try:
        assert _native.library("_decode") is None
        reason = _native.why_not("_decode")
        assert reason == "building _decode.c failed: no answer within 1 s (stopped)"
        assert list((tmp_path / "built" / "native").iterdir()) == []
        child = int(pid_file.read_text())
        for _ in range(50):  # the killed child is reaped by init in a moment
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the compiler's child {child} outlived the build")
    finally:
        _native.library.cache_clear()
