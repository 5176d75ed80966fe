"""Split-KV decoding (flash-decoding) on the CPU: a few query tokens over a long KV cache.

Shape legend: B batch rows, Lq query tokens (1 when decoding), H query heads, Hkv key/value
heads (G = H / Hkv query heads share one), D head dim, Dv value head dim, S cache
positions, P partitions of the keys, c keys per partition.

A decode step reads the whole cache for a handful of query rows: it is bound by memory,
not arithmetic. Each row's keys are cut into partitions; each partition ``p`` gives, for
every query row, its scores' maximum ``m_p``, the sum of their exponentials ``l_p`` and the
unnormalised context ``o_p = Σ_j exp(s_j − m_p)·v_j`` (the G query heads of a group and the
Lq tokens share each key read), and each row's partitions are merged by their
log-sum-exps::

    M = max_p m_p      out = Σ_p exp(m_p − M)·o_p / Σ_p exp(m_p − M)·l_p
    lse = M + log Σ_p exp(m_p − M)·l_p

which is the softmax over all keys exactly (the same algebra as the tiled kernel's rescaling;
Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference").

Two paths compute it. For float32 on the CPU with at most :data:`_STREAMED_ROWS` query rows
per key/value head, the C kernel ``_decode.c`` (built by :mod:`qkv.kernels._native`) streams
each position's keys and values once, all heads together, on ``torch.get_num_threads()``
threads: BLAS runs products with 4 rows far below the memory's speed. Otherwise (other
dtypes, devices or sizes, or no C compiler), each partition of about 16 MiB is two batched
matrix products over the Hkv heads, run as tasks on the kernel's threads
(:mod:`qkv.kernels._threads`).

The cache is read where it lies, in flash-attn's layout: a contiguous cache (B, S, Hkv, D)
(or rows of a larger one), or a paged one (num_blocks, block_size, Hkv, D) with a block
table; the keys of row b are positions ``starts[b] ≤ j < ends[b]``, and a causal query i sits
at ``ends[b] − Lq + i`` (bottom-right). A row reads its own keys and nothing else: rows of
different lengths cost what their lengths do, and whatever lies past a row's end (stale
pages, NaN) never reaches its output.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from qkv.kernels._native import library
from qkv.kernels._threads import call_threads, run_tasks

__all__ = ["Segment", "decode_attention", "partition_keys", "runs_of_pages", "segments"]

_PARTITION_BYTES = 16 << 20  # keys + values one partition reads: few calls, still cached
_VIEW_BYTES = 256 << 10  # pages at least this big are read one run at a time, not gathered
_STREAMED_ROWS = 32  # query rows per head (G·Lq) up to which the C kernel runs; more: BLAS
_STREAMED_CHUNK = 256  # the C kernel's smallest partition


def partition_keys(kv_heads: int, dim: int, itemsize: int, block: int = 1) -> int:
    """Keys per partition: about 16 MiB of one row's keys and values (a power of two, at
    least 64), a multiple of ``block`` (a page).

    Example:
        >>> partition_keys(8, 128, 4)              # 8 KiB per key: K and V, 8 heads of 128
        2048
    """
    per_key = max(1, 2 * kv_heads * dim * itemsize)
    keys = max(64, 2 ** int(math.log2(max(1, _PARTITION_BYTES // per_key))))
    return int(max(block, keys // block * block))


@dataclass(frozen=True)
class Segment:
    """One task: positions ``lo ≤ j < hi`` of batch row ``row``."""

    row: int
    lo: int
    hi: int


def segments(starts: list[int], ends: list[int], partition: int) -> list[Segment]:
    """Each row's keys cut at multiples of ``partition``; rows without keys give none.

    Example:
        >>> [(s.row, s.lo, s.hi) for s in segments([0, 5], [10, 7], 4)]
        [(0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 5, 7)]
    """
    found = []
    for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
        for lo in range(start // partition * partition, end if end > start else 0, partition):
            found.append(Segment(row, max(lo, start), min(lo + partition, end)))
    return found


def runs_of_pages(plan: list[Segment], table: list[list[int]], block: int) -> list[Segment]:
    """``plan``'s segments cut where a row's next page is not the one after its last (each
    piece then reads its pages as one view, without a gather).

    Example:
        >>> [(s.lo, s.hi) for s in runs_of_pages([Segment(0, 0, 10)], [[4, 5, 9]], 4)]
        [(0, 8), (8, 10)]
    """
    found = []
    for seg in plan:
        pages = table[seg.row]
        lo = seg.lo
        for page in range(seg.lo // block + 1, -(-seg.hi // block)):
            if pages[page] != pages[page - 1] + 1:
                found.append(Segment(seg.row, lo, page * block))
                lo = page * block
        found.append(Segment(seg.row, lo, seg.hi))
    return found


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ends: list[int] | None = None,
    starts: list[int] | None = None,
    rows: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    left: int | None = None,
    partition: int | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of a few queries over a KV cache, split over partitions of the keys.

    Args:
        q: (B, Lq, H, D), flash-attn's layout.
        k, v: the cache, (B_cache, S, Hkv, D) and (B_cache, S, Hkv, Dv); with ``block_table``
            pages (num_blocks, block_size, Hkv, D) and (…, Dv). Read, never written.
        ends: keys of row b end before ``ends[b]`` (default S, or the table's span).
        starts: and begin at ``starts[b]`` (default 0; flash-attn's ``cache_leftpad``).
        rows: the cache row of each batch row (default row b; flash-attn's
            ``cache_batch_idx``); not with ``block_table``.
        block_table: (B, pages per row) integers: position j of row b is at offset
            ``j % block_size`` of page ``block_table[b, j // block_size]``.
        scale: the softmax scale (default 1/√D).
        causal: query i of row b sees keys up to ``ends[b] − Lq + i`` (bottom-right).
        left: a window: query i of row b sees keys from ``ends[b] − Lq + i − left`` on
            (flash-attn's ``window_size[0]``; None: no limit).
        partition: keys per partition (default :func:`partition_keys`; with a block table
            a multiple of the page size).
        return_lse: also return the log-sum-exp (natural log).

    Returns:
        ``(out, lse)``: out (B, Lq, H, Dv) in q's dtype (computed in float32 for half
        inputs, float64 for float64), and lse (B, H, Lq) in the compute dtype (−inf for a
        row without keys, whose output is 0), or None without ``return_lse``.

    Each row reads only its own keys. The C kernel reads pages through the table where they
    lie; PyTorch's path reads a contiguous cache through views, and a paged one through views
    of runs of consecutive pages when pages hold 256 KiB or more of K and V (smaller pages
    out of order are gathered, one partition at a time: fewer, larger products).
    The caller checks the arguments (``qkv.flash_attn.flash_attn_with_kvcache`` and
    ``qkv.nn.PagedKVCache`` do): the positions must lie inside the cache.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 100, 2, 8), torch.randn(1, 100, 2, 8)
        >>> out, _ = decode_attention(q, k, v, ends=[60], partition=16)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(1, 2), k[:, :60].transpose(1, 2), v[:, :60].transpose(1, 2),
        ...     enable_gqa=True).transpose(1, 2)
        >>> bool(torch.allclose(out, ref, atol=1e-6))
        True
    """
    batch, lq, heads, dim = (int(n) for n in q.shape)
    kv_heads, dim_v = int(k.shape[2]), int(v.shape[3])
    group = heads // kv_heads
    size = int(k.shape[1]) * (1 if block_table is None else int(block_table.shape[1]))
    ends = [size] * batch if ends is None else ends
    starts = [0] * batch if starts is None else starts
    if left is not None:  # no query sees a key before its window: such keys are not read
        starts = [max(s, e - lq - left) for s, e in zip(starts, ends, strict=True)]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = dim**-0.5 if scale is None else scale
    # (B, Hkv, G·Lq, D): the G query heads of a group and their Lq tokens share each key read
    qg = (q.to(compute) * scale).view(batch, lq, kv_heads, group, dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * lq, dim)
    cache = _Cache(k, v, ends, starts, rows, block_table, causal, left, lq, partition)
    streamed = _streamed(qg, cache)
    out, lse = streamed if streamed is not None else _in_products(qg, cache)
    out = out.view(batch, kv_heads, group, lq, dim_v).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch, lq, heads, dim_v).to(q.dtype)
    return out, (lse.view(batch, heads, lq) if return_lse else None)


class _Cache(NamedTuple):
    """What :func:`decode_attention` reads, as it was given (see its arguments)."""

    k: torch.Tensor
    v: torch.Tensor
    ends: list[int]
    starts: list[int]
    rows: list[int] | None
    block_table: torch.Tensor | None
    causal: bool
    left: int | None
    lq: int
    partition: int | None


def _in_products(qg: torch.Tensor, c: _Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's path: each partition is two batched matrix products. qg: (B, Hkv, G·Lq,
    D), scaled; returns the context (B, Hkv, G·Lq, Dv) and log-sum-exp (B, Hkv, G·Lq, 1)."""
    k, v, ends, starts, rows, block_table, causal, left, lq, partition = c
    batch, kv_heads, rows_per_head, dim = (int(n) for n in qg.shape)
    dim_v, compute, group = int(v.shape[3]), qg.dtype, rows_per_head // lq
    block = int(k.shape[1])  # a page, or a contiguous cache's whole row
    if partition is None:
        itemsize = torch.finfo(compute).bits // 8
        partition = partition_keys(kv_heads, max(dim, dim_v), itemsize, block)
    if block_table is not None:
        partition = max(block, partition // block * block)
    plan = segments(starts, ends, partition)
    if (
        block_table is not None
        and block * kv_heads * (dim + dim_v) * k.element_size() >= _VIEW_BYTES
    ):
        plan = runs_of_pages(plan, block_table.tolist(), block)  # big pages: read in place
    fetch = _fetcher(k, v, block_table, rows)
    shape = (len(plan), kv_heads, rows_per_head)
    maxima = qg.new_full((*shape, 1), -math.inf)
    sums = qg.new_zeros((*shape, 1))
    parts = qg.new_zeros((*shape, dim_v))
    steps = torch.arange(lq, device=qg.device)[:, None] - lq  # query i sits at ends − Lq + i

    def task(t: int) -> None:
        seg = plan[t]
        keys, values = fetch(seg)  # (c, Hkv, D), (c, Hkv, Dv)
        scores = torch.matmul(qg[seg.row], keys.to(compute).permute(1, 2, 0))  # (Hkv, G·Lq, c)
        end = ends[seg.row]
        top = maxima[t]  # (Hkv, G·Lq, 1), written in place, as are sums[t] and parts[t]
        # some query does not see every key here
        if (causal and seg.hi > end - lq + 1) or (left is not None and seg.lo < end - 1 - left):
            j = torch.arange(seg.lo, seg.hi, device=qg.device)
            hidden = (j > end + steps) if causal else torch.zeros_like(j, dtype=torch.bool)
            if left is not None:
                hidden = hidden | (j < end + steps - left)  # (Lq, c)
            scores.view(kv_heads, group, lq, -1).masked_fill_(hidden, -math.inf)
            torch.amax(scores, dim=-1, keepdim=True, out=top)
            top.masked_fill_(top == -math.inf, 0.0)  # a query with no key here: weights 0
        else:
            torch.amax(scores, dim=-1, keepdim=True, out=top)
        weights = scores.sub_(top).exp_()
        torch.sum(weights, dim=-1, keepdim=True, out=sums[t])
        torch.matmul(weights, values.to(compute).transpose(0, 1), out=parts[t])

    on_cpu = qg.device.type == "cpu"
    with torch.no_grad(), call_threads(on_cpu):
        tasks: list[Callable[[None], None]] = [
            partial(_skip_state, task, t) for t in range(len(plan))
        ]
        run_tasks(tasks, lambda: None, on_cpu=on_cpu)
        return _merge(plan, maxima, sums, parts, batch)


_ARGS = (  # the fields of decode_args in _decode.c, in its order
    "q", "k", "v", "k_row", "k_pos", "k_head", "v_row", "v_pos", "v_head", "rows", "table",
    "pages_per_row", "block", "k_page", "v_page", "starts", "ends", "batch", "heads",
    "rows_per_head", "lq", "dim", "dim_v", "causal", "left", "partition", "threads", "out", "lse",
)  # fmt: skip
_POINTERS = {"q", "k", "v", "rows", "table", "starts", "ends", "out", "lse"}


class _Args(ctypes.Structure):
    """``decode_args`` of ``_decode.c``."""

    _fields_ = [(n, ctypes.c_void_p if n in _POINTERS else ctypes.c_int64) for n in _ARGS]


def _streamed(qg: torch.Tensor, c: _Cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C kernel (``_decode.c``): each partition streams its keys and values once, all
    heads of a position together. None where it does not apply (off the CPU, not float32,
    more than :data:`_STREAMED_ROWS` query rows per head, no compiler): PyTorch's path then
    runs. Same arguments and results as :func:`_in_products`."""
    k, v, ends, starts, rows, block_table, causal, left, lq, partition = c
    batch, kv_heads, rows_per_head, dim = (int(n) for n in qg.shape)
    if (
        qg.device.type != "cpu"
        or rows_per_head > _STREAMED_ROWS
        or not qg.dtype == k.dtype == v.dtype == torch.float32
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        return None
    lib = library("_decode")
    if lib is None:
        return None
    threads = torch.get_num_threads()
    if partition is None:  # a few tasks per thread, each long enough to stream
        longest = max((e - s for s, e in zip(starts, ends, strict=True)), default=0)
        share = -(-longest * batch // (2 * threads)) if longest else 1
        partition = max(_STREAMED_CHUNK, 2 ** math.ceil(math.log2(max(1, share))))
        partition = min(partition, partition_keys(kv_heads, dim, qg.element_size()))
    dim_v = int(v.shape[3])
    out = qg.new_empty((batch, kv_heads, rows_per_head, dim_v))
    lse = qg.new_empty((batch, kv_heads, rows_per_head, 1))
    index = partial(torch.tensor, dtype=torch.int64)
    held = [qg.contiguous(), index(starts), index(ends)]  # alive until the call returns
    args = _Args(
        q=held[0].data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        k_row=k.stride(0),
        k_pos=k.stride(1),
        k_head=k.stride(2),
        v_row=v.stride(0),
        v_pos=v.stride(1),
        v_head=v.stride(2),
        starts=held[1].data_ptr(),
        ends=held[2].data_ptr(),
        batch=batch,
        heads=kv_heads,
        rows_per_head=rows_per_head,
        lq=lq,
        dim=dim,
        dim_v=dim_v,
        causal=int(causal),
        left=-1 if left is None else left,
        partition=partition,
        threads=threads,
        out=out.data_ptr(),
        lse=lse.data_ptr(),
    )
    if rows is not None:
        held.append(index(rows))
        args.rows = held[-1].data_ptr()
    if block_table is not None:
        held.append(block_table.to(torch.int64).contiguous())
        args.table, args.pages_per_row = held[-1].data_ptr(), int(block_table.shape[1])
        args.block, args.k_page, args.v_page = int(k.shape[1]), k.stride(0), v.stride(0)
    if lib.qkv_decode_f32(ctypes.byref(args)) != 0:
        raise MemoryError("decode_attention: the C kernel could not allocate its buffers")
    return out, lse


def _merge(
    plan: list[Segment],
    maxima: torch.Tensor,
    sums: torch.Tensor,
    parts: torch.Tensor,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's partitions merged by their log-sum-exps: the context (B, Hkv, G·Lq, Dv)
    and the log-sum-exp (B, Hkv, G·Lq, 1), −inf (and a zero context) without keys."""
    row_of = torch.tensor([s.row for s in plan], dtype=torch.int64, device=maxima.device)
    maxima = torch.where(sums > 0, maxima, -math.inf)
    top = maxima.new_full((batch, *maxima.shape[1:]), -math.inf)
    where = row_of[:, None, None, None].expand_as(maxima)
    top = top.scatter_reduce_(0, where, maxima, "amax")
    safe = torch.where(top == -math.inf, 0.0, top)
    share = torch.exp(maxima - safe[row_of])  # (T, Hkv, G·Lq, 1)
    total = sums.new_zeros(top.shape).index_add_(0, row_of, share * sums)
    context = parts.new_zeros((batch, *parts.shape[1:])).index_add_(0, row_of, share * parts)
    context = context / torch.where(total > 0, total, 1.0)
    return context, safe + torch.log(total)  # log 0 = −inf: no key


def _skip_state(task: Callable[[int], None], t: int, state: None) -> None:
    task(t)


def _fetcher(
    k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None, rows: list[int] | None
) -> Callable[[Segment], tuple[torch.Tensor, torch.Tensor]]:
    """A function giving one segment's keys and values, (c, Hkv, D) and (c, Hkv, Dv): views
    of the cache, or of a run of consecutive pages; pages out of order are gathered."""
    if table is None:

        def contiguous(seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
            row = seg.row if rows is None else rows[seg.row]
            return k[row, seg.lo : seg.hi], v[row, seg.lo : seg.hi]

        return contiguous
    block = int(k.shape[1])
    pages = table.to(device=k.device, dtype=torch.int64)
    listed = pages.tolist()

    def paged(seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        first, last = seg.lo // block, -(-seg.hi // block)
        ids = listed[seg.row][first:last]
        lo, hi = seg.lo - first * block, seg.hi - first * block
        if ids == list(range(ids[0], ids[0] + len(ids))):  # one run: a view
            keys, values = k[ids[0] : ids[0] + len(ids)], v[ids[0] : ids[0] + len(ids)]
        else:
            chosen = pages[seg.row, first:last]
            keys, values = k.index_select(0, chosen), v.index_select(0, chosen)
        return keys.flatten(0, 1)[lo:hi], values.flatten(0, 1)[lo:hi]

    return paged
