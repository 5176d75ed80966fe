"""One decoding step with a key/value cache, on a worked example (``qkv explain --decode``).

A model that writes one token at a time keeps the keys and values of the tokens it has
already seen (the KV cache). At step p the new token's query q_p attends every cached key:
the cache holds k_0 … k_{p−1} and v_0 … v_{p−1}, the step appends k_p and v_p, and
``softmax(q_p·Kᵀ·scale)·V`` gives the context vector c_p. That is the last row of the full
causal pass over tokens 0 … p, computed without the other rows.

Shapes: L tokens, H heads, D = d_k per head, Dv per head; ``keys`` (H, p+1, D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qkv.attention import scaled_dot_product_attention
from qkv.examples._model import Example
from qkv.examples._run import _query

__all__ = ["DecodeStep", "decode_step"]


@dataclass(frozen=True)
class DecodeStep:
    """The numbers of one decoding step, each head apart (float64).

    Attributes:
        name: the example's title.
        tokens: the tokens 0 … p (the cache's and the new one, last).
        heads: H.
        scale: the factor of the scores (1/√d_k unless the example or ``--no-scale`` says).
        query: (H, D), q_p = x_p·W_q of the new token.
        keys, values: (H, p+1, D) and (H, p+1, Dv): the cache's rows, then the new token's.
        scores: (H, p+1), q_p·k_j for each cached key j.
        weights: (H, p+1), softmax of the scaled scores: the decoding step's weights.
        context: (H, Dv), c_p = Σ_j weight_j·v_j.
        full_weights: (H, p+1), the last row of the full causal pass's weights.
        full_context: (H, Dv), the last row of the full causal pass's context vectors.
    """

    name: str
    tokens: tuple[str, ...]
    heads: int
    scale: float
    query: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    scores: np.ndarray
    weights: np.ndarray
    context: np.ndarray
    full_weights: np.ndarray
    full_context: np.ndarray

    @property
    def position(self) -> int:
        """p, the 0-based position of the new token."""
        return len(self.tokens) - 1

    @property
    def d_k(self) -> int:
        return int(self.query.shape[-1])

    @property
    def weights_difference(self) -> float:
        """max |decoding step − last row of the full pass| over the weights."""
        return float(np.max(np.abs(self.weights - self.full_weights)))

    @property
    def context_difference(self) -> float:
        """max |decoding step − last row of the full pass| over the context vectors."""
        return float(np.max(np.abs(self.context - self.full_context)))


def decode_step(
    example: Example,
    *,
    query: str | int | None = None,
    scale: bool | float | None = None,
    heads: int | None = None,
) -> DecodeStep:
    """Decode the example's token at ``query`` with the tokens before it in a KV cache.

    Args:
        example: the worked example.
        query: the new token: its text or 0-based position (default: the last token).
        scale: True divides the scores by √d_k, False does not scale, a number multiplies
            them. Default: the example's.
        heads: the number of heads (default: the example's); it must divide d_k.

    Returns:
        The step's numbers and those of the full causal pass's last row, to compare.

    Raises:
        ValueError: an unknown or out-of-range ``query``, ``heads`` that does not divide
            the columns of W_q, W_k and W_v, or a ``scale`` that is not positive; an
            example that gives Q, K and V (or scores) instead of embeddings and weights.

    Example:
        >>> from qkv.examples import builtin
        >>> step = decode_step(builtin("i-love-statistics"))
        >>> step.tokens, step.weights.shape
        (('I', 'love', 'statistics'), (1, 3))
        >>> step.context_difference < 1e-15
        True
    """
    if example.inputs != "embeddings":  # its q, k and v are x·W of each token
        raise ValueError(
            "a decoding step computes each token's q, k and v from its embedding and the "
            "weights; this example gives its vectors directly. Hint: qkv explain --example "
            "FILE shows its steps; decode a built-in, e.g. qkv explain --decode"
        )
    position = len(example.tokens) - 1 if query is None else _query(example, query)
    count = example.heads if heads is None else heads
    width_k, width_v = int(example.W_k.shape[1]), int(example.W_v.shape[1])
    if count < 1 or width_k % count or width_v % count:
        raise ValueError(
            f"heads: {count} heads must divide d_k = {width_k} and d_v = {width_v}. Hint: "
            f"choose a divisor of {math.gcd(width_k, width_v)}."
        )
    setting = example.scale if scale is None else scale
    d_k = width_k // count
    if setting is True:
        factor = 1.0 / math.sqrt(d_k)
    elif setting is False:
        factor = 1.0
    elif isinstance(setting, int | float) and setting > 0:
        factor = float(setting)
    else:
        raise ValueError(f"scale: expected True, False or a positive number, got {setting!r}.")
    x = np.asarray(example.embeddings[: position + 1], dtype=np.float64)  # (p+1, E)
    q, k, v = (_split(x @ np.asarray(w, dtype=np.float64), count) for w in _weights(example))
    new_query = q[:, -1:]  # (H, 1, D): only the new token's query is needed
    context, weights = scaled_dot_product_attention(
        new_query,
        k,
        v,
        is_causal=True,
        causal_alignment="bottom-right",
        scale=factor,
        return_weights=True,
        backend="reference",
    )
    full_context, full_weights = scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=factor, return_weights=True, backend="reference"
    )
    return DecodeStep(
        name=example.name,
        tokens=tuple(example.tokens[: position + 1]),
        heads=count,
        scale=factor,
        query=new_query[:, 0],
        keys=k,
        values=v,
        scores=(new_query @ np.swapaxes(k, -1, -2))[:, 0],
        weights=np.asarray(weights)[:, 0],
        context=np.asarray(context)[:, 0],
        full_weights=np.asarray(full_weights)[:, -1],
        full_context=np.asarray(full_context)[:, -1],
    )


def _weights(example: Example) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return example.W_q, example.W_k, example.W_v


def _split(x: np.ndarray, heads: int) -> np.ndarray:
    """(L, H·D) → (H, L, D)."""
    length, width = x.shape
    return np.ascontiguousarray(x.reshape(length, heads, width // heads).transpose(1, 0, 2))
