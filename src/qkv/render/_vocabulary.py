"""The words of every step, as a learner reads them: titles, meanings and formulas.

The titles use the seeds' vocabulary (embeddings, query/key/value vectors, attention scores,
scaling, softmax, attention weights, context vectors as weighted sums of value vectors). The
meanings and plain formulas are fallbacks: a recorded step carries its own.
"""

from __future__ import annotations

from qkv.trace import Step

__all__ = ["LATEX_FORMULAS", "MEANINGS", "PLAIN_FORMULAS", "TITLES", "meaning"]

TITLES = {
    "embeddings": "Token embeddings",
    "W_q": "Query weight matrix W_q",
    "W_k": "Key weight matrix W_k",
    "W_v": "Value weight matrix W_v",
    "Q": "Query vectors",
    "K": "Key vectors",
    "V": "Value vectors",
    "scores": "Attention scores",
    "scaled": "Scaled attention scores",
    "bias": "Scaled scores plus bias",
    "masked": "Masked attention scores",
    "weights": "Attention weights",
    "dropout": "Attention weights after dropout",
    "context": "Context vectors",
    "concat": "Concatenated context vectors",
    "W_o": "Output weight matrix W_o",
    "output": "Output",
}
"""The title of each step, in the seeds' vocabulary."""

MEANINGS = {
    "embeddings": "word embeddings: one row per token (d_model numbers each)",
    "W_q": "learned projection that turns an embedding into a query vector",
    "W_k": "learned projection that turns an embedding into a key vector",
    "W_v": "learned projection that turns an embedding into a value vector",
    "Q": "query vectors: what each word is looking for",
    "K": "key vectors: what each word offers to be matched against a query",
    "V": "value vectors: the information each word passes on",
    "scores": "the dot product of each query vector with every key vector",
    "scaled": "scores divided by √d_k so that softmax is not too sharp",
    "bias": "scaled scores plus an additive bias",
    "masked": "keys a query may not attend to get −∞, so their weight is 0",
    "weights": "softmax of each row: positive numbers that sum to 1",
    "dropout": "dropped weights are 0, the others divided by 1 − p",
    "context": "for each query, the weighted sum of the value vectors",
    "concat": "the context vectors of all heads, side by side",
    "W_o": "learned output projection of the concatenated heads",
    "output": "the output of multi-head attention, one row per token",
}

PLAIN_FORMULAS = {
    "embeddings": "X",
    "W_q": "W_q",
    "W_k": "W_k",
    "W_v": "W_v",
    "Q": "Q = X·W_q",
    "K": "K = X·W_k",
    "V": "V = X·W_v",
    "scores": "S = Q·Kᵀ",
    "scaled": "S' = S · scale",
    "bias": "S' = S' + bias",
    "masked": "S' = S' where allowed, −∞ elsewhere",
    "weights": "A = softmax(S') row by row",
    "dropout": "A = A · keep / (1 − p)",
    "context": "C = A·V",
    "concat": "concat(C_1, …, C_h)",
    "W_o": "W_o",
    "output": "O = concat·W_o",
}

LATEX_FORMULAS = {
    "embeddings": "X",
    "W_q": "W_q",
    "W_k": "W_k",
    "W_v": "W_v",
    "Q": "Q = X W_q",
    "K": "K = X W_k",
    "V": "V = X W_v",
    "scores": r"S = Q K^{\top}",
    "bias": r"S' = S' + B",
    "masked": r"S'_{ij} = -\infty \text{ where query } i \text{ may not attend to key } j",
    "weights": r"A = \operatorname{softmax}(S') \text{ row by row}",
    "dropout": r"A = A \cdot \mathrm{keep} / (1 - p)",
    "context": "C = A V",
    "W_o": "W_o",
}


def meaning(step: Step) -> str:
    """The step's description without a leading ``"attention scores: "``, capitalised."""
    text = (step.description or MEANINGS.get(step.name, "")).strip()
    head, sep, rest = text.partition(": ")
    if sep and rest and len(head) <= 40 and all(c.isalpha() or c == " " for c in head):
        text = rest
    text = text[:1].upper() + text[1:]
    return text if not text or text.endswith((".", "!", "?")) else text + "."
