"""The key/value cache for incremental decoding.

Shape legend: B batch, Hkv key/value heads, L tokens held, Lnew new tokens, D head dim,
Dv value head dim, W the window (``max_length``).

Decoding one token at a time recomputes nothing: the keys and values of the tokens already
seen wait in the cache, and each step appends the new token's key and value and attends over
all of them (bottom-right causal alignment: the new queries are the last positions).

Storage is one preallocated buffer per tensor, (B, Hkv, capacity, D), holding the tokens in
``[start, end)``. Appending writes after ``end``; when the buffer is full, it either slides
the held tokens back to the front (when they fill at most half of it) or doubles its
capacity, so each token is copied O(1) times on average: no quadratic copying. With
``max_length`` W, only the last W tokens are kept (a sliding window), so memory is bounded.

With ``track_weights=True`` the cache also keeps, for each token held, the attention weight it
has received so far, summed over every query row given to :meth:`KVCache.accumulate` (the
"attention mass" that heavy-hitter eviction such as H2O or SnapKV ranks tokens by). It lives in
a third buffer indexed like the keys, so it slides, grows and is windowed with them: O(L)
memory, O(Lq·L) work per step, never L².
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["KVCache", "LayerCache"]


class LayerCache(ABC):
    """What every cache of :class:`qkv.nn.MultiHeadAttention` shares: one layer owns it, its
    new keys and values are (B, Hkv, Lnew, D), and the positions RoPE turns new tokens by.

    Subclasses: :class:`KVCache` (one buffer per tensor, all rows one length) and
    :class:`qkv.nn.PagedKVCache` (a pool of pages, one length per sequence).
    """

    max_length: int | None = None  # a sliding window of the last W tokens (None: all)
    track_weights: bool = False  # keeps the attention mass each token received
    position: int = 0  # tokens appended (the longest row's), the next token's position

    def __init__(self) -> None:
        self._owner: int | None = None

    @abstractmethod
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens; return the keys and values to attend over (B, Hkv, L, D)."""

    def rope_positions(
        self, new: int, positions: torch.Tensor | None, device: torch.device
    ) -> tuple[int, torch.Tensor | None]:
        """``(offset, positions)`` for :func:`qkv.positional.apply_rope` of ``new`` tokens
        about to be appended: here every row continues at :attr:`position`."""
        del new, device
        return self.position, positions

    def _check_new(self, key: torch.Tensor, value: torch.Tensor) -> None:
        who = f"{type(self).__name__}.append"
        if key.ndim != 4 or value.ndim != 4:
            raise ValueError(
                f"{who}: key and value must be (B, Hkv, Lnew, D); got key "
                f"{tuple(key.shape)} and value {tuple(value.shape)}. Hint: split heads first."
            )
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"{who}: key {tuple(key.shape)} and value {tuple(value.shape)} must "
                "agree on (B, Hkv, Lnew): one value per key."
            )

    def _claim(self, owner: object) -> None:
        """Tie the cache to the first module that uses it: one cache serves one layer."""
        if self._owner is None or self.position == 0:
            self._owner = id(owner)
        elif self._owner != id(owner):
            name = type(self).__name__
            raise ValueError(
                f"this {name} already holds the keys and values of another attention layer. "
                f"Hint: make one cache per layer, e.g. [{name}(...) for _ in model.blocks]."
            )


class KVCache(LayerCache):
    """Keys and values of the tokens seen so far, for one attention layer.

    Pass the same cache to every call of one layer
    (``attn(x_new, is_causal=True, cache=cache)``); use one cache per layer.

    Args:
        max_length: keep at most this many tokens (a sliding window of W tokens: each query
            then attends to itself and the W − 1 tokens before it); default: no limit.
        capacity: tokens to preallocate on the first append (default 256, or W + 256
            with a window); the buffer grows by doubling when needed.
        track_weights: keep :attr:`attention_mass`, the running sum of the attention weights
            each held token has received (pass the weights to :meth:`accumulate`).

    Attributes:
        position: how many tokens have been appended in all (the position of the next one,
            used for RoPE).
        length: how many tokens are held now (≤ max_length).
        attention_mass: with ``track_weights``, (B, H, L): the summed weights per held token.

    Under autograd (a new key or value that requires grad while grad mode is on), appending
    concatenates instead of writing into the buffer, so gradients stay correct; decode under
    ``torch.no_grad()`` or ``torch.inference_mode()`` for the amortised path.

    Example:
        >>> import torch
        >>> cache = KVCache(max_length=3)
        >>> k = v = torch.zeros(1, 2, 4, 8)                   # (B, Hkv, Lnew, D)
        >>> keys, values = cache.append(k, v)
        >>> keys.shape, cache.length, cache.position
        (torch.Size([1, 2, 4, 8]), 3, 4)
        >>> keys, values = cache.append(k[:, :, :1], v[:, :, :1])
        >>> keys.shape, cache.length, cache.position          # 3 held + 1 new attended
        (torch.Size([1, 2, 4, 8]), 3, 5)
    """

    def __init__(
        self,
        max_length: int | None = None,
        *,
        capacity: int | None = None,
        track_weights: bool = False,
    ) -> None:
        for name, n in (("max_length", max_length), ("capacity", capacity)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(
                    f"KVCache: {name} must be a positive integer or None, got {n!r}. "
                    "Hint: KVCache(max_length=4096) keeps the last 4096 tokens."
                )
        if not isinstance(track_weights, bool):
            raise TypeError(
                f"KVCache: track_weights must be True or False, got {track_weights!r}. "
                "Hint: KVCache(track_weights=True) keeps cache.attention_mass."
            )
        super().__init__()
        self.max_length = max_length
        self.track_weights = track_weights
        self._initial = capacity
        self.reset()

    def reset(self) -> None:
        """Forget every token (start a new sequence); the buffers are freed."""
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._mass: torch.Tensor | None = None  # (B, H, capacity), indexed like _keys
        self._attended = (0, 0)  # the buffer span the last append returned
        self._start = 0
        self._end = 0
        self.position = 0

    @property
    def length(self) -> int:
        return self._end - self._start

    @property
    def capacity(self) -> int:
        """Tokens the buffer holds before it must slide or grow (0 before the first append)."""
        return 0 if self._keys is None else int(self._keys.shape[-2])

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys held, (B, Hkv, L, D), or None before the first append."""
        return None if self._keys is None else self._keys[:, :, self._start : self._end]

    @property
    def values(self) -> torch.Tensor | None:
        """The values held, (B, Hkv, L, Dv), or None before the first append."""
        return None if self._values is None else self._values[:, :, self._start : self._end]

    @property
    def attention_mass(self) -> torch.Tensor | None:
        """(B, H, L): for each token held, the attention weights it has received so far.

        The sum, over every query row given to :meth:`accumulate` since the token entered the
        cache (or since the last :meth:`reset`), of that row's weight on the token; H is the
        number of heads of those weights (query heads under GQA). None without
        ``track_weights`` or before the first :meth:`accumulate`. A read-only view of the
        buffer: ``.clone()`` it to keep it across steps. Tokens that left a window take
        their mass with them.
        """
        if self._mass is None:
            return None
        return self._mass[:, :, self._start : self._end]

    def accumulate(self, weights: torch.Tensor) -> None:
        """Add the attention weights of the last call to :attr:`attention_mass`.

        Args:
            weights: (B, H, Lq, L + Lnew), the weights of the queries that attended the keys
                the last :meth:`append` returned (``need_weights=True`` of
                :class:`~qkv.nn.MultiHeadAttention`). Summed over the Lq rows in float32
                (float64 for float64 weights), without gradient.

        Raises:
            ValueError: a cache without ``track_weights``, nothing appended yet, or weights
                whose shape does not fit the keys of the last append.
        """
        if not self.track_weights:
            raise ValueError(
                "KVCache.accumulate: this cache does not track weights. Hint: create it "
                "with KVCache(track_weights=True)."
            )
        if self._keys is None:
            raise ValueError(
                "KVCache.accumulate: nothing was appended yet, so no key received weights. "
                "Hint: call it after the attention call that appended the new tokens."
            )
        first, last = self._attended
        batch = int(self._keys.shape[0])
        if (
            not isinstance(weights, torch.Tensor)
            or weights.ndim != 4
            or weights.shape[0] != batch
            or weights.shape[-1] != last - first
        ):
            got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
            raise ValueError(
                f"KVCache.accumulate: weights must be (B, H, Lq, L + Lnew) = ({batch}, H, Lq, "
                f"{last - first}), one column per key the last append returned; got {got}. "
                "Hint: pass the weights of the call that made that append, without extra "
                "key rows (add_bias_kv, add_zero_attn)."
            )
        heads = int(weights.shape[1])
        if self._mass is not None and int(self._mass.shape[1]) != heads:
            raise ValueError(
                f"KVCache.accumulate: the mass is kept for {int(self._mass.shape[1])} heads, "
                f"got weights of {heads}. Hint: pass the weights of every query head, or "
                "cache.reset() to start over."
            )
        dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
        if self._mass is None:
            self._mass = torch.zeros(
                (batch, heads, self.capacity), dtype=dtype, device=self._keys.device
            )
        mass = weights.detach().to(self._mass.dtype).sum(dim=2)  # (B, H, L + Lnew)
        self._mass[:, :, first:last] += mass

    def __repr__(self) -> str:
        window = f", max_length={self.max_length}" if self.max_length else ""
        tracked = ", track_weights=True" if self.track_weights else ""
        return f"KVCache(length={self.length}, position={self.position}{window}{tracked})"

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' keys and values; return everything to attend over.

        Args:
            key: (B, Hkv, Lnew, D), the new keys (after RoPE, if any).
            value: (B, Hkv, Lnew, Dv).

        Returns:
            ``(keys, values)``: the tokens held before this call followed by the new ones,
            (B, Hkv, L + Lnew, D) and (B, Hkv, L + Lnew, Dv). Afterwards the cache keeps the
            last ``max_length`` of them.

        Raises:
            ValueError: shapes that do not match each other or the tokens already held.
        """
        self._check(key, value)
        new = int(key.shape[-2])
        functional = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
        if self._keys is None or self._values is None:
            self._allocate(key, value, new)
        elif functional:
            self._keys = torch.cat((self._keys[:, :, self._start : self._end], key), dim=-2)
            self._values = torch.cat((self._values[:, :, self._start : self._end], value), dim=-2)
            if self._mass is not None:
                held = self._mass[:, :, self._start : self._end]
                self._mass = torch.cat((held, held.new_zeros((*held.shape[:2], new))), dim=-1)
            self._start, self._end = 0, int(self._keys.shape[-2])
        else:
            self._make_room(new)
            self._keys[:, :, self._end : self._end + new] = key
            self._values[:, :, self._end : self._end + new] = value
            if self._mass is not None:
                self._mass[:, :, self._end : self._end + new] = 0
            self._end += new
        self._attended = (self._start, self._end)
        assert self._keys is not None and self._values is not None
        keys = self._keys[:, :, self._start : self._end]  # (B, Hkv, L + Lnew, D)
        values = self._values[:, :, self._start : self._end]  # (B, Hkv, L + Lnew, Dv)
        self.position += new
        if self.max_length is not None:
            self._start = max(self._start, self._end - self.max_length)
        return keys, values

    def _allocate(self, key: torch.Tensor, value: torch.Tensor, new: int) -> None:
        self._mass = None
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            self._keys, self._values = key, value
            self._start, self._end = 0, new
            return
        default = 256 + (self.max_length or 0)
        capacity = max(new, self._initial or default)
        batch, heads = key.shape[0], key.shape[1]
        self._keys = key.new_empty((batch, heads, capacity, key.shape[-1]))
        self._values = value.new_empty((batch, heads, capacity, value.shape[-1]))
        self._keys[:, :, :new] = key
        self._values[:, :, :new] = value
        self._start, self._end = 0, new

    def _make_room(self, new: int) -> None:
        """Make ``new`` free slots after ``end``: slide the held tokens back, or grow."""
        assert self._keys is not None and self._values is not None
        capacity, held = self.capacity, self.length
        if self._end + new <= capacity:
            return
        if 2 * (held + new) <= capacity:  # slide back: at least half the buffer was free
            for buffer in (self._keys, self._values):
                buffer[:, :, :held] = buffer[:, :, self._start : self._end].clone()
            if self._mass is not None:
                self._mass[:, :, :held] = self._mass[:, :, self._start : self._end].clone()
        else:  # grow: double the capacity (again, for a long chunk)
            size = 2 * capacity
            while size < held + new:
                size *= 2
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                grown = old.new_empty((*old.shape[:-2], size, old.shape[-1]))
                grown[:, :, :held] = old[:, :, self._start : self._end]
                setattr(self, name, grown)
            if self._mass is not None:
                mass = self._mass.new_zeros((*self._mass.shape[:-1], size))
                mass[:, :, :held] = self._mass[:, :, self._start : self._end]
                self._mass = mass
        self._start, self._end = 0, held

    def _check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._check_new(key, value)
        if self._keys is None or self._values is None:
            return
        held_k, held_v = tuple(self._keys.shape), tuple(self._values.shape)
        for name, new, held in (("key", key, held_k), ("value", value, held_v)):
            if (new.shape[0], new.shape[1], new.shape[3]) != (held[0], held[1], held[3]):
                raise ValueError(
                    f"KVCache.append: the new {name} {tuple(new.shape)} does not fit the "
                    f"tokens held (B, Hkv, D) = {(held[0], held[1], held[3])}. Hint: use one "
                    "cache per layer and per batch; cache.reset() starts a new sequence."
                )
        if key.dtype != self._keys.dtype or key.device != self._keys.device:
            raise ValueError(
                f"KVCache.append: the new key is {key.dtype} on {key.device} but the cache "
                f"holds {self._keys.dtype} on {self._keys.device}. Hint: cache.reset() first."
            )
