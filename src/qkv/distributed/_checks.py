"""Checks of a ring-attention call, and how the ranks agree on them.

A check that fails on one rank only must not leave the others waiting in a collective until
its timeout. So every rank runs its own checks (and plans its steps) inside a ``try``, and
then all ranks exchange one small row (an error flag, the shapes and dtype, which ring steps
have work, and the call's options: ``is_causal``, ``layout``, ``strategy``, ``scale`` by
value, ``sinks`` and ``mask`` by a digest of their content) in one all-gather. A rank whose
own check failed raises its error; the others raise an error naming it; options or shards
that differ between ranks raise the same error on every rank, naming the option and the
ranks. The union of the ranks' busy steps says which steps anyone computes.
"""

from __future__ import annotations

import hashlib
import struct
import types
from typing import Any

import torch
import torch.distributed as dist

from qkv.distributed._layout import LAYOUTS, check_layout
from qkv.kernels._api import check_sinks
from qkv.kernels._flex_masks import fingerprint
from qkv.masks import Mask

__all__ = ["FLOATS", "OPTIONS", "STRATEGIES", "agree", "check_call", "encode_options"]

STRATEGIES: tuple[str, ...] = ("ring", "allgather", "ulysses")

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_SHAPE = 10  # q's and k's shapes, v's last dim, the dtype's index
OPTIONS = ("is_causal", "layout", "strategy", "scale", "sinks", "mask")
"""The options every rank must pass alike, in the order of the agreed row."""


def encode_options(
    is_causal: bool, layout: str, strategy: str, scale: float | None, sinks: Any, mask: Any
) -> list[int]:
    """The options as integers that are equal on two ranks exactly when the options are:
    is_causal, layout and strategy by value, scale by its float64 bits, sinks by a digest of
    their values and mask by a digest of its rule (its code and what it closes over)."""
    scale_bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    sinks_digest = 0 if sinks is None else _digest(sinks.detach().cpu().double().numpy().tobytes())
    return [
        int(bool(is_causal)),
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        STRATEGIES.index(strategy) if strategy in STRATEGIES else -1,
        scale_bits,
        sinks_digest,
        0 if mask is None else _digest(_stable(fingerprint(mask))),
    ]


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _stable(key: object) -> bytes:
    """A rule's fingerprint as bytes that another process computes alike: code objects by
    their bytecode, constants and names (not by ``hash``, which differs between processes),
    objects compared by identity by their type's name."""
    if isinstance(key, tuple):
        return b"(" + b",".join(_stable(part) for part in key) + b")"
    if isinstance(key, types.CodeType):
        parts = (key.co_code, key.co_consts, key.co_names, key.co_varnames)
        return b"code" + _stable(tuple(_stable(p) if isinstance(p, tuple) else p for p in parts))
    if isinstance(key, bytes):
        return b"b" + key
    if key is None or isinstance(key, bool | int | float | str):
        return repr(key).encode()
    return type(getattr(key, "obj", key)).__name__.encode()


def _option_text(name: str, value: int) -> str:
    if name == "is_causal":
        return str(bool(value))
    if name == "layout":
        return repr(LAYOUTS[value]) if 0 <= value < len(LAYOUTS) else "?"
    if name == "strategy":
        return repr(STRATEGIES[value]) if 0 <= value < len(STRATEGIES) else "?"
    if name == "scale":
        return "None" if value == -1 else f"{struct.unpack('<d', struct.pack('<q', value))[0]:g}"
    return "none" if value == 0 else f"#{value & 0xFFFF:04x}"


def check_call(
    q: Any, k: Any, v: Any, mask: Any, sinks: Any, layout: str, strategy: str
) -> torch.Tensor | None:
    """Raise a one-line error for bad arguments of this rank; returns the checked sinks."""
    check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}. "
            "Hint: 'ring' keeps O(N/P) memory per rank; 'allgather' gathers K/V once; "
            "'ulysses' exchanges heads."
        )
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a qkv.masks.Mask rule in global positions, got "
            f"{type(mask).__name__}. Hint: a dense boolean array cannot be split across "
            "ranks; use qkv.masks.from_function for a rule of your own."
        )
    _check_tensors(q, k, v)
    if mask is not None:
        mask.check_batch(q.shape[0])  # one length per batch element
    return None if sinks is None else check_sinks(sinks, q)


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    named = (("q", q), ("k", k), ("v", v))
    for name, x in named:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.dtype not in FLOATS:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else ""
            raise ValueError(
                f"{name} must be a floating-point torch.Tensor (B, H, N/P, D), got "
                f"{got or type(x).__name__}. Hint: shard each of q, k, v with "
                "qkv.distributed.shard(x, layout=...)."
            )
    if len({x.dtype for _, x in named}) > 1 or len({x.device for _, x in named}) > 1:
        raise TypeError(
            f"q, k and v must share one dtype and one device, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Hint: convert them with .to(q)."
        )
    (b, h, n, d), (bk, hk, nk, dk), (bv, hv, nv, _) = q.shape, k.shape, v.shape
    if d != dk or (bk, hk, nk) != (bv, hv, nv) or (b, n) != (bk, nk) or hk == 0 or h % hk:
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. "
            "Hint: (B, H, N/P, D), (B, Hkv, N/P, D), (B, Hkv, N/P, Dv) with Hkv dividing H."
        )


def _device(q: Any, group: Any) -> torch.device:
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if isinstance(q, torch.Tensor) and q.is_cuda:
        return q.device
    return torch.device("cuda", torch.cuda.current_device())


def agree(
    q: Any,
    k: Any,
    v: Any,
    busy: list[bool],
    error: Exception | None,
    size: int,
    group: Any,
    options: list[int] | None = None,
) -> list[int]:
    """Exchange every rank's check result, busy steps and options (:func:`encode_options`)
    in one all-gather; raise the same way on every rank when any rank failed or the options
    or shards differ. Returns the ring steps that some rank computes, in order."""
    if size == 1:
        if error is not None:
            raise error
        return [s for s, b in enumerate(busy) if b]
    row = [0] * (1 + _SHAPE + size + len(OPTIONS))
    if error is None:
        row[0] = 1
        row[1 : 1 + _SHAPE] = [*q.shape, *k.shape, v.shape[-1], FLOATS.index(q.dtype)]
        row[1 + _SHAPE : 1 + _SHAPE + size] = [int(b) for b in busy]
        row[1 + _SHAPE + size :] = options or [0] * len(OPTIONS)
    device = _device(q, group)
    mine = torch.tensor(row, dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rows = [[int(x) for x in t.cpu()] for t in every]
    if error is not None:
        raise error
    refused = [r for r, got in enumerate(rows) if got[0] == 0]
    if refused:
        raise ValueError(
            f"rank {refused[0]} refused its input (its own error says why), so every rank "
            "stops here. Hint: read the error printed by that rank."
        )
    for i, name in enumerate(OPTIONS):
        values = [got[1 + _SHAPE + size + i] for got in rows]
        if len(set(values)) > 1:
            held = {value: [r for r, got in enumerate(values) if got == value] for value in values}
            listed = "; ".join(
                f"{_option_text(name, value)} on rank{'s' if len(ranks) > 1 else ''} "
                + ", ".join(map(str, ranks))
                for value, ranks in held.items()
            )
            raise ValueError(
                f"ring_attention: {name} differs between ranks ({listed}). Hint: every rank "
                f"must call it with the same {', '.join(OPTIONS)}"
            )
    shapes = {tuple(got[1 : 1 + _SHAPE]) for got in rows}
    if len(shapes) > 1:
        listed = "; ".join(f"rank {r}: q {got[1:5]}, k {got[5:9]}" for r, got in enumerate(rows))
        raise ValueError(
            f"the shards differ between ranks ({listed}). Hint: every rank must pass shards "
            "of one shape and dtype, from qkv.distributed.shard on the same full tensors."
        )
    return [s for s in range(size) if any(got[1 + _SHAPE + s] for got in rows)]
