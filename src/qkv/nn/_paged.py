"""A paged KV cache: a pool of fixed-size blocks shared by many sequences (vLLM's layout).

Shape legend: N blocks in the pool, P tokens per block (``block_size``), Hkv key/value
heads, D head dim, Dv value head dim, B the batch rows of a call, Lnew new tokens.

The keys and values live in two tensors of flash-attn's paged layout, (N, P, Hkv, D) and
(N, P, Hkv, Dv). Each sequence owns a list of blocks, its row of the *block table*: its
token at position j is at offset ``j % P`` of block ``table[j // P]``. A sequence takes a
block from the free list when it grows past its last one, and gives all of them back when
:meth:`PagedKVCache.free` ends it, so sequences of any lengths share one pool without
copying or reserving their longest length.

One cache serves one attention layer (as :class:`qkv.nn.KVCache`): the batch rows of a
call are the sequences chosen by :meth:`PagedKVCache.use` (by default, on the first append,
B new ones). It serves:

- :class:`qkv.nn.MultiHeadAttention` (``cache=``): each row continues its own sequence, RoPE
  at its own positions; one decoded token (or a few) runs the split-KV kernel
  (:mod:`qkv.kernels._decode`) straight on the pages, anything else attends over the rows'
  keys gathered and aligned to their ends;
- :func:`qkv.flash_attn.flash_attn_with_kvcache`: :meth:`PagedKVCache.kvcache_args` gives
  its ``k_cache``, ``v_cache``, ``block_table`` and ``cache_seqlens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypedDict

import torch

from qkv.kernels._decode import decode_attention
from qkv.masks import Mask, key_padding
from qkv.nn._cache import LayerCache

__all__ = ["KVCacheArgs", "PagedKVCache"]

_WHO = "PagedKVCache"


def _positive(name: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"{_WHO}: {name} must be a positive integer, got {n!r}. Hint: "
            "PagedKVCache(num_blocks=256, block_size=16, num_kv_heads=8, head_dim=64)."
        )
    return n


class KVCacheArgs(TypedDict):
    """The cache arguments of :func:`qkv.flash_attn.flash_attn_with_kvcache`."""

    k_cache: torch.Tensor  # (N, P, Hkv, D)
    v_cache: torch.Tensor  # (N, P, Hkv, Dv)
    block_table: torch.Tensor  # (B, max blocks) int32
    cache_seqlens: torch.Tensor  # (B,) int32, the lengths before the call


class PagedKVCache(LayerCache):
    """Keys and values of many sequences in a pool of blocks, for one attention layer.

    Args:
        num_blocks: N, the blocks of the pool.
        block_size: P, the tokens per block.
        num_kv_heads: Hkv.
        head_dim: D; ``head_dim_v`` Dv (default D).
        dtype, device: of the pool (default float32 on the CPU). New keys must match.

    Attributes:
        k_cache, v_cache: the pool, (N, P, Hkv, D) and (N, P, Hkv, Dv) (flash-attn's paged
            layout; blocks not owned by a sequence hold stale values).
        sequences: the sequences the batch rows of the next call continue (row b:
            ``sequences[b]``).
        last_read: for each batch row of the last attention call, the blocks it read, in
            order (what a trace shows as the call's ``pages``).

    Decoding only: the pool is written in place, so no gradient flows into it (decode
    under ``torch.no_grad()``; train with :class:`qkv.nn.KVCache` or without a cache).

    Example:
        >>> import torch
        >>> cache = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
        >>> a, b = cache.add_sequence(), cache.add_sequence()
        >>> _ = cache.use([a, b]).append(torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8))
        >>> cache.lengths, cache.block_table().tolist(), cache.free_blocks
        ([6, 6], [[0, 1], [2, 3]], 4)
        >>> cache.free(a)
        >>> cache.sequences, cache.free_blocks
        ([1], 6)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, n in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            _positive(name, n)
        dim_v = head_dim if head_dim_v is None else _positive("head_dim_v", head_dim_v)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"{_WHO}: dtype must be a floating torch.dtype, got {dtype!r}. Hint: "
                "dtype=torch.float16 halves the pool."
            )
        self.block_size = block_size
        self.k_cache = torch.zeros(
            num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.v_cache = torch.zeros(
            num_blocks, block_size, num_kv_heads, dim_v, dtype=dtype, device=device
        )
        self.reset()

    # -- sequences and blocks --------------------------------------------------------------

    def reset(self) -> None:
        """End every sequence: all blocks are free again."""
        self._free: list[int] = list(range(int(self.k_cache.shape[0])))[::-1]  # pop(): lowest
        self._pages: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}
        self._next = 0
        self.sequences: list[int] = []
        self.last_read: list[list[int]] = []
        self.position = 0

    @property
    def num_blocks(self) -> int:
        return int(self.k_cache.shape[0])

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence owns."""
        return len(self._free)

    @property
    def lengths(self) -> list[int]:
        """Tokens held by each batch row's sequence."""
        return [self._length[s] for s in self.sequences]

    def length(self, sequence: int) -> int:
        """Tokens held by ``sequence``."""
        return self._length[self._known(sequence, "length")]

    def add_sequence(self) -> int:
        """Start a new, empty sequence (it takes blocks as it grows); return its id."""
        sequence = self._next
        self._next += 1
        self._pages[sequence], self._length[sequence] = [], 0
        return sequence

    def use(self, sequences: Sequence[int]) -> PagedKVCache:
        """Make ``sequences`` the batch rows of the next calls (row b continues
        ``sequences[b]``); return the cache."""
        chosen = [self._known(s, "use") for s in sequences]
        if len(set(chosen)) != len(chosen):
            raise ValueError(
                f"{_WHO}.use: each sequence may fill one batch row, got {list(sequences)}. "
                "Hint: one row per sequence."
            )
        self.sequences = chosen
        self._update_position()
        return self

    def free(self, sequence: int) -> None:
        """End ``sequence``: its blocks go back to the pool, and it leaves the batch."""
        self._known(sequence, "free")
        self._free.extend(reversed(self._pages.pop(sequence)))
        del self._length[sequence]
        self.sequences = [s for s in self.sequences if s != sequence]
        self._update_position()

    def reserve(self, new: int | Sequence[int]) -> None:
        """Give each batch row's sequence blocks for ``new`` more tokens (one count, or one
        per row). All or nothing: when the pool has too few free blocks, nothing changes.

        Raises:
            ValueError: the pool runs out, naming how many blocks were asked and left.
        """
        counts = [new] * len(self.sequences) if isinstance(new, int) else list(new)
        wanted = [
            max(0, math.ceil((self._length[s] + n) / self.block_size) - len(self._pages[s]))
            for s, n in zip(self.sequences, counts, strict=True)
        ]
        if sum(wanted) > len(self._free):
            raise ValueError(
                f"{_WHO}: the pool ran out of blocks: {sum(wanted)} more asked for "
                f"{sum(counts)} new tokens, {len(self._free)} of {self.num_blocks} left. "
                "Hint: free finished sequences (cache.free(seq)) or make num_blocks larger."
            )
        for s, n in zip(self.sequences, wanted, strict=True):
            self._pages[s].extend(self._free.pop() for _ in range(n))

    def block_table(self, sequences: Sequence[int] | None = None) -> torch.Tensor:
        """(B, max blocks) int32: the blocks of each row's sequence, padded with 0."""
        chosen = (
            self.sequences
            if sequences is None
            else [self._known(s, "block_table") for s in sequences]
        )
        width = max((len(self._pages[s]) for s in chosen), default=0)
        rows = [self._pages[s] + [0] * (width - len(self._pages[s])) for s in chosen]
        return torch.tensor(rows, dtype=torch.int32, device=self.k_cache.device).view(
            len(chosen), width
        )

    def cache_seqlens(self, sequences: Sequence[int] | None = None) -> torch.Tensor:
        """(B,) int32: the tokens each row's sequence holds."""
        chosen = (
            self.sequences
            if sequences is None
            else [self._known(s, "cache_seqlens") for s in sequences]
        )
        return torch.tensor(
            [self._length[s] for s in chosen], dtype=torch.int32, device=self.k_cache.device
        )

    def kvcache_args(self, new: int = 0) -> KVCacheArgs:
        """The cache arguments of :func:`qkv.flash_attn.flash_attn_with_kvcache` for the batch
        rows, with room for ``new`` tokens each, which that call writes in place::

            args = cache.kvcache_args(k.shape[1])
            out = flash_attn_with_kvcache(q, k=k, v=v, causal=True, **args)

        Returns ``k_cache``, ``v_cache``, ``block_table`` and ``cache_seqlens`` (the lengths
        before the call); the rows' lengths then count the ``new`` tokens.
        """
        if isinstance(new, bool) or not isinstance(new, int) or new < 0:
            raise ValueError(
                f"{_WHO}.kvcache_args: new must be an integer ≥ 0, got {new!r}. Hint: the "
                "tokens each row appends, k.shape[1]."
            )
        self.reserve(new)
        args = KVCacheArgs(
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            block_table=self.block_table(),
            cache_seqlens=self.cache_seqlens(),
        )
        self._grow(new)
        self.last_read = [list(self._pages[s]) for s in self.sequences]
        return args

    # -- the module's side -----------------------------------------------------------------

    def rope_positions(
        self, new: int, positions: torch.Tensor | None, device: torch.device
    ) -> tuple[int, torch.Tensor | None]:
        """Each row's new tokens sit after its own sequence: (B, 1, Lnew) positions."""
        if positions is not None or not self.sequences:  # given, or new sequences at 0
            return 0, positions
        held = torch.tensor(self.lengths, device=device)[:, None, None]
        return 0, held + torch.arange(new, device=device)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens into their sequences' blocks; return every row's keys and
        values, gathered and aligned to the end (rows shorter than the longest are padded at
        the front: :meth:`pad_mask` hides that padding).

        Args:
            key: (B, Hkv, Lnew, D), value: (B, Hkv, Lnew, Dv); row b continues
                ``sequences[b]`` (B new sequences when none was chosen).

        Returns:
            ``(keys, values)``, (B, Hkv, L, D) and (B, Hkv, L, Dv), L the longest row.
        """
        self.write(key, value)
        return self.gather()

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the new tokens of each batch row after its sequence (taking blocks)."""
        self._check_new(key, value)
        self._check_pool(key, value)
        batch, new = int(key.shape[0]), int(key.shape[2])
        if not self.sequences:
            self.use([self.add_sequence() for _ in range(batch)])
        if batch != len(self.sequences):
            raise ValueError(
                f"{_WHO}.append: the call has {batch} batch rows but the cache continues "
                f"{len(self.sequences)} sequences {self.sequences}. Hint: cache.use([...]) "
                "one sequence per row."
            )
        self.reserve(new)
        slots = torch.tensor(self.lengths, device=key.device)[:, None] + torch.arange(
            new, device=key.device
        )
        table = self.block_table().to(torch.int64)
        blocks = table.gather(1, slots // self.block_size)
        with torch.no_grad():
            self.k_cache[blocks, slots % self.block_size] = key.transpose(1, 2).to(
                self.k_cache.dtype
            )
            self.v_cache[blocks, slots % self.block_size] = value.transpose(1, 2).to(
                self.v_cache.dtype
            )
        self._grow(new)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every batch row's keys and values, (B, Hkv, L, D), aligned to the end (a copy)."""
        lengths, longest = self.lengths, self.position
        pages = math.ceil(longest / self.block_size)
        table = self.block_table().to(torch.int64)[:, :pages]
        keys = self.k_cache[table].flatten(1, 2)  # (B, pages·P, Hkv, D)
        values = self.v_cache[table].flatten(1, 2)
        index = (
            torch.tensor(lengths, device=keys.device)[:, None]
            - longest
            + torch.arange(longest, device=keys.device)
        )
        index = index.clamp(min=0)[:, :, None, None]  # the front padding repeats position 0
        keys = keys.gather(1, index.expand(-1, -1, *keys.shape[2:]))
        values = values.gather(1, index.expand(-1, -1, *values.shape[2:]))
        self.last_read = [
            self._pages[s][: math.ceil(n / self.block_size)]
            for s, n in zip(self.sequences, lengths, strict=True)
        ]
        return keys.transpose(1, 2), values.transpose(1, 2)

    def pad_mask(self, mask: Mask | torch.Tensor | None, lq: int) -> Mask | torch.Tensor | None:
        """``mask`` (of the gathered keys: Lk the longest row) without the front padding of
        the shorter rows; unchanged when every row has one length."""
        lengths, longest = self.lengths, self.position
        if all(n == longest for n in lengths):
            return mask
        pad = ~key_padding([longest - n for n in lengths])  # keys from the row's first on
        if mask is None or isinstance(mask, Mask):
            return pad if mask is None else pad & mask
        first = torch.tensor([longest - n for n in lengths], device=mask.device)
        dense = torch.arange(longest, device=mask.device) >= first[:, None, None, None]
        if mask.dtype == torch.bool:
            return mask & dense
        return mask.masked_fill(~dense, -math.inf)

    def decode(
        self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool
    ) -> torch.Tensor:
        """Write the new tokens and attend to each row's sequence with the split-KV kernel,
        straight on the blocks: q (B, H, Lq, D) → context (B, H, Lq, Dv)."""
        self.write(key, value)
        ends = self.lengths
        out, _ = decode_attention(
            q.transpose(1, 2),
            self.k_cache,
            self.v_cache,
            ends=ends,
            block_table=self.block_table(),
            causal=causal,
        )
        self.last_read = [
            self._pages[s][: math.ceil(n / self.block_size)]
            for s, n in zip(self.sequences, ends, strict=True)
        ]
        return out.transpose(1, 2)

    def decodes(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether :meth:`decode` serves this call: a few new tokens, no gradient wanted,
        not inside ``torch.compile``."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, key, value))
        return int(q.shape[2]) <= 16 and not grad and not torch.compiler.is_compiling()

    def read_meta(self) -> dict[str, Any]:
        """What the last call read, for a trace's call meta: sequences, lengths, blocks."""
        return {
            "block_size": self.block_size,
            "sequences": list(self.sequences),
            "lengths": self.lengths,
            "blocks": [list(b) for b in self.last_read],
        }

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"sequences={len(self._pages)}, free_blocks={self.free_blocks})"
        )

    # -- inside ------------------------------------------------------------------------------

    def _known(self, sequence: Any, who: str) -> int:
        if (
            isinstance(sequence, bool)
            or not isinstance(sequence, int)
            or sequence not in self._pages
        ):
            raise ValueError(
                f"{_WHO}.{who}: {sequence!r} is not a live sequence of this cache (live: "
                f"{sorted(self._pages)}). Hint: seq = cache.add_sequence(); a freed sequence "
                "is gone."
            )
        return sequence

    def _grow(self, new: int) -> None:
        for s in self.sequences:
            self._length[s] += new
        self._update_position()

    def _update_position(self) -> None:
        self.position = max(self.lengths, default=0)

    def _check_pool(self, key: torch.Tensor, value: torch.Tensor) -> None:
        pool_k, pool_v = self.k_cache, self.v_cache
        for name, new, pool in (("key", key, pool_k), ("value", value, pool_v)):
            heads_dim = (int(pool.shape[2]), int(pool.shape[3]))
            if (int(new.shape[1]), int(new.shape[3])) != heads_dim:
                raise ValueError(
                    f"{_WHO}.append: the new {name} {tuple(new.shape)} must be (B, Hkv, Lnew, "
                    f"{'D' if name == 'key' else 'Dv'}) with (Hkv, D) = {heads_dim}, the "
                    "pool's. Hint: PagedKVCache(num_kv_heads=..., head_dim=...) as the layer."
                )
        if key.device != pool_k.device or key.dtype != pool_k.dtype:
            raise ValueError(
                f"{_WHO}.append: the new key is {key.dtype} on {key.device} but the pool holds "
                f"{pool_k.dtype} on {pool_k.device}. Hint: PagedKVCache(dtype=..., device=...) "
                "as the model's."
            )
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            raise ValueError(
                f"{_WHO}.append: the new keys require grad, but the pool is written in place "
                "and would cut the gradient. Hint: decode under torch.no_grad(), or train "
                "with qkv.nn.KVCache."
            )
