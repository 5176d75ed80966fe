"""The one vocabulary of attention's steps: names, titles, formulas, meanings and nouns.

Every part of qkv that names a step takes its words from here: the reference records each
step with its formula and description, renderers title and explain it, ``qkv check`` calls a
row of it by its noun. The words are the seeds' (embeddings, query/key/value vectors,
attention scores, scaling, softmax, attention weights, context vectors as weighted sums of
value vectors).

Step names are a public interface (the trace, renderers and the JSON files use them), listed
in :data:`STEP_NAMES` in the order of computation.

Example:
    >>> WORDS["weights"].title
    'Attention weights'
    >>> WORDS["scores"].formula
    'S = Q·Kᵀ'
    >>> WORDS["context"].noun(2)
    'context vectors'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "LAYER_INPUT",
    "STEP_NAMES",
    "TILED_STEP_NAMES",
    "TILED_WORDS",
    "WORDS",
    "StepWords",
    "meaning",
    "projection_formula",
]


@dataclass(frozen=True)
class StepWords:
    """What a learner reads about one step.

    Attributes:
        name: the step's name, e.g. ``"weights"``.
        title: its heading, e.g. ``"Attention weights"``.
        formula: the formula in plain text, e.g. ``"A = softmax(S') row by row"``.
        latex: the formula in LaTeX (math mode, without delimiters). For Q, K and V it is
            the bare letter: how they were made (``Q = X·W_q``, ``Q = RoPE(X·W_q + b_q)``)
            is what each call records as the step's formula (see
            :func:`projection_formula`), never assumed.
        description: one line on what it means, as a trace records it:
            ``"attention weights: each row ..."``.
        singular: how one row of it is called (``"context vector"``).
        plural: how several rows are called (``"context vectors"``).
        short: the plural in a sentence that already names the step (``"weights"`` for
            ``"attention weights"``); empty when it is the plural itself.
    """

    name: str
    title: str
    formula: str
    latex: str
    description: str
    singular: str
    plural: str
    short: str = ""

    def noun(self, count: int = 1) -> str:
        """The noun for ``count`` rows of this step."""
        return self.singular if count == 1 else self.plural

    @property
    def countable(self) -> bool:
        """Whether one row has a singular noun of its own (a query vector; not "attention
        scores", which stays plural for one row)."""
        return self.singular != self.plural


_WORDS = (
    StepWords(
        "embeddings",
        "Token embeddings",
        "X",
        "X",
        "word embeddings: one row per token (d_model numbers each)",
        "embedding",
        "embeddings",
    ),
    StepWords(
        "W_q",
        "Query weight matrix W_q",
        "W_q",
        "W_q",
        "learned query projection (d_model × d_k): Q = X·W_q",
        "row of W_q",
        "rows of W_q",
    ),
    StepWords(
        "W_k",
        "Key weight matrix W_k",
        "W_k",
        "W_k",
        "learned key projection (d_model × d_k): K = X·W_k",
        "row of W_k",
        "rows of W_k",
    ),
    StepWords(
        "W_v",
        "Value weight matrix W_v",
        "W_v",
        "W_v",
        "learned value projection (d_model × d_v): V = X·W_v",
        "row of W_v",
        "rows of W_v",
    ),
    StepWords(
        "Q",
        "Query vectors",
        "Q",
        "Q",
        "query vectors: what each word is looking for",
        "query vector",
        "query vectors",
    ),
    StepWords(
        "K",
        "Key vectors",
        "K",
        "K",
        "key vectors: what each word offers to be matched against a query",
        "key vector",
        "key vectors",
    ),
    StepWords(
        "V",
        "Value vectors",
        "V",
        "V",
        "value vectors: the information each word passes on",
        "value vector",
        "value vectors",
    ),
    StepWords(
        "scores",
        "Attention scores",
        "S = Q·Kᵀ",
        r"S = Q K^{\top}",
        "attention scores: the dot product of each query vector with every key vector",
        "attention scores",
        "attention scores",
        "scores",
    ),
    StepWords(
        "scaled",
        "Scaled attention scores",
        "S' = S × scale",
        r"S' = S \cdot \mathrm{scale}",
        "scaled scores: divided by √d_k so softmax is not too sharp",
        "scaled scores",
        "scaled scores",
    ),
    StepWords(
        "bias",
        "Scaled scores plus bias",
        "S' = S' + bias",
        r"S' = S' + B",
        "scaled scores plus the additive bias",
        "biased scores",
        "biased scores",
    ),
    StepWords(
        "masked",
        "Masked attention scores",
        "S' = S' where allowed, −∞ elsewhere",
        r"S'_{ij} = -\infty \text{ where query } i \text{ may not attend to key } j",
        "masked scores: keys a query may not attend get −∞, so weight 0",
        "masked scores",
        "masked scores",
    ),
    StepWords(
        "weights",
        "Attention weights",
        "A = softmax(S') row by row",
        r"A = \operatorname{softmax}(S') \text{ row by row}",
        "attention weights: each row is a probability distribution over the keys (sums to 1)",
        "attention weights",
        "attention weights",
        "weights",
    ),
    StepWords(
        "dropout",
        "Attention weights after dropout",
        "A = A · keep / (1 − p)",
        r"A = A \cdot \mathrm{keep} / (1 - p)",
        "attention weights after dropout: dropped weights are 0, the others divided by 1 − p",
        "weights after dropout",
        "weights after dropout",
    ),
    StepWords(
        "context",
        "Context vectors",
        "C = A·V",
        "C = A V",
        "context vectors: for each query, the weighted sum of value vectors",
        "context vector",
        "context vectors",
    ),
    StepWords(
        "concat",
        "Concatenated context vectors",
        "concat(C_0, …, C_{h−1})",
        r"\operatorname{concat}(C_0, \ldots, C_{h-1})",
        "the context vectors of all heads, side by side",
        "concatenated context vector",
        "concatenated context vectors",
    ),
    StepWords(
        "W_o",
        "Output weight matrix W_o",
        "W_o",
        "W_o",
        "learned output projection (h·d_v × d_out)",
        "row of W_o",
        "rows of W_o",
    ),
    StepWords(
        "output",
        "Output",
        "O = concat·W_o",
        r"O = \operatorname{concat} \cdot W_o",
        "the output of multi-head attention, one row per token",
        "output",
        "outputs",
    ),
)

WORDS: Mapping[str, StepWords] = MappingProxyType({w.name: w for w in _WORDS})
"""Each step's words, by step name."""

LAYER_INPUT = StepWords(
    "embeddings",
    "Input of the layer",
    "X",
    "X",
    "layer input: the rows this layer reads, one per token (d_model numbers each); in a "
    "model, what the layers before it (and a norm) made of the token embeddings",
    "input row",
    "input rows",
)
"""The words of the ``embeddings`` step recorded by a layer of a model: an inner layer reads
what the layers before it wrote, and a block's own norm comes before its attention, so the
rows are not the token embeddings themselves."""

STEP_NAMES: tuple[str, ...] = tuple(WORDS)
"""The step names, in the order of computation."""


_TILED_WORDS = (
    StepWords(
        "tile_max",
        "Row maximum of the tile",
        "m̃ = rowmax(S'_tile)",
        r"\tilde m = \operatorname{rowmax}(S'_{ij})",
        "tile maximum: each query row's largest scaled score among the tile's keys",
        "tile maximum",
        "tile maxima",
    ),
    StepWords(
        "running_max",
        "Running maximum",
        "m_new = max(m_old, m̃)",
        r"m^{\text{new}} = \max(m^{\text{old}}, \tilde m)",
        "running maximum: the largest scaled score of the row among the keys seen so far",
        "running maximum",
        "running maxima",
    ),
    StepWords(
        "rescale",
        "Rescale factor",
        "α = exp(m_old − m_new)",
        r"\alpha = e^{m^{\text{old}} - m^{\text{new}}}",
        "rescale factor: how much the terms summed so far shrink when the maximum grows",
        "rescale factor",
        "rescale factors",
    ),
    StepWords(
        "running_sum",
        "Running sum",
        "l_new = α·l_old + rowsum(exp(S'_tile − m_new))",
        r"\ell^{\text{new}} = \alpha\,\ell^{\text{old}} + "
        r"\operatorname{rowsum}(e^{S'_{ij} - m^{\text{new}}})",
        "running sum: the softmax's denominator over the keys seen so far, relative to m",
        "running sum",
        "running sums",
    ),
    StepWords(
        "accumulator",
        "Accumulator",
        "O_new = α·O_old + exp(S'_tile − m_new)·V_tile",
        r"O^{\text{new}} = \alpha\,O^{\text{old}} + e^{S'_{ij} - m^{\text{new}}} V_j",
        "accumulator: the weighted sum of value vectors so far, not yet divided by l",
        "accumulator row",
        "accumulator rows",
    ),
    StepWords(
        "output",
        "Output of the tiled pass",
        "O = O_acc / l",
        r"O = O^{\text{acc}} / \ell",
        "output: the accumulator divided by the running sum, the context vectors",
        "output row",
        "output rows",
    ),
    StepWords(
        "lse",
        "Log-sum-exp",
        "L = m + log l",
        r"L = m + \log \ell",
        "log-sum-exp: log of the softmax's denominator (natural log), kept for the backward",
        "log-sum-exp",
        "log-sum-exps",
    ),
)

TILED_WORDS: Mapping[str, StepWords] = MappingProxyType({w.name: w for w in _TILED_WORDS})
"""The words of the tiled (FlashAttention) algorithm's steps, by step name: ``qkv explain
--tiled`` and tiled worked examples. A namespace of their own: ``output`` here is O / l of
the tiled pass, not the multi-head output O = concat·W_o of :data:`WORDS`.

Example:
    >>> TILED_WORDS["rescale"].formula
    'α = exp(m_old − m_new)'
"""

TILED_STEP_NAMES: tuple[str, ...] = tuple(TILED_WORDS)
"""The tiled algorithm's step names, in the order of computation."""


def meaning(name: str, description: str | None = None) -> str:
    """The meaning of a step as a sentence: its description without a leading label
    (``"attention scores: "``), capitalised, with a final period.

    Example:
        >>> meaning("context")
        'For each query, the weighted sum of value vectors.'
    """
    text = (description or (WORDS[name].description if name in WORDS else "")).strip()
    head, sep, rest = text.partition(": ")
    if sep and rest and len(head) <= 40 and all(c.isalpha() or c == " " for c in head):
        text = rest
    text = text[:1].upper() + text[1:]
    return text if not text or text.endswith((".", "!", "?")) else text + "."


def projection_formula(
    letter: str,
    *,
    source: str = "X",
    bias: bool = False,
    norm: bool = False,
    scale: float | None = None,
    d_k: int | None = None,
    rope: bool = False,
) -> str:
    """How a model made its query, key or value vectors from a layer's input, as a formula.

    Args:
        letter: ``"Q"``, ``"K"`` or ``"V"``.
        source: the rows projected: ``"X"`` (the layer's own input), ``"Y"`` (another
            sequence's, as in cross-attention).
        bias: the projection adds a bias (``+ b_q``).
        norm: a normalisation follows the projection (Qwen3's ``q_norm``).
        scale: a number the model multiplies the projection by itself (Whisper and OPT
            scale Q before attention and then do not scale the scores); written
            ``/ √d_k`` when it is 1/√``d_k``.
        d_k: the head size, to recognise a scale of 1/√d_k.
        rope: the vectors are then rotated by their positions (RoPE, as the model defines
            it, with its own scaling).

    Example:
        >>> projection_formula("Q", bias=True, rope=True)
        'Q = RoPE(X·W_q + b_q)'
        >>> projection_formula("V", source="Y")
        'V = Y·W_v'
        >>> projection_formula("Q", bias=True, scale=0.125, d_k=64)
        'Q = (X·W_q + b_q) / √d_k'
    """
    if letter not in ("Q", "K", "V") or source not in ("X", "Y"):
        raise ValueError(f"letter must be Q, K or V and source X or Y, got {letter!r}, {source!r}")
    low = letter.lower()
    made = f"{source}·W_{low}" + (f" + b_{low}" if bias else "")
    if norm:
        made = f"norm({made})"
    if scale is not None and scale != 1.0:
        if d_k and abs(scale * math.sqrt(d_k) - 1.0) <= 1e-6:
            made = f"({made}) / √d_k"
        else:
            made = f"({made}) × {scale:.4g}"
    if rope:
        made = f"RoPE({made})"
    return f"{letter} = {made}"
