"""``MultiHeadAttention``: project, split heads, call the core, merge heads, project.

Shape legend (batch first, as everywhere in qkv.nn):

    B   batch               Lq  query length            E    embed_dim (d_model)
    H   query heads         Lk  key / value length      Ek   kdim, Ev vdim
    Hkv key/value heads     D   head_dim (d_k = d_v)

    query (B, Lq, E)   key (B, Lk, Ek)   value (B, Lk, Ev)   →   output (B, Lq, E)

The module only projects and splits heads: the attention itself is
:func:`qkv.scaled_dot_product_attention`, which picks the fastest exact backend (PyTorch's
fused kernel when nobody asks for the weights or a trace, the readable reference otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import nn

from qkv._edit_point import EditSite, active_editor
from qkv.attention import scaled_dot_product_attention
from qkv.attention._compiled import run_eagerly
from qkv.attention._dispatch import weight_rows
from qkv.distributed import Layout
from qkv.masks import Mask, alibi
from qkv.nn._cache import KVCache
from qkv.nn._inputs import check_inputs, check_packed, divisors, positive
from qkv.nn._masks import MaskLike, combine_masks
from qkv.nn._paged import PagedKVCache
from qkv.nn._sequence import SequenceSplit, check_split, split_attention
from qkv.nn._torch import read_torch
from qkv.positional import ALiBi, RoPE, alibi_slopes, apply_rope
from qkv.positional import resolve as resolve_positional
from qkv.steps import WORDS
from qkv.trace import Trace, blocks_open, current_trace, suspended

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch first: softmax(Q·Kᵀ/√D + bias, mask)·V in each head.

    ``Q = X·W_q``, ``K = Y·W_k``, ``V = Y·W_v`` (Y = X for self-attention), split into heads
    of D features, attended head by head, concatenated and projected by ``W_o``. With fewer
    key/value heads than query heads (``num_kv_heads``), each key/value head serves a group
    of query heads: grouped-query attention (GQA), or multi-query attention (MQA) with one.

    Args:
        embed_dim: E, the width of the queries' sequence and of the output.
        num_heads: H, the query heads.
        num_kv_heads: Hkv, the key/value heads (default H); must divide H.
        kdim, vdim: Ek and Ev, the widths of the key and value inputs (default E).
        head_dim: D (default E / H).
        bias: learn biases in the four projections.
        dropout: probability of dropping an attention weight while training.
        positional: None, ``"rope"`` (half-split pairs), ``"rope-interleaved"``, ``"alibi"``,
            or a :class:`qkv.positional.RoPE` / :class:`qkv.positional.ALiBi` with settings.
        sinks: learn one attention-sink logit per query head (initialised to 0), as in
            gpt-oss: each softmax row gets one more term exp(sink_h), so a head may give
            part of its attention to no token.
        sequence_group: a ``torch.distributed`` process group to split the sequence
            across (sequence parallelism, ring attention; see :func:`qkv.nn.split_sequence`):
            each rank passes its own positions ``shard(x, layout=sequence_layout, dim=1)``,
            of shape (B, N/P, E), and masks are rules in global positions. None: one process
            holds the whole sequence.
        sequence_layout, sequence_strategy: the layout (``"zigzag"``, ``"contiguous"``,
            ``"striped"``) and strategy (``"ring"``, ``"allgather"``, ``"ulysses"``) of
            :func:`qkv.distributed.ring_attention`.

    Attributes:
        q_proj, k_proj, v_proj, out_proj: the projections (``torch.nn.Linear``); in qkv's
            row-vector convention ``W_q = q_proj.weight.T`` (also the property ``W_q``).
        sinks: the (H,) sink logits (``nn.Parameter``), or None.
        sequence_split: the :class:`qkv.nn.SequenceSplit` settings, or None.

    Example:
        >>> import torch
        >>> attn = MultiHeadAttention(64, num_heads=8, num_kv_heads=2, positional="rope")
        >>> x = torch.randn(2, 10, 64)                        # (B, L, E)
        >>> attn(x, is_causal=True).shape                      # self-attention
        torch.Size([2, 10, 64])
        >>> out, weights = attn(x, need_weights=True)
        >>> weights.shape                                      # (B, H, Lq, Lk)
        torch.Size([2, 8, 10, 10])
    """

    _qkv_traceable = True  # qkv.tracing(model=...) names and records modules with this flag

    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None
    sinks: nn.Parameter | None
    sequence_split: SequenceSplit | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        positional: str | RoPE | ALiBi | None = None,
        sinks: bool = False,
        sequence_group: Any = None,
        sequence_layout: Layout = "zigzag",
        sequence_strategy: str = "ring",
    ) -> None:
        super().__init__()
        self.sequence_split = check_split(sequence_group, sequence_layout, sequence_strategy)
        if not isinstance(sinks, bool):
            raise TypeError(
                f"sinks must be True or False, got {type(sinks).__name__}. Hint: sinks=True "
                "adds a learnable (num_heads,) parameter initialised to 0; a tensor of your "
                "own goes to qkv.scaled_dot_product_attention(sinks=...)."
            )
        embed_dim = positive(embed_dim, "embed_dim", "the model width E, e.g. 512")
        num_heads = positive(num_heads, "num_heads", "e.g. 8")
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kv_heads = positive(kv_heads, "num_kv_heads", "1 is multi-query attention")
        if num_heads % kv_heads:
            raise ValueError(
                f"num_kv_heads must divide num_heads: num_heads={num_heads}, "
                f"num_kv_heads={kv_heads}. Hint: each key/value head serves num_heads / "
                f"num_kv_heads query heads; valid: {divisors(num_heads)}."
            )
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim must be divisible by num_heads when head_dim is not given: "
                    f"embed_dim={embed_dim}, num_heads={num_heads}. Hint: choose num_heads "
                    f"among {divisors(embed_dim)}, or pass head_dim=..."
                )
            head_dim = embed_dim // num_heads
        head_dim = positive(head_dim, "head_dim", "the features per head, D")
        kdim = embed_dim if kdim is None else positive(kdim, "kdim", "the key input width")
        vdim = embed_dim if vdim is None else positive(vdim, "vdim", "the value input width")
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
            or not 0.0 <= dropout < 1.0
        ):
            raise ValueError(
                f"dropout must be a probability in [0, 1), got {dropout!r}. "
                "Hint: dropout=0.1 drops one attention weight in ten while training."
            )
        settings = resolve_positional(positional)
        if isinstance(settings, RoPE) and head_dim % 2:
            raise ValueError(
                f"positional={positional!r} needs an even head_dim (RoPE rotates pairs of "
                f"features), got head_dim={head_dim}. Hint: pass an even head_dim=..."
            )
        slopes = settings.slopes if isinstance(settings, ALiBi) else None
        if slopes is not None and len(slopes) != num_heads:
            raise ValueError(
                f"ALiBi slopes must give one slope per head ({num_heads}), got "
                f"{len(slopes)}. Hint: ALiBi() uses the standard slopes."
            )
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, kv_heads
        self.head_dim, self.kdim, self.vdim = head_dim, kdim, vdim
        self.dropout = float(dropout)
        self.positional = settings
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(kdim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(vdim, kv_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias)
        # Extra key/value rows of torch.nn.MultiheadAttention (set by from_torch only).
        self.register_parameter("bias_k", None)
        self.register_parameter("bias_v", None)
        self.add_zero_attn = False
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))
        else:
            self.register_parameter("sinks", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projection weights and zero biases (as torch.nn.MultiheadAttention)."""
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(linear.weight)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    # -- the weight matrices in qkv's row-vector convention -------------------------------

    @property
    def W_q(self) -> torch.Tensor:
        """(E, H·D): ``Q = X·W_q`` (a view of ``q_proj.weight.T``)."""
        return self.q_proj.weight.T

    @property
    def W_k(self) -> torch.Tensor:
        """(Ek, Hkv·D): ``K = Y·W_k``."""
        return self.k_proj.weight.T

    @property
    def W_v(self) -> torch.Tensor:
        """(Ev, Hkv·D): ``V = Y·W_v``."""
        return self.v_proj.weight.T

    @property
    def W_o(self) -> torch.Tensor:
        """(H·D, E): ``O = concat·W_o``."""
        return self.out_proj.weight.T

    def extra_repr(self) -> str:
        text = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            text += f", num_kv_heads={self.num_kv_heads}"
        if self.head_dim * self.num_heads != self.embed_dim:
            text += f", head_dim={self.head_dim}"
        if self.dropout:
            text += f", dropout={self.dropout}"
        if self.positional is not None:
            text += f", positional={self.positional}"
        if self.sinks is not None:
            text += ", sinks=True"
        if self.sequence_split is not None:
            text += f", sequence_layout={self.sequence_split.layout!r}"
        return text

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """The same attention as a ``torch.nn.MultiheadAttention``, with its weights copied.

        Any of its settings: ``bias``, ``add_bias_kv``, ``add_zero_attn``, ``kdim``/``vdim``,
        ``dropout``; the result is on the module's device and dtype. qkv is batch first: for a
        module built without ``batch_first=True``, transpose the inputs,
        ``x.transpose(0, 1)``. Its masks (True = *ignore*) convert with
        :func:`qkv.nn.masks_from_torch`.

        Example:
            >>> import torch
            >>> theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True)
            >>> ours = MultiHeadAttention.from_torch(theirs)
            >>> x = torch.randn(2, 5, 16)
            >>> torch.allclose(ours(x), theirs(x, x, x, need_weights=False)[0], atol=1e-6)
            True
        """
        found = read_torch(module)
        ours = cls(
            found.embed_dim,
            found.num_heads,
            kdim=found.kdim,
            vdim=found.vdim,
            bias=found.biases is not None,
            dropout=found.dropout,
        )
        ours.to(device=found.device, dtype=found.dtype)
        with torch.no_grad():
            projections = (ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj)
            for linear, weight in zip(projections, found.weights, strict=True):
                linear.weight.copy_(weight)
            for linear, bias in zip(projections, found.biases or (), strict=False):
                assert linear.bias is not None
                linear.bias.copy_(bias)
            if found.bias_k is not None and found.bias_v is not None:
                ours.bias_k = nn.Parameter(found.bias_k.detach().clone())  # (1, 1, E)
                ours.bias_v = nn.Parameter(found.bias_v.detach().clone())
        ours.add_zero_attn = found.add_zero_attn
        ours.train(found.training)
        return ours

    # -- forward ---------------------------------------------------------------------------

    @overload
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = ...,
        value: torch.Tensor | None = ...,
        *,
        mask: MaskLike | None = ...,
        key_padding_lengths: torch.Tensor | Sequence[int] | None = ...,
        is_causal: bool = ...,
        cache: KVCache | PagedKVCache | None = ...,
        need_weights: Literal[False] = ...,
        cu_seqlens: torch.Tensor | Sequence[int] | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = ...,
        value: torch.Tensor | None = ...,
        *,
        mask: MaskLike | None = ...,
        key_padding_lengths: torch.Tensor | Sequence[int] | None = ...,
        is_causal: bool = ...,
        cache: KVCache | PagedKVCache | None = ...,
        need_weights: Literal[True],
        cu_seqlens: torch.Tensor | Sequence[int] | None = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: MaskLike | None = None,
        key_padding_lengths: torch.Tensor | Sequence[int] | None = None,
        is_causal: bool = False,
        cache: KVCache | PagedKVCache | None = None,
        need_weights: bool = False,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when key is None).

        Args:
            query: (B, Lq, E).
            key: (B, Lk, Ek); default ``query`` (self-attention).
            value: (B, Lk, Ev); default ``key``.
            mask: boolean, **True = may attend**, of shape (Lq, Lk) or (B, H or 1, Lq, Lk),
                or a :class:`qkv.masks.Mask`; or a float tensor of those shapes, added to
                the scaled scores as a bias (torch's float ``attn_mask``: −inf blocks a
                key). Lk counts the cached tokens too.
            key_padding_lengths: (B,) integers: batch element b attends only its first
                ``lengths[b]`` keys (the rest is padding).
            is_causal: each query attends only to keys at its position or before. The queries
                are the last positions of the keys (bottom-right alignment), as when
                decoding with a cache.
            cache: a :class:`qkv.nn.KVCache` or :class:`qkv.nn.PagedKVCache` (self-attention
                only): the new keys and values are appended to it and the queries attend to
                everything it holds (with a paged cache, each batch row to its own sequence).
            need_weights: also return the attention weights (B, H, Lq, Lk), per head and
                before dropout (this runs the reference path).
            cu_seqlens: (S + 1,) integers for packed training: ``query`` is (1, T, E), S
                sequences one after another (FlashAttention's ``cu_seqlens``: a leading 0,
                the total T last). Each sequence attends only to itself (``is_causal``
                within it), and RoPE counts its positions from the sequence's start.
                Self-attention only; ``mask`` then is a :class:`qkv.masks.Mask` in packed
                positions.

        Returns:
            The output (B, Lq, E), or ``(output, weights)`` with ``need_weights=True``.

        Raises:
            ValueError, TypeError: inputs whose shapes or types do not fit, naming the
                argument, what was expected and what came.
        """
        self_attention = key is None or key is query
        key = query if key is None else key
        value = key if value is None else value
        weights = next(self.parameters(), None)
        check_inputs(
            query,
            key,
            value,
            cache,
            self_attention,
            widths=(self.embed_dim, self.kdim, self.vdim),
            weights_dtype=None if weights is None else weights.dtype,
            extra_rows=self.bias_k is not None or self.add_zero_attn,
        )
        positions = None
        if cu_seqlens is not None:  # packed sequences: the rule of each, positions within it
            packed, positions = check_packed(
                cu_seqlens, query, self_attention, mask, key_padding_lengths, cache, is_causal
            )
            mask = packed & mask if isinstance(mask, Mask) else packed
            key_padding_lengths, is_causal = None, False
        if self.sequence_split is not None:
            return split_attention(
                self,
                query,
                self.sequence_split,
                self_attention=self_attention,
                mask=mask,
                lengths=key_padding_lengths,
                is_causal=is_causal,
                cache=cache,
                need_weights=need_weights,
            )
        args = (
            query,
            key,
            value,
            mask,
            key_padding_lengths,
            is_causal,
            cache,
            need_weights,
            positions,
        )
        if not blocks_open():  # tracing off: one look at a list, which torch.compile reads too
            return self._attend(*args, None)
        if torch.compiler.is_compiling():  # a trace is recorded outside the compiled graph
            return run_eagerly(self._traced, *args)  # type: ignore[no-any-return]
        return self._traced(*args)

    def _traced(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: MaskLike | None,
        key_padding_lengths: torch.Tensor | Sequence[int] | None,
        is_causal: bool,
        cache: KVCache | PagedKVCache | None,
        need_weights: bool,
        positions: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward inside a tracing block: recorded when the layer is selected."""
        args = (
            query,
            key,
            value,
            mask,
            key_padding_lengths,
            is_causal,
            cache,
            need_weights,
            positions,
        )
        trace = current_trace()
        if trace is None:  # a block that records nothing here (suspended, another thread)
            return self._attend(*args, None)
        path = trace.layer_name(self)
        if not trace.records_layer(path):
            with suspended():  # a layer not selected runs as if tracing were off
                return self._attend(*args, None)
        facts = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "positional": None if self.positional is None else repr(self.positional),
            "causal": bool(is_causal),
        }
        with trace.in_layer(path, **facts):
            return self._attend(*args, trace)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: MaskLike | None,
        key_padding_lengths: torch.Tensor | Sequence[int] | None,
        is_causal: bool,
        cache: KVCache | PagedKVCache | None,
        need_weights: bool,
        positions: torch.Tensor | None,
        trace: Trace | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        batch, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if trace is not None:
            self._record(trace, "embeddings", query, ("batch", "token", "model"))
            for name in ("W_q", "W_k", "W_v"):
                self._record(trace, name, getattr(self, name), ("model", "feature"))

        k_flat, v_flat = self.k_proj(key), self.v_proj(value)  # (B, Lk, Hkv·D)
        if self.bias_k is not None and self.bias_v is not None:  # one learned key/value row
            k_flat = torch.cat((k_flat, self.bias_k.expand(batch, 1, -1)), dim=1)
            v_flat = torch.cat((v_flat, self.bias_v.expand(batch, 1, -1)), dim=1)
        q = self.q_proj(query).view(batch, lq, H, D).transpose(1, 2)  # (B, H, Lq, D)
        k = k_flat.view(batch, -1, Hkv, D).transpose(1, 2)  # (B, Hkv, Lk, D)
        v = v_flat.view(batch, -1, Hkv, D).transpose(1, 2)  # (B, Hkv, Lk, D)
        if self.add_zero_attn:  # one all-zero key/value row
            k = torch.cat((k, k.new_zeros(batch, Hkv, 1, D)), dim=2)
            v = torch.cat((v, v.new_zeros(batch, Hkv, 1, D)), dim=2)

        held, offset, at = 0 if cache is None else cache.position, 0, positions
        if cache is not None:  # a paged cache's rows each continue at their own position
            offset, at = cache.rope_positions(lq, positions, query.device)
        if isinstance(self.positional, RoPE):
            base, layout = self.positional.base, self.positional.layout
            q = apply_rope(q, at, offset=offset, base=base, layout=layout)
            k = apply_rope(k, at, offset=offset, base=base, layout=layout)
        if cache is not None:
            cache._claim(self)
            plain = trace is None and mask is None and key_padding_lengths is None
            plain = plain and not need_weights and self.sinks is None and active_editor() is None
            plain = plain and not isinstance(self.positional, ALiBi)
            plain = plain and not (self.training and self.dropout > 0)
            if plain and isinstance(cache, PagedKVCache) and cache.decodes(q, k, v):
                context = cache.decode(q, k, v, causal=is_causal)  # split-KV on the pages
                output: torch.Tensor = self.out_proj(
                    context.transpose(1, 2).reshape(batch, lq, H * D)
                )
                return output
            k, v = cache.append(k, v)  # (B, Hkv, L + Lq, D): the tokens held and the new ones
            lk = int(k.shape[2])
            if isinstance(cache, PagedKVCache):  # rows shorter than the longest: padded
                mask = cache.pad_mask(mask, lq)
        extra = int(k.shape[2]) - lk  # rows from add_bias_kv / add_zero_attn

        allowed, bias, causal_flag = combine_masks(
            mask,
            key_padding_lengths,
            is_causal,
            window=None if cache is None else cache.max_length,
            batch=batch,
            heads=H,
            lq=lq,
            lk=lk,
            extra=extra,
            device=query.device,
        )
        # A cache that tracks weights sums each held key's weights over the decoding steps.
        track = cache if isinstance(cache, KVCache) and cache.track_weights else None
        score_mod = None
        if isinstance(self.positional, ALiBi):
            # The dispatcher turns it into an (H, Lq, Lk) bias where that is faster.
            slopes = self.positional.slopes or alibi_slopes(H)
            score_mod = alibi(list(slopes), alignment="bottom-right")
        wanted = need_weights or track is not None
        options: dict[str, Any] = {
            "mask": allowed,
            "bias": bias,
            "score_mod": score_mod,
            "is_causal": causal_flag,
            "causal_alignment": "top-left" if lq == lk else "bottom-right",
            "enable_gqa": Hkv != H,
            "sinks": self.sinks,
        }
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            **options,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=wanted,
        )
        context, weights = out if wanted else (out, None)  # (B, H, Lq, D)
        if trace is not None and isinstance(cache, PagedKVCache):  # the blocks it read
            trace.amend_last_call({}, pages=cache.read_meta())
        editor = active_editor()
        if editor is not None:  # inside qkv.intervene: the edits of this layer

            def rows_of(heads: list[int], rows: list[int]) -> torch.Tensor:
                found = weight_rows(q, k, v, heads, rows, **options)
                return torch.from_numpy(found).to(q.device)

            last = cache is not None or (is_causal and lq < lk)
            first_key = 0 if cache is None else held + lq - lk  # a window let tokens go
            site = EditSite(self, q, k, v, context, weights, last, rows_of, first_key)
            context, weights = editor(site)
        if track is not None and weights is not None:
            track.accumulate(weights)
        concat = context.transpose(1, 2).reshape(batch, lq, H * D)  # (B, Lq, H·D)
        output = self.out_proj(concat)  # (B, Lq, E)
        if trace is not None:
            self._record(trace, "concat", concat, ("batch", "query", "feature"))
            self._record(trace, "W_o", self.W_o, ("feature", "model"))
            self._record(trace, "output", output, ("batch", "query", "model"))
        return (output, weights) if need_weights and weights is not None else output

    def _record(self, trace: Trace, name: str, value: torch.Tensor, axes: tuple[str, ...]) -> None:
        if not trace.wants_step(name):
            return
        words = WORDS[name]
        trace.record(name, value, formula=words.formula, description=words.description, axes=axes)
