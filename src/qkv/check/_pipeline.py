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

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from qkv.attention import softmax
from qkv.attention._guards import check_overflow
from qkv.examples import Example, run
from qkv.examples._format2 import CLAIMABLE_2
from qkv.examples._run import allowed_keys

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
    "slot_head",
    "step_of",
]

STEPS: tuple[str, ...] = tuple(CLAIMABLE_2)
"""The claimable steps in the order of computation: Q, K, V, scores, scaled, exp, ..."""
ROW_STEPS = ("Q", "K", "V", "context", "output")
SCORE_STEPS = ("scores", "scaled", "exp", "exp_sum", "weights", "products")

Values = dict[str, np.ndarray]
"""Step name → its numbers: (L, n) for row steps, (H, Lq, n) for score steps."""
Overrides = Mapping[str, Mapping[int, np.ndarray]]
"""Slot → token position → the row that replaces the computed one. A slot is a step name
(``"weights"``: all heads side by side for a row step, head 0 for a score step) or a step and
a 0-based head, ``"weights@1"``."""

# The diagnosis codes of slips that forward() can make.
UNSCALED = "unscaled"
SCALED_BY_DK = "scaled-by-dk"
SCALED_BY_DMODEL = "scaled-by-dmodel"
TRANSPOSED = "transposed-weights"
WRONG_AXIS = "softmax-wrong-axis"
SWAPPED = "query-key-swapped"
SUM_NORMALISED = "sum-normalised"
MASK_IGNORED = "mask-ignored"
MASK_INVERTED = "mask-inverted"
MISALIGNED = "causal-misaligned"
NOT_SUMMED = "context-not-summed"
OTHER_WEIGHTS = "other-weights"
HEADS_AVERAGED = "heads-averaged"
WRONG_QUERY = "wrong-query"


def step_of(slot: str) -> str:
    """``"weights@1"`` → ``"weights"``."""
    return slot.split("@")[0]


def slot_head(slot: str) -> int | None:
    """``"weights@1"`` → 1; ``"weights"`` → None."""
    return int(slot.split("@")[1]) if "@" in slot else None


@dataclass(frozen=True)
class Slip:
    """One common mistake, with what it needs to be reproduced.

    Attributes:
        code: the diagnosis code (``"unscaled"``, ``"wrong-query"``, ...).
        weights: ``transposed-weights``: the matrices used transposed (``("W_q",)``).
        row: ``wrong-query``, ``context-not-summed`` and ``other-weights``: the token whose
            row has the mistake.
        query: ``wrong-query``: the token whose query vector was used instead;
            ``context-not-summed``: the query whose weight multiplies the value vector.
        key: ``context-not-summed``: the token whose value vector is multiplied.
        other: ``other-weights``: the weights the context was computed from.
    """

    code: str
    weights: tuple[str, ...] = ()
    row: int = -1
    query: int = -1
    key: int = -1
    other: tuple[float, ...] = ()


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
        X: the embeddings, (L, E); (Lk, 0) for an example given by Q, K, V or scores.
        W_q, W_k: (E, H·D). W_v: (E, H·Dv). W_o: (H·Dv, Eo) or None.
        heads: H. factor: what the scores are multiplied by (1/√D by default). causal: whether
            query i attends only to keys 0..i (``alignment`` says where when Lq ≠ Lk).
        given: Q (Lq, H·D), K (Lk, H·D), V (Lk, H·Dv) or scores (Lq, Lk) given directly.
        allow: the (Lq, Lk) keys allowed by key padding and an explicit mask, or None.
        alignment: ``"top-left"`` or ``"bottom-right"``.
        d_model: the width whose root ``scaled-by-dmodel`` divides by.
        version: the example's format, 1 or 2: the precision policy and every code apply to
            both, except ``not-softmax`` (:attr:`names_not_softmax`).
        precision: the inputs printed rounded: name → decimals.
    """

    X: np.ndarray
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray | None
    heads: int
    factor: float
    causal: bool
    given: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    allow: np.ndarray | None = None
    alignment: str = "top-left"
    d_model: int = 0
    version: int = 1
    precision: Mapping[str, int] = dataclasses.field(default_factory=dict)
    head_dim: int = 0

    @classmethod
    def of(cls, example: Example) -> Setup:
        """The setup of a worked example (its scale option turned into a factor)."""
        given = {k: np.asarray(v, dtype=np.float64) for k, v in example.given.items()}
        if "scores" in given:
            d_k = example.d_k or 1
        elif "Q" in given:
            d_k = given["Q"].shape[1] // example.heads
        else:
            d_k = example.W_q.shape[1] // example.heads
        if isinstance(example.scale, bool):
            factor = 1.0 / math.sqrt(d_k) if example.scale else 1.0
        else:
            factor = float(example.scale)
        d_model = example.d_model if example.inputs == "embeddings" else d_k * example.heads
        return cls(
            X=np.asarray(example.embeddings, dtype=np.float64),
            W_q=np.asarray(example.W_q, dtype=np.float64),
            W_k=np.asarray(example.W_k, dtype=np.float64),
            W_v=np.asarray(example.W_v, dtype=np.float64),
            W_o=None if example.W_o is None else np.asarray(example.W_o, dtype=np.float64),
            heads=example.heads,
            factor=factor,
            causal=example.causal,
            given=given,
            allow=allowed_keys(example),
            alignment=example.alignment,
            d_model=d_model,
            version=example.format,
            precision=dict(example.precision),
            head_dim=example.d_k or 0,
        )

    @property
    def length(self) -> int:
        """Lk, the number of keys (the tokens; also the queries when Lq = Lk)."""
        return self.lk

    @property
    def lk(self) -> int:
        """Lk, the number of keys."""
        if "scores" in self.given:
            return int(self.given["scores"].shape[1])
        return int(self.X.shape[0])

    @property
    def lq(self) -> int:
        """Lq, the number of queries."""
        if "scores" in self.given:
            return int(self.given["scores"].shape[0])
        if "Q" in self.given:
            return int(self.given["Q"].shape[0])
        return int(self.X.shape[0])

    @property
    def d_k(self) -> int:
        """D, the size of one head's query and key vectors."""
        if "scores" in self.given:
            return self.head_dim
        if "Q" in self.given:
            return int(self.given["Q"].shape[1]) // self.heads
        return int(self.W_q.shape[1]) // self.heads

    @property
    def has_values(self) -> bool:
        """Whether there are value vectors (V, context and output can be computed)."""
        return "V" in self.given or ("Q" not in self.given and "scores" not in self.given)

    @property
    def names_not_softmax(self) -> bool:
        """Whether weights out of the order of their scores are called ``not-softmax``:
        format 2 only. The rule reads one printed row, not a computation, and format 1's
        golden seed-000 report must stay as it is: its weights of "love" are out of the order
        of its printed scores, ``arithmetic`` in format 1."""
        return self.version == 2

    @property
    def masked(self) -> bool:
        """Whether any key is masked (causal rule, key padding or an explicit mask)."""
        return self.causal or self.allow is not None

    def matrix(self, name: str) -> np.ndarray | None:
        """``"W_q"`` → W_q (None for a missing W_o, or for weights not given)."""
        if self.given and name != "W_o":
            return None
        return {"W_q": self.W_q, "W_k": self.W_k, "W_v": self.W_v, "W_o": self.W_o}[name]

    def allowed(self, code: str = "") -> np.ndarray:
        """The (Lq, Lk) keys each query attends, True = may attend, as a slip makes it."""
        lq, lk = self.lq, self.lk
        allowed = np.ones((lq, lk), dtype=bool) if self.allow is None else self.allow.copy()
        if self.causal:
            alignment = self.alignment
            if code == MISALIGNED:
                alignment = "top-left" if alignment == "bottom-right" else "bottom-right"
            shift = lk - lq if alignment == "bottom-right" else 0
            allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + shift
        if code == MASK_IGNORED:
            return np.ones((lq, lk), dtype=bool)
        if code == MASK_INVERTED:
            return ~allowed
        return allowed


def _split(x: np.ndarray, heads: int) -> np.ndarray:
    length, width = x.shape
    return x.reshape(length, heads, width // heads).transpose(1, 0, 2)  # (H, L, D)


def _merge(x: np.ndarray) -> np.ndarray:
    heads, length, dim = x.shape
    return x.transpose(1, 0, 2).reshape(length, heads * dim)  # (L, H·D)


def _put(x: np.ndarray, step: str, ov: Overrides, heads: int) -> np.ndarray:
    """Put the claimed rows of ``step`` (all heads, then each head) into its values."""
    slots = [k for k in ov if step_of(k) == step and ov[k]]
    if not slots:
        return x
    x = x.copy()
    for slot in sorted(slots, key=lambda k: (slot_head(k) is not None, k)):
        for t, values in ov[slot].items():
            x[index_of(x.shape, step, slot_head(slot), t, heads)] = values
    return x


def index_of(
    shape: tuple[int, ...], step: str, head: int | None, t: int, heads: int
) -> tuple[int | slice, ...]:
    """Where the row of token ``t`` (of one head, or None) is in a step's values of ``shape``.

    Row steps (L, H·n) hold all heads side by side: a head's row is its block of columns.
    Score steps (H, Lq, n) hold one row per head: None means head 0.
    """
    if step in ROW_STEPS:
        if head is None:
            return (t,)
        width = shape[-1] // heads
        return (t, slice(head * width, (head + 1) * width))
    return (0 if head is None else head, t)


def forward(setup: Setup, slip: Slip | None = None, overrides: Overrides | None = None) -> Values:
    """Every claimable step, with claimed rows put in and an optional slip.

    Args:
        setup: the example's inputs and options.
        slip: a mistake to make on purpose, or None for the correct computation.
        overrides: rows that replace the computed ones (slot → token → row); each later step
            is computed from them.

    Returns:
        step name → values: row steps (L, n), score steps (H, Lq, n); ``exp_sum`` is
        (H, Lq, 1) and ``products`` (H, Lq, Lk·Dv), the terms w_j·v_j key after key.

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
    heads = setup.heads
    given = setup.given

    def weight(name: str) -> np.ndarray:
        w = {"W_q": setup.W_q, "W_k": setup.W_k, "W_v": setup.W_v, "W_o": setup.W_o}[name]
        assert w is not None
        used: np.ndarray = w.T if name in flipped else w
        return used

    def projected(name: str, w: str, rows: int) -> np.ndarray:
        if name in given:
            return given[name].copy()
        if "scores" in given or (name == "V" and "Q" in given):
            return np.zeros((rows, 0))
        made: np.ndarray = setup.X @ weight(w)
        return made

    q = projected("Q", "W_q", setup.lq)  # (Lq, H·D)
    k = projected("K", "W_k", setup.lk)  # (Lk, H·D)
    v = projected("V", "W_v", setup.lk)  # (Lk, H·Dv)
    q = _put(q, "Q", ov, heads)
    if code == WRONG_QUERY and slip is not None:
        q = q.copy()
        q[slip.row] = q[slip.query]
    k, v = _put(k, "K", ov, heads), _put(v, "V", ov, heads)
    qh, kh, vh = (_split(x, heads) for x in (q, k, v))  # (H, Lq, D), (H, Lk, D), (H, Lk, Dv)

    # (H, Lq, Lk): q_i·k_j, or the scores given
    scores = given["scores"][None].copy() if "scores" in given else qh @ kh.transpose(0, 2, 1)
    if code == SWAPPED and scores.shape[1] == scores.shape[2]:
        scores = scores.transpose(0, 2, 1)  # K·Qᵀ: row i holds k_i·q_j
    scores = _put(scores, "scores", ov, heads)
    factor = {
        UNSCALED: 1.0,
        SCALED_BY_DK: 1.0 / max(setup.d_k, 1),
        SCALED_BY_DMODEL: 1.0 / math.sqrt(max(setup.d_model, 1)),
    }.get(code, setup.factor)
    scaled = _put(scores * factor, "scaled", ov, heads)
    allowed = setup.allowed(code) if setup.masked else None
    masked = scaled if allowed is None else np.where(allowed, scaled, -np.inf)
    with np.errstate(over="ignore", invalid="ignore"):
        exp = np.where(np.isneginf(masked), 0.0, np.exp(masked))
    exp = _put(exp, "exp", ov, heads)
    exp_sum = _put(exp.sum(axis=-1, keepdims=True), "exp_sum", ov, heads)
    if code == SUM_NORMALISED:
        kept = scaled if allowed is None else np.where(allowed, scaled, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            weights = np.nan_to_num(kept / kept.sum(axis=-1, keepdims=True))
    else:
        weights = softmax(masked, axis=-2 if code == WRONG_AXIS else -1)  # (H, Lq, Lk)
    rows = {t for slot in ov if step_of(slot) in ("exp", "exp_sum") for t in ov[slot]}
    for t in rows:  # weights from the printed exponentials: e / Σe
        with np.errstate(divide="ignore", invalid="ignore"):
            weights[:, t] = np.nan_to_num(exp[:, t] / exp_sum[:, t])
    if code == OTHER_WEIGHTS and slip is not None:
        weights = weights.copy()
        weights[:, slip.row] = np.asarray(slip.other)
    weights = _put(weights, "weights", ov, heads)

    terms = weights[..., None] * vh[:, None, :, :]  # (H, Lq, Lk, Dv): w_j·v_j
    products = _put(terms.reshape(*weights.shape[:2], -1), "products", ov, heads)
    terms = products.reshape(terms.shape)
    context = _merge(terms.sum(axis=2))  # (Lq, H·Dv)
    if code == HEADS_AVERAGED:
        context = weights.mean(axis=0) @ v  # one weighting for all of V
    if code == NOT_SUMMED and slip is not None:
        context = context.copy()
        term = weights[:, slip.query, slip.key, None] * vh[:, slip.key, :]  # (H, Dv)
        context[slip.row] = term.reshape(-1)
    context = _put(context, "context", ov, heads)
    output = context @ weight("W_o") if setup.W_o is not None else context.copy()
    output = _put(output, "output", ov, heads)
    return {
        "Q": q,
        "K": k,
        "V": v,
        "scores": scores,
        "scaled": scaled,
        "exp": exp,
        "exp_sum": exp_sum,
        "weights": weights,
        "products": products,
        "context": context,
        "output": output,
    }


def correct_values(example: Example) -> Values:
    """The correct numbers of every claimable step: the reference core (the oracle) where the
    example has embeddings and weights, :func:`forward` in float64 for the rest; rows a text
    assumes (``assumed:``) are put in first.

    Example:
        >>> from qkv.examples import builtin
        >>> correct_values(builtin("i-love-statistics"))["weights"][0, 1].round(4)
        array([0.3046, 0.3387, 0.3567])
    """
    setup = Setup.of(example)
    assumed = {
        step: {t: np.asarray(c.values) for t, c in rows.items()}
        for step, rows in example.assumed.items()
    }
    values = forward(setup, None, assumed)
    if {"Q", "K"} <= set(setup.given):  # the reference's own refusal (run() says it for X)
        check_overflow(
            np,
            values["scaled"],
            setup.allowed(),
            "the scaled scores Q·Kᵀ × scale",
            (("query", setup.given["Q"]), ("key", setup.given["K"])),
            setup.factor,
        )
    if example.inputs != "embeddings" or assumed:
        return values
    trace = run(example)

    def heads_first(name: str) -> np.ndarray:
        value = np.asarray(trace[name].value, dtype=np.float64)
        return value[None] if value.ndim == 2 else value  # (H, ...)

    for name in ("Q", "K", "V", "context"):
        values[name] = _merge(heads_first(name))  # (L, H·n)
    for name in ("scores", "scaled", "weights"):
        values[name] = heads_first(name)  # (H, L, L)
    values["output"] = (
        np.asarray(trace["output"].value, dtype=np.float64)
        if "output" in trace
        else values["context"].copy()
    )
    return values


def row_of(values: Values, step: str, t: int) -> np.ndarray:
    """The row of token ``t`` in a slot (``"weights"``: head 0; ``"weights@1"``: head 1)."""
    name = step_of(step)
    value = values[name]
    heads = int(values["scores"].shape[0])
    row: np.ndarray = value[index_of(value.shape, name, slot_head(step), t, heads)]
    return row
