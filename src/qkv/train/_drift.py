"""How far the embeddings moved in training: the seed's point made measurable.

Attention learns W_q, W_k and W_v; it leaves the word vectors alone unless the embedding
layer itself is trained. :func:`embedding_drift` compares the matrix a run started from with
the one it ended with, word by word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["embedding_drift", "format_drift"]

SPECIALS = ("<pad>", "<unk>")


def embedding_drift(
    start: np.ndarray,
    end: np.ndarray,
    words: Sequence[str],
    *,
    pretrained: Sequence[bool] | None = None,
    top: int = 10,
) -> dict[str, Any]:
    """Per word: the L2 distance from its starting vector, the cosine between the two, and the
    distance relative to the starting length; summaries; the words that moved most and least.

    The special tokens ``<pad>`` and ``<unk>`` are left out.

    Args:
        start: (V, E) the embeddings before training.
        end: (V, E) after training.
        words: the V words.
        pretrained: for each word, whether its start came from the word-vector file (False:
            it had no vector there and started random).
        top: how many words to list as moving most (and least).

    Returns:
        A JSON-able dict: ``identical`` (bit for bit), ``words``, ``dim``,
        ``mean_l2``, ``median_l2``, ``max_l2``, ``mean_cosine``, ``mean_relative``,
        ``moved_most``, ``moved_least`` (lists of word entries) and ``per_word`` (every word,
        most moved first). A word entry: ``word``, ``l2``, ``cosine``, ``relative``,
        ``pretrained``.

    Example:
        >>> start = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
        >>> end = np.array([[0.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
        >>> report = embedding_drift(start, end, ["<pad>", "good", "bad"])
        >>> report["identical"], [w["word"] for w in report["moved_most"]]
        (False, ['good', 'bad'])
        >>> report["moved_most"][0]["l2"], round(report["moved_most"][0]["cosine"], 4)
        (1.0, 0.7071)
    """
    before = np.asarray(start)
    after = np.asarray(end)
    if before.shape != after.shape or before.ndim != 2 or before.shape[0] != len(words):
        raise ValueError(
            f"start {before.shape} and end {after.shape} must both be (V, E) with V = "
            f"{len(words)} words."
        )
    flags = [True] * len(words) if pretrained is None else list(pretrained)
    keep = [i for i, w in enumerate(words) if w not in SPECIALS]
    a, b = before[keep].astype(np.float64), after[keep].astype(np.float64)
    l2 = np.linalg.norm(b - a, axis=1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosine = np.where(norms > 0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1.0), 0.0)
    length = np.linalg.norm(a, axis=1)
    relative = np.where(length > 0, l2 / np.where(length > 0, length, 1.0), 0.0)
    order = np.argsort(-l2, kind="stable")
    entries = [
        {
            "word": words[keep[i]],
            "l2": float(l2[i]),
            "cosine": float(cosine[i]),
            "relative": float(relative[i]),
            "pretrained": bool(flags[keep[i]]),
        }
        for i in order
    ]
    empty = not keep
    return {
        "identical": bool(np.array_equal(before, after)),
        "words": len(keep),
        "dim": int(before.shape[1]),
        "mean_l2": 0.0 if empty else float(l2.mean()),
        "median_l2": 0.0 if empty else float(np.median(l2)),
        "max_l2": 0.0 if empty else float(l2.max()),
        "mean_cosine": 1.0 if empty else float(cosine.mean()),
        "mean_relative": 0.0 if empty else float(relative.mean()),
        "moved_most": entries[:top],
        "moved_least": entries[::-1][:top],
        "per_word": entries,
    }


def format_drift(report: dict[str, Any], *, frozen: bool, shown: int = 8) -> str:
    """The report as a few lines for the terminal (at most 80 columns).

    Example:
        >>> start = np.array([[1.0, 0.0], [0.0, 2.0]])
        >>> print(format_drift(embedding_drift(start, start, ["a", "b"]), frozen=True))
        Embeddings: frozen; 2 words × 2, bit-identical to the start (moved 0).
    """
    size = f"{report['words']} words × {report['dim']}"
    if report["identical"]:
        state = "frozen" if frozen else "fine-tuned"
        return f"Embeddings: {state}; {size}, bit-identical to the start (moved 0)."
    lines = [
        f"Embeddings: fine-tuned; {size}. Distance from the start (L2): mean "
        f"{report['mean_l2']:.4f}, median {report['median_l2']:.4f}, max "
        f"{report['max_l2']:.4f}; mean cosine to the start {report['mean_cosine']:.4f}; "
        f"mean move {100 * report['mean_relative']:.1f}% of a vector's length.",
        "Moved most:",
    ]
    width = max((len(e["word"]) for e in report["moved_most"][:shown]), default=4)
    for entry in report["moved_most"][:shown]:
        mark = "" if entry["pretrained"] else "  (no pretrained vector: started random)"
        lines.append(
            f"  {entry['word']:<{width}}  L2 {entry['l2']:.4f}  cosine {entry['cosine']:.4f}"
            f"  {100 * entry['relative']:5.1f}%{mark}"
        )
    wrapped = []
    for line in lines:
        wrapped.extend(_wrap(line))
    return "\n".join(wrapped)


def _wrap(line: str, width: int = 80) -> list[str]:
    if len(line) <= width:
        return [line]
    import textwrap

    return textwrap.wrap(line, width, subsequent_indent="  ")
