"""Positional encodings: where each token sits, told to attention.

Attention by itself is blind to order: permute the tokens and the context vectors permute with
them. Three classic ways to tell it the positions, all here, all on NumPy arrays and PyTorch
tensors alike (nothing here imports PyTorch):

- :func:`sinusoidal` - the fixed table of Vaswani et al. (2017), *added* to the embeddings:
  ``PE[p, 2i] = sin(p / base^(2i/d))``, ``PE[p, 2i+1] = cos(p / base^(2i/d))``.
- :func:`apply_rope` - rotary position embedding (RoPE, Su et al. 2021): each pair of features
  of a query or key is rotated by the angle ``p · θ_i`` with ``θ_i = base^(−2i/D)``, so that
  ``q_m·k_n`` depends on the positions only through ``m − n``. Two layouts of the pairs:
  ``"half"`` pairs feature i with feature i + D/2 (GPT-NeoX, Llama in Hugging Face),
  ``"interleaved"`` pairs features 2i and 2i + 1 (the paper, GPT-J).
- :func:`alibi_bias` - ALiBi (Press et al. 2022): no embedding at all, a bias
  ``−m_h · |i − j|`` added to the scaled scores of head h, with the geometric slopes
  :func:`alibi_slopes`.

:class:`RoPE` and :class:`ALiBi` are the settings of the last two, as taken by
``qkv.nn.MultiHeadAttention(positional=...)``.

Shape legend: B batch, H heads, L / Lq query length, Lk key length, D head dim, E model dim.

Example:
    >>> import numpy as np
    >>> from qkv import positional
    >>> positional.alibi_slopes(4)
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> positional.alibi_bias(4, 3, 3)[0]      # head 0, slope 1/4
    array([[ 0.  , -0.25, -0.5 ],
           [-0.25,  0.  , -0.25],
           [-0.5 , -0.25,  0.  ]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import array_api_compat.numpy as xp_numpy
import numpy as np

from qkv._array import (
    Array,
    as_array,
    compiling,
    dtype_name,
    is_floating,
    library,
    namespace,
    shape_str,
    to_numpy,
)
from qkv._array import device as array_device
from qkv.masks._scores import alibi_slopes, alibi_table

__all__ = [
    "ALiBi",
    "RoPE",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "resolve",
    "rope_angles",
    "sinusoidal",
]

RopeLayout = Literal["half", "interleaved"]


# -- ALiBi ----------------------------------------------------------------------------------


def alibi_bias(
    num_heads: int,
    q_len: int,
    kv_len: int | None = None,
    *,
    offset: int | None = None,
    slopes: Sequence[float] | None = None,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Array:
    """The ALiBi bias of shape (H, Lq, Lk): ``bias[h, i, j] = −m_h · |(i + offset) − j|``.

    Added to the scaled scores (``bias=`` of :func:`qkv.scaled_dot_product_attention`), it
    penalises each key linearly with its distance from the query. Under a causal mask only
    j ≤ i + offset is kept, where this is the paper's ``m_h · (j − i)``.

    Args:
        num_heads: H.
        q_len, kv_len: Lq and Lk (Lk = Lq by default).
        offset: the position of query 0 among the keys. Default Lk − Lq: the queries are the
            last positions, as when decoding with a KV cache (bottom-right alignment).
        slopes: one slope per head (default :func:`alibi_slopes`).
        xp: the array library: NumPy by default, or ``torch`` (or an array API namespace).
        device, dtype: where and in which dtype to build it (default float64 for NumPy,
            float32 for PyTorch).

    Example:
        >>> alibi_bias(2, 1, 3)            # one query, the last position, sees 3 keys
        array([[[-0.125     , -0.0625    ,  0.        ]],
        <BLANKLINE>
               [[-0.0078125 , -0.00390625,  0.        ]]])
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"alibi_bias: {name} must be a positive integer, got {n!r}. "
                "Hint: the lengths of the query and key sequences."
            )
    values = list(alibi_slopes(num_heads) if slopes is None else slopes)
    if len(values) != num_heads:
        raise ValueError(
            f"alibi_bias: slopes must have one value per head ({num_heads}), got "
            f"{len(values)}. Hint: leave slopes=None for the standard geometric slopes."
        )
    offset = kv_len - q_len if offset is None else int(offset)
    xp = _namespace(xp)
    if dtype is None:
        dtype = xp.float32 if _is_torch_xp(xp) else xp.float64
    return alibi_table(values, q_len, kv_len, offset, xp=xp, device=device, dtype=dtype)


# -- sinusoidal ------------------------------------------------------------------------------


def sinusoidal(
    length: int,
    dim: int,
    *,
    offset: int = 0,
    base: float = 10000.0,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Array:
    """The sinusoidal position table (L, E) of "Attention Is All You Need", added to X.

    ``PE[p, 2i] = sin(p / base^(2i/E))`` and ``PE[p, 2i+1] = cos(p / base^(2i/E))`` for the
    positions p = offset … offset + L − 1.

    Args:
        length: L, the number of positions.
        dim: E, the model dim (the width of the embeddings).
        offset: the first position (e.g. the number of tokens already in a KV cache).
        base: the wavelength base (10000 in the paper).
        xp, device, dtype: as in :func:`alibi_bias`.

    Example:
        >>> sinusoidal(2, 4).round(4)
        array([[0.    , 1.    , 0.    , 1.    ],
               [0.8415, 0.5403, 0.01  , 1.    ]])
    """
    for name, n, least in (("length", length, 0), ("dim", dim, 1), ("offset", offset, 0)):
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ValueError(
                f"sinusoidal: {name} must be an integer ≥ {least}, got {n!r}. "
                "Hint: sinusoidal(length=L, dim=E) gives the table to add to X (L × E)."
            )
    _check_base(base)
    xp = _namespace(xp)
    if dtype is None:
        dtype = xp.float32 if _is_torch_xp(xp) else xp.float64
    pairs = (dim + 1) // 2
    angles = _angles(np.arange(offset, offset + length, dtype=np.float64), 2 * pairs, base)
    table = np.stack((np.sin(angles), np.cos(angles)), axis=-1).reshape(length, 2 * pairs)
    return xp.asarray(np.ascontiguousarray(table[:, :dim]), dtype=dtype, device=device)


# -- RoPE ------------------------------------------------------------------------------------


def rope_angles(positions: Sequence[int] | Array, head_dim: int, base: float = 10000.0) -> Array:
    """The rotation angles ``p · θ_i`` with ``θ_i = base^(−2i/D)``, in float64 NumPy.

    Args:
        positions: integer positions, any shape (P...).
        head_dim: D, even.
        base: the frequency base (10000 in the paper; Llama 3 uses 500000).

    Returns:
        (P..., D/2): the angle of each position for each pair of features.

    Example:
        >>> rope_angles([0, 1, 2], 4)
        array([[0.  , 0.  ],
               [1.  , 0.01],
               [2.  , 0.02]])
    """
    _check_head_dim(head_dim)
    _check_base(base)
    pos = to_numpy(positions) if library(positions) == "torch" else np.asarray(positions)
    if not (np.issubdtype(pos.dtype, np.integer) or pos.size == 0):
        raise TypeError(
            f"positions must be integers, got {pos.dtype}. "
            "Hint: positions are token indices 0, 1, 2, ..."
        )
    return _angles(pos.astype(np.float64), head_dim, base)


def apply_rope(
    x: Array,
    positions: Sequence[int] | Array | None = None,
    *,
    offset: int = 0,
    base: float = 10000.0,
    layout: RopeLayout = "half",
) -> Array:
    """Rotate each pair of features of x by the angle of its position (RoPE).

    Pair i of the token at position p turns by ``p · θ_i``, ``θ_i = base^(−2i/D)``::

        (x_a, x_b) → (x_a·cos − x_b·sin, x_b·cos + x_a·sin)

    Apply it to the queries and the keys (not the values) after splitting heads: then
    ``rope(q, m)·rope(k, n)`` depends only on q, k and m − n.

    Args:
        x: (..., L, D) with D even, e.g. queries (B, H, L, D).
        positions: the position of each of the L tokens, shape (L,) or broadcastable to
            x's leading axes and L, e.g. (B, 1, L); default ``offset, offset + 1, ...``.
        offset: the first position when ``positions`` is not given (the number of tokens
            already in a KV cache).
        base: the frequency base.
        layout: ``"half"`` pairs feature i with i + D/2 (GPT-NeoX, Llama);
            ``"interleaved"`` pairs 2i with 2i + 1 (RoFormer, GPT-J).

    Returns:
        An array like x (same library, device and dtype). The angles are computed in
        float64 and the rotation in x's dtype (float32 for half precision).

    Example:
        >>> import numpy as np
        >>> apply_rope(np.array([[1.0, 0.0], [1.0, 0.0]]), offset=0).round(4)   # 0 and 1 rad
        array([[1.    , 0.    ],
               [0.5403, 0.8415]])
    """
    x = as_array(x, "x")
    xp = namespace([("x", x)])
    if not is_floating(x):
        raise TypeError(
            f"x must have a floating-point dtype, got {dtype_name(x)}. "
            "Hint: RoPE rotates query and key vectors, e.g. x.float()."
        )
    if x.ndim < 2:
        raise ValueError(
            f"x must have at least 2 dimensions (..., L, D); got shape {shape_str(x.shape)}. "
            "Hint: one row per token, e.g. x[None, :] for a single token."
        )
    if layout not in ("half", "interleaved"):
        raise ValueError(
            f"layout must be 'half' or 'interleaved', got {layout!r}. Hint: 'half' pairs "
            "feature i with i + D/2 (Llama in Hugging Face), 'interleaved' pairs 2i and 2i + 1."
        )
    length, dim = int(x.shape[-2]), int(x.shape[-1])
    given_tensor = positions is not None and library(positions) == "torch"
    if (positions is None or given_tensor) and library(x) == "torch" and compiling():
        _check_offset(offset)
        cos, sin = _torch_tables(offset, length, dim, base, x, positions)  # (P..., D/2) each
    else:
        cos, sin = _numpy_tables(positions, offset, length, dim, base, xp, x)
    out_dtype = x.dtype
    work = x if dtype_name(x) in ("float32", "float64") else xp.astype(x, xp.float32)
    if layout == "half":
        a, b = work[..., : dim // 2], work[..., dim // 2 :]  # (..., L, D/2) each
        rotated = xp.concat((a * cos - b * sin, b * cos + a * sin), axis=-1)  # (..., L, D)
    else:
        a, b = work[..., 0::2], work[..., 1::2]  # features 2i and 2i + 1: (..., L, D/2)
        pairs = xp.stack((a * cos - b * sin, b * cos + a * sin), axis=-1)  # (..., L, D/2, 2)
        rotated = xp.reshape(pairs, (*pairs.shape[:-2], dim))  # (..., L, D)
    return xp.astype(rotated, out_dtype)


def _check_offset(offset: Any) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(
            f"offset must be an integer ≥ 0, got {offset!r}. "
            "Hint: the number of tokens before the first row of x (0 without a cache)."
        )


def _numpy_tables(
    positions: Sequence[int] | Array | None,
    offset: int,
    length: int,
    dim: int,
    base: float,
    xp: Any,
    x: Array,
) -> tuple[Array, Array]:
    """cos and sin of the angles (P..., D/2), computed in NumPy float64, as x's arrays."""
    if positions is None:
        _check_offset(offset)
        positions = np.arange(offset, offset + length)
    angles = rope_angles(positions, dim, base)  # (P..., D/2)
    if angles.ndim == 0 or angles.shape[-2:-1] not in ((length,), (1,)):
        raise ValueError(
            f"positions must give one position per token (length {length} on its last axis), "
            f"got shape {shape_str(angles.shape[:-1])}. Hint: positions=range(offset, offset "
            "+ L)."
        )
    return _as_like(xp, np.cos(angles), x), _as_like(xp, np.sin(angles), x)


def _torch_tables(
    offset: int, length: int, dim: int, base: float, x: Any, given: Any = None
) -> tuple[Any, Any]:
    """cos and sin of the angles (L, D/2) of positions offset … offset + L − 1, or (P...,
    D/2) of the ``given`` positions tensor (packed sequences), computed in torch float64
    (what ``torch.compile`` traces; the same numbers as :func:`rope_angles` to float64
    rounding), as tensors of x's device and compute dtype."""
    import torch

    if given is None:
        positions = torch.arange(offset, offset + length, dtype=torch.float64)
    elif given.ndim == 0 or given.shape[-1] not in (length, 1):
        raise ValueError(
            f"positions must give one position per token (length {length} on its last axis), "
            f"got shape {tuple(given.shape)}. Hint: positions=range(offset, offset + L)."
        )
    else:
        positions = given.to(torch.float64)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (D/2,)
    angles = positions[..., None] * inv_freq.to(positions.device)  # (P..., D/2)
    dtype = x.dtype if dtype_name(x) in ("float32", "float64") else torch.float32
    return (
        angles.cos().to(device=x.device, dtype=dtype),
        angles.sin().to(device=x.device, dtype=dtype),
    )


# -- settings for qkv.nn ---------------------------------------------------------------------


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding settings for ``qkv.nn.MultiHeadAttention(positional=...)``.

    ``positional="rope"`` is ``RoPE()``; ``"rope-interleaved"`` is
    ``RoPE(layout="interleaved")``.

    Example:
        >>> RoPE(base=500000.0)
        RoPE(base=500000.0, layout='half')
    """

    base: float = 10000.0
    layout: RopeLayout = "half"

    def __post_init__(self) -> None:
        _check_base(self.base)
        if self.layout not in ("half", "interleaved"):
            raise ValueError(
                f"RoPE layout must be 'half' or 'interleaved', got {self.layout!r}. Hint: "
                "'half' pairs feature i with i + D/2, 'interleaved' pairs 2i and 2i + 1."
            )


@dataclass(frozen=True)
class ALiBi:
    """ALiBi settings for ``qkv.nn.MultiHeadAttention(positional=...)``.

    ``positional="alibi"`` is ``ALiBi()``: the standard slopes of :func:`alibi_slopes`.

    Example:
        >>> ALiBi(slopes=(0.5, 0.25)).slopes
        (0.5, 0.25)
    """

    slopes: tuple[float, ...] | None = None


POSITIONAL_NAMES = ("rope", "rope-interleaved", "alibi")


def resolve(spec: str | RoPE | ALiBi | None) -> RoPE | ALiBi | None:
    """The settings object for a ``positional=`` argument (a name or a settings object).

    Example:
        >>> resolve("rope-interleaved")
        RoPE(base=10000.0, layout='interleaved')
    """
    if spec is None or isinstance(spec, RoPE | ALiBi):
        return spec
    if spec == "rope":
        return RoPE()
    if spec == "rope-interleaved":
        return RoPE(layout="interleaved")
    if spec == "alibi":
        return ALiBi()
    raise ValueError(
        f"positional must be None, one of {', '.join(map(repr, POSITIONAL_NAMES))}, or a "
        f"qkv.positional.RoPE / ALiBi, got {spec!r}. Hint: sinusoidal positions are added to "
        "the embeddings before attention: X + qkv.positional.sinusoidal(L, E)."
    )


# -- helpers ---------------------------------------------------------------------------------


def _angles(positions: np.ndarray, dim: int, base: float) -> np.ndarray:
    """positions (P...) float64 → angles (P..., dim/2): p · base^(−2i/dim)."""
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (dim/2,)
    return positions[..., None] * inv_freq


def _as_like(xp: Any, table: np.ndarray, x: Array) -> Array:
    """A NumPy float64 table as an array of x's library, device and compute dtype."""
    dtype = x.dtype if dtype_name(x) in ("float32", "float64") else xp.float32
    if library(x) == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(table)).to(device=x.device, dtype=dtype)
    return xp.asarray(table, dtype=dtype, device=array_device(x))


def _namespace(xp: Any) -> Any:
    """The array API namespace for ``xp``: NumPy by default; ``torch`` itself is accepted."""
    if xp is None:
        return xp_numpy
    name = getattr(xp, "__name__", "")
    if name == "torch":
        import array_api_compat.torch as xp_torch

        return xp_torch
    if name == "numpy":
        return xp_numpy
    return xp


def _is_torch_xp(xp: Any) -> bool:
    return "torch" in getattr(xp, "__name__", "")


def _check_head_dim(head_dim: Any) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(
            f"RoPE needs an even head dim D ≥ 2 (it rotates pairs of features), got "
            f"{head_dim!r}. Hint: choose head_dim (or embed_dim / num_heads) even."
        )


def _check_base(base: Any) -> None:
    if isinstance(base, bool) or not isinstance(base, int | float) or not base > 1:
        raise ValueError(
            f"base must be a number > 1, got {base!r}. Hint: 10000.0 as in the papers."
        )
