"""A small sentiment set written by the project, whose labels depend on word order and negation.

Every sentence has a twin made of exactly the same words with the opposite label: the two
adjectives (one positive, one negative) swap places. ``the food was great , not awful`` is
positive; ``the food was awful , not great`` is negative. A model that sees only which words
occur (a bag of words, with any classifier on top) gives both twins the same answer, so it
is right on at most half of the set (:func:`bag_of_words_ceiling`); a model must look at the
order, as attention can, to do better.

The rules (the adjective that decides the label is in brackets):

- ``X, not Y``: the food was [great] , not awful
- ``not X, it was Y``: the food was not great , it was [awful]
- ``X but Y``: the food was great but the service was [awful]
- ``first X, end Y``: the food was great at first and [awful] in the end
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkv._io import write_atomic

POSITIVE = ("good", "great", "fine", "nice", "lovely", "excellent", "superb", "pleasant")
NEGATIVE = ("bad", "awful", "poor", "terrible", "boring", "dull", "horrible", "weak")
NOUNS = (
    "food", "movie", "service", "room", "music", "book",
    "staff", "game", "show", "trip", "hotel", "coffee",
)  # fmt: skip
LABELS = ("negative", "positive")

# rule name → (template, the slot whose adjective decides the label)
RULES: dict[str, tuple[str, str]] = {
    "X, not Y": ("the {n} was {a} , not {b}", "a"),
    "not X, it was Y": ("the {n} was not {a} , it was {b}", "b"),
    "X but Y": ("the {n} was {a} but the {m} was {b}", "b"),
    "first X, end Y": ("the {n} was {a} at first and {b} in the end", "b"),
}


@dataclass(frozen=True)
class TextSet:
    """Labelled sentences: ``texts[i]`` has label ``labels[i]``.

    Attributes:
        texts: the sentences, lower case, words and commas separated by single spaces.
        labels: ``"positive"`` or ``"negative"``.
        pairs: the twin id: the two sentences with the same words share it.
        rules: the rule that decides each label (a key of :data:`RULES`).
    """

    texts: tuple[str, ...]
    labels: tuple[str, ...]
    pairs: tuple[int, ...]
    rules: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)

    def rows(self) -> list[dict[str, str | int]]:
        """One dict per sentence: text, label, pair, rule."""
        return [
            {"text": t, "label": y, "pair": p, "rule": r}
            for t, y, p, r in zip(self.texts, self.labels, self.pairs, self.rules, strict=True)
        ]

    def split(self, validation: float = 0.2, *, seed: int = 0) -> tuple[TextSet, TextSet]:
        """(train, validation) sets; twins stay together, so neither set can be solved from
        its bags of words.

        Example:
            >>> train, val = sentiment(100).split(0.2)
            >>> len(train), len(val), set(train.pairs) & set(val.pairs)
            (80, 20, set())
        """
        if not 0.0 < validation < 1.0:
            raise ValueError(
                f"validation must be a fraction between 0 and 1, got {validation!r}. "
                "Hint: validation=0.2 keeps a fifth of the pairs for validation."
            )
        ids = sorted(set(self.pairs))
        order = np.random.default_rng(seed).permutation(len(ids))
        chosen = {ids[i] for i in order[: max(1, round(validation * len(ids)))]}
        val = [i for i, p in enumerate(self.pairs) if p in chosen]
        train = [i for i, p in enumerate(self.pairs) if p not in chosen]
        return self._take(train), self._take(val)

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write the set as CSV with the columns text, label, pair, rule."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, ["text", "label", "pair", "rule"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows())
        target = Path(path)
        write_atomic(target, buffer.getvalue())
        return target

    def to_jsonl(self, path: str | os.PathLike[str]) -> Path:
        """Write the set as JSON Lines: one object per sentence with text, label, pair, rule."""
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows())
        target = Path(path)
        write_atomic(target, lines)
        return target

    def _take(self, rows: Sequence[int]) -> TextSet:
        return TextSet(
            texts=tuple(self.texts[i] for i in rows),
            labels=tuple(self.labels[i] for i in rows),
            pairs=tuple(self.pairs[i] for i in rows),
            rules=tuple(self.rules[i] for i in rows),
        )


def sentiment(n: int = 2000, *, seed: int = 0) -> TextSet:
    """Generate ``n`` sentences (``n / 2`` twin pairs), the same for the same arguments.

    Each pair draws a rule, one or two nouns, a positive and a negative adjective, uniformly,
    with no pair drawn twice; one twin puts the positive adjective in slot X, the other in
    slot Y. The twins are adjacent, in random order.

    Args:
        n: the number of sentences: even, at least 2.
        seed: the random seed (NumPy's PCG64: the same set on every machine).

    Raises:
        ValueError: ``n`` is odd, below 2, or more than the distinct pairs the rules allow.

    Example:
        >>> s = sentiment(4, seed=0)
        >>> for text, label in zip(s.texts, s.labels):
        ...     print(f"{label:8}  {text}")
        negative  the staff was fine at first and bad in the end
        positive  the staff was bad at first and fine in the end
        negative  the movie was boring , not pleasant
        positive  the movie was pleasant , not boring
    """
    possible = _possible_pairs()
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n % 2:
        raise ValueError(
            f"n must be an even whole number of at least 2 (sentences come in twin pairs), "
            f"got {n!r}. Hint: n=2000."
        )
    if n // 2 > possible:
        raise ValueError(
            f"n = {n} needs {n // 2} different pairs, but the rules allow {possible}. "
            f"Hint: n <= {2 * possible}."
        )
    rng = np.random.default_rng(seed)
    names = list(RULES)
    seen: set[tuple[str, str, str, str, str]] = set()
    texts: list[str] = []
    labels: list[str] = []
    rules: list[str] = []
    pairs: list[int] = []
    while len(seen) < n // 2:
        rule = names[int(rng.integers(len(names)))]
        noun, other = (NOUNS[int(i)] for i in rng.choice(len(NOUNS), size=2, replace=False))
        good = POSITIVE[int(rng.integers(len(POSITIVE)))]
        bad = NEGATIVE[int(rng.integers(len(NEGATIVE)))]
        key = (rule, noun, other if "{m}" in RULES[rule][0] else "", good, bad)
        flip = bool(rng.integers(2))
        if key in seen:
            continue
        seen.add(key)
        twins = [(good, bad), (bad, good)]
        for a, b in reversed(twins) if flip else twins:
            template, decisive = RULES[rule]
            texts.append(template.format(n=noun, m=other, a=a, b=b))
            labels.append(LABELS[(a if decisive == "a" else b) in POSITIVE])
            rules.append(rule)
            pairs.append(len(seen) - 1)
    return TextSet(tuple(texts), tuple(labels), tuple(pairs), tuple(rules))


def bag_of_words_ceiling(texts: Sequence[str], labels: Sequence[str]) -> float:
    """The best accuracy any model that sees only word counts can reach on these sentences.

    Sentences with the same bag of words get the same answer from such a model, so for each
    bag at most its most common label is right.

    Example:
        >>> s = sentiment(200)
        >>> bag_of_words_ceiling(s.texts, s.labels)
        0.5
        >>> bag_of_words_ceiling(["a b", "b a", "c"], ["x", "x", "y"])
        1.0
    """
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels; give one label per text.")
    if not texts:
        raise ValueError("no texts: the ceiling of an empty set is undefined.")
    by_bag: dict[frozenset[tuple[str, int]], Counter[str]] = {}
    for text, label in zip(texts, labels, strict=True):
        bag = frozenset(Counter(text.split()).items())
        by_bag.setdefault(bag, Counter())[label] += 1
    best = sum(counts.most_common(1)[0][1] for counts in by_bag.values())
    return best / len(texts)


def _possible_pairs() -> int:
    adjectives = len(POSITIVE) * len(NEGATIVE)
    total = 0
    for template, _ in RULES.values():
        nouns = len(NOUNS) * (len(NOUNS) - 1) if "{m}" in template else len(NOUNS)
        total += nouns * adjectives
    return total
