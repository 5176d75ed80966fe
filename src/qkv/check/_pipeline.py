"""The steps of a worked example, recomputed with claimed rows put in and, optionally, one slip.

The correct numbers come from the reference core (``qkv.examples.run``, the oracle). The checker
also needs two other computations of the same steps, which the core does not offer:

- **from the claimed inputs**: the rows an author printed replace the computed ones, and the
  later steps are computed from them ("what would this step be, given what was printed before
  it?"), which tells a consequential error from a new one;
- **with a slip**: one of the common mistakes (no scaling, softmax over the wrong axis, ...),
  to see whether it reproduces the printed numbers.

:func:`forward` does both. Without a slip or claimed rows it equals the reference core (a test
checks this on every built-in example).

Shapes: L tokens, E = d_model, H heads, D = d_k per head, Dv = d_v per head, Eo output columns.
Row steps (``Q``, ``K``, ``V``, ``context``, ``output``) are (L, H·D), (L, H·D), (L, H·Dv),
(L, H·Dv), (L, Eo), all heads side by side; score steps (``scores``, ``scaled``, ``weights``)
are (H, L, L).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from qkv.attention import softmax
from qkv.examples import CLAIMABLE, Example, run

__all__ = [
    "ROW_STEPS",
    "SCORE_STEPS",
    "STEPS",
    "Candidate",
    "Overrides",
    "Setup",
    "Slip",
    "Values",
    "correct_values",
    "forward",
    "row_of",
]

STEPS: tuple[str, ...] = tuple(CLAIMABLE)
"""The claimable steps in the order of computation: Q, K, V, scores, scaled, weights, ..."""
ROW_STEPS = ("Q", "K", "V", "context", "output")
SCORE_STEPS = ("scores", "scaled", "weights")

Values = dict[str, np.ndarray]
"""Step name → its numbers: (L, n) for row steps, (H, L, L) for score steps."""
Overrides = Mapping[str, Mapping[int, np.ndarray]]
"""Step name → token position → the row that replaces the computed one."""

# The diagnosis codes of slips that forward() can make.
UNSCALED = "unscaled"
SCALED_BY_DK = "scaled-by-dk"
TRANSPOSED = "transposed-weights"
WRONG_AXIS = "softmax-wrong-axis"
SWAPPED = "query-key-swapped"
NOT_SUMMED = "context-not-summed"
WRONG_QUERY = "wrong-query"


@dataclass(frozen=True)
class Slip:
    """One common mistake, with what it needs to be reproduced.

    Attributes:
        code: the diagnosis code (``"unscaled"``, ``"wrong-query"``, ...).
        weights: ``transposed-weights``: the matrices used transposed (``("W_q",)``).
        row: ``wrong-query`` and ``context-not-summed``: the token whose row has the mistake.
        query: ``wrong-query``: the token whose query vector was used instead;
            ``context-not-summed``: the query whose weight multiplies the value vector.
        key: ``context-not-summed``: the token whose value vector is multiplied.
    """

    code: str
    weights: tuple[str, ...] = ()
    row: int = -1
    query: int = -1
    key: int = -1


@dataclass(frozen=True)
class Candidate:
    """A slip that reproduces a row: what the diagnosis finds and the messages explain.

    Attributes:
        slip: the slip.
        start: ``"claimed"`` (made on the numbers printed before) or ``"exact"``.
        value: the row the slip gives.
        values: every step of that computation (for the message).
    """

    slip: Slip
    start: str
    value: np.ndarray
    values: Values


@dataclass(frozen=True)
class Setup:
    """What every computation of an example needs, as float64 arrays.

    Attributes:
        X: the embeddings, (L, E). W_q, W_k: (E, H·D). W_v: (E, H·Dv). W_o: (H·Dv, Eo) or None.
        heads: H. factor: what the scores are multiplied by (1/√D by default). causal: whether
            token i attends only to tokens 0..i.
    """

    X: np.ndarray
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray | None
    heads: int
    factor: float
    causal: bool

    @classmethod
    def of(cls, example: Example) -> Setup:
        """The setup of a worked example (its scale option turned into a factor)."""
        d_k = example.W_q.shape[1] // example.heads
        if isinstance(example.scale, bool):
            factor = 1.0 / math.sqrt(d_k) if example.scale else 1.0
        else:
            factor = float(example.scale)
        return cls(
            X=np.asarray(example.embeddings, dtype=np.float64),
            W_q=np.asarray(example.W_q, dtype=np.float64),
            W_k=np.asarray(example.W_k, dtype=np.float64),
            W_v=np.asarray(example.W_v, dtype=np.float64),
            W_o=None if example.W_o is None else np.asarray(example.W_o, dtype=np.float64),
            heads=example.heads,
            factor=factor,
            causal=example.causal,
        )

    @property
    def length(self) -> int:
        """L, the number of tokens."""
        return int(self.X.shape[0])

    @property
    def d_k(self) -> int:
        """D, the size of one head's query and key vectors."""
        return int(self.W_q.shape[1]) // self.heads

    def matrix(self, name: str) -> np.ndarray | None:
        """``"W_q"`` → W_q (None for a missing W_o)."""
        return {"W_q": self.W_q, "W_k": self.W_k, "W_v": self.W_v, "W_o": self.W_o}[name]


def _split(x: np.ndarray, heads: int) -> np.ndarray:
    length, width = x.shape
    return x.reshape(length, heads, width // heads).transpose(1, 0, 2)  # (H, L, D)


def _merge(x: np.ndarray) -> np.ndarray:
    heads, length, dim = x.shape
    return x.transpose(1, 0, 2).reshape(length, heads * dim)  # (L, H·D)


def _put_rows(x: np.ndarray, rows: Mapping[int, np.ndarray] | None) -> np.ndarray:
    if not rows:
        return x
    x = x.copy()
    for t, values in rows.items():
        x[t] = values
    return x


def _put_scores(x: np.ndarray, rows: Mapping[int, np.ndarray] | None) -> np.ndarray:
    """Claimed score rows are single-head rows: they replace the rows of head 0."""
    if not rows:
        return x
    x = x.copy()
    for t, values in rows.items():
        x[0, t] = values
    return x


def forward(setup: Setup, slip: Slip | None = None, overrides: Overrides | None = None) -> Values:
    """Every claimable step, with claimed rows put in and an optional slip.

    Args:
        setup: the example's inputs and options.
        slip: a mistake to make on purpose, or None for the correct computation.
        overrides: rows that replace the computed ones (step → token → row); each later step
            is computed from them.

    Returns:
        step name → values: row steps (L, n), score steps (H, L, L).

    Example:
        >>> from qkv.examples import builtin
        >>> setup = Setup.of(builtin("i-love-statistics"))
        >>> forward(setup)["context"][1].round(4)
        array([0.5385, 0.8193])
        >>> forward(setup, Slip("unscaled"))["weights"][0, 1].round(4)
        array([0.2931, 0.3405, 0.3663])
        >>> forward(setup, overrides={"Q": {1: np.array([0.59, 0.78])}})["scores"][0, 1]
        array([1.166 , 1.3266, 1.3947])
    """
    ov: Overrides = overrides or {}
    code = slip.code if slip is not None else ""
    flipped = slip.weights if code == TRANSPOSED and slip is not None else ()

    def weight(name: str) -> np.ndarray:
        w = setup.matrix(name)
        assert w is not None
        return w.T if name in flipped else w

    q = _put_rows(setup.X @ weight("W_q"), ov.get("Q"))  # (L, H·D)
    if code == WRONG_QUERY and slip is not None:
        q = q.copy()
        q[slip.row] = q[slip.query]
    k = _put_rows(setup.X @ weight("W_k"), ov.get("K"))  # (L, H·D)
    v = _put_rows(setup.X @ weight("W_v"), ov.get("V"))  # (L, H·Dv)
    qh, kh, vh = (_split(x, setup.heads) for x in (q, k, v))  # (H, L, D), (H, L, D), (H, L, Dv)

    scores = qh @ kh.transpose(0, 2, 1)  # (H, L, L): q_i·k_j
    if code == SWAPPED:
        scores = scores.transpose(0, 2, 1)  # K·Qᵀ: row i holds k_i·q_j
    scores = _put_scores(scores, ov.get("scores"))
    factor = {UNSCALED: 1.0, SCALED_BY_DK: 1.0 / setup.d_k}.get(code, setup.factor)
    scaled = _put_scores(scores * factor, ov.get("scaled"))
    masked = scaled
    if setup.causal:
        allowed = np.tril(np.ones((setup.length, setup.length), dtype=bool))  # key j ≤ query i
        masked = np.where(allowed, scaled, -np.inf)
    weights = softmax(masked, axis=-2 if code == WRONG_AXIS else -1)  # (H, L, L)
    weights = _put_scores(weights, ov.get("weights"))

    context = _merge(weights @ vh)  # (L, H·Dv)
    if code == NOT_SUMMED and slip is not None:
        context = context.copy()
        term = weights[:, slip.query, slip.key, None] * vh[:, slip.key, :]  # (H, Dv)
        context[slip.row] = term.reshape(-1)
    context = _put_rows(context, ov.get("context"))
    output = context @ weight("W_o") if setup.W_o is not None else context.copy()
    output = _put_rows(output, ov.get("output"))
    return {
        "Q": q,
        "K": k,
        "V": v,
        "scores": scores,
        "scaled": scaled,
        "weights": weights,
        "context": context,
        "output": output,
    }


def correct_values(example: Example) -> Values:
    """The correct numbers of every claimable step, from the reference core (the oracle).

    Example:
        >>> from qkv.examples import builtin
        >>> correct_values(builtin("i-love-statistics"))["weights"][0, 1].round(4)
        array([0.3046, 0.3387, 0.3567])
    """
    trace = run(example)

    def heads_first(name: str) -> np.ndarray:
        value = np.asarray(trace[name].value, dtype=np.float64)
        return value[None] if value.ndim == 2 else value  # (H, ...)

    values: Values = {}
    for name in ("Q", "K", "V", "context"):
        values[name] = _merge(heads_first(name))  # (L, H·n)
    for name in SCORE_STEPS:
        values[name] = heads_first(name)  # (H, L, L)
    values["output"] = (
        np.asarray(trace["output"].value, dtype=np.float64)
        if "output" in trace
        else values["context"].copy()
    )
    return values


def row_of(values: Values, step: str, t: int) -> np.ndarray:
    """The row of token ``t`` in a step (head 0 of a score step: claimed rows are single-head)."""
    row: np.ndarray = values[step][t] if step in ROW_STEPS else values[step][0, t]
    return row
