"""What a check found, as plain data: one :class:`Finding` per claimed row, gathered in a
:class:`ReportData`.

Nothing here formats a report: the text, Markdown and JSON formatters (``_text``,
``_markdown``, ``_json``) read this data, and :class:`qkv.check.Report` adds methods that
call them. Every module of the check imports this one; it imports only :mod:`qkv._format`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Self

from qkv._format import visible

__all__ = ["DIAGNOSED", "DIAGNOSES", "STATUSES", "Diagnosis", "Finding", "ReportData"]

STATUSES = ("ok", "mismatch", "consequential", "note")
"""What a finding can say about a claimed row.

``ok``: every number matches within its printed precision. ``mismatch``: a mistake made in
this step (``diagnosis`` names it). ``consequential``: the step was done right, but on wrong
numbers from an earlier step. ``note``: off only beyond the printed precision (``rounding``).
"""


@dataclass(frozen=True)
class Diagnosis:
    """A code ``qkv check`` names a slip by: in a worked example (:data:`DIAGNOSED`), in
    attention code (``FunctionCode``, with the slips that give it) or in FlashAttention
    code (``FLASH_CODES``).

    Attributes:
        code: the code (``"unscaled"``).
        part: the part of the mechanism the slip costs in ``qkv grade`` (one of
            :data:`qkv.grade.PARTS`), or None for a slip of no step in particular
            (``arithmetic``): it costs the part of the step it was found at.
        sentence: the slip it names, in a learner's words.
    """

    code: str
    part: str | None
    sentence: str


DIAGNOSED: tuple[Diagnosis, ...] = (
    Diagnosis("unscaled", "scaling", "softmax of Q·Kᵀ without dividing by √d_k"),
    Diagnosis(
        "scaled-by-dmodel",
        "scaling",
        "each head's scores are divided by √d_model instead of √d_head "
        "(d_head = d_model / num_heads)",
    ),
    Diagnosis("scaled-by-dk", "scaling", "divided by d_k instead of √d_k"),
    Diagnosis(
        "transposed-weights",
        "projections",
        "X·Wᵀ instead of X·W (the column-vector convention mixed up)",
    ),
    Diagnosis(
        "softmax-wrong-axis",
        "softmax",
        "softmax normalised over the queries (columns) instead of over the keys (rows)",
    ),
    Diagnosis(
        "query-key-swapped",
        "scores",
        "K·Qᵀ instead of Q·Kᵀ: a score row holds another query's scores",
    ),
    Diagnosis(
        "sum-normalised",
        "softmax",
        "the scores are divided by their row sum instead of going through "
        "softmax (exponentiate, then divide by the sum of the exponentials)",
    ),
    Diagnosis(
        "mask-ignored",
        "mask",
        "the mask (or the causal rule) is not applied: a masked key must get "
        "weight 0 (set its score to −inf before the softmax)",
    ),
    Diagnosis(
        "mask-inverted",
        "mask",
        "the mask is applied the wrong way round: each query attends exactly the keys it must not",
    ),
    Diagnosis(
        "causal-misaligned", "mask", "the causal rule is aligned at the wrong corner when Lq ≠ Lk"
    ),
    Diagnosis(
        "context-not-summed",
        "weighted-sum",
        'the "context vectors" are the products w_j·v_j of one query, not their sum',
    ),
    Diagnosis(
        "other-weights",
        "weighted-sum",
        "the context is computed from weights other than the printed ones (rounded, or assumed)",
    ),
    Diagnosis(
        "heads-averaged",
        "heads",
        "the heads' attention is averaged instead of each head's context being "
        "computed on its own slice of V and the heads concatenated before W_o",
    ),
    Diagnosis("wrong-query", "scores", "the row was computed with another token's query"),
    Diagnosis(
        "not-softmax",
        "softmax",
        "weights that no softmax of these scores gives: a larger score gets a smaller weight",
    ),
    Diagnosis(
        "exps-rounded-to-zero",
        "softmax",
        "the exponentials were rounded to 0 and carried on: their sum is 0 "
        "and the weights 0/0 (subtract the row's largest score before exp, or keep more digits)",
    ),
    Diagnosis(
        "flash-no-rescale",
        "flash-output",
        "tiled: the accumulator O is not rescaled by α = exp(m_old − m_new) "
        "when the running maximum grows",
    ),
    Diagnosis(
        "flash-sum-not-rescaled",
        "flash-output",
        "tiled: the running sum l is not rescaled by α = exp(m_old − "
        "m_new) when the running maximum grows",
    ),
    Diagnosis(
        "flash-max-not-updated",
        "flash-output",
        "tiled: the running maximum m is not updated to the largest score seen so far",
    ),
    Diagnosis(
        "flash-final-divide-missing",
        "flash-output",
        "tiled: the output is the accumulator O, not divided by the running sum l",
    ),
    Diagnosis(
        "flash-lse-wrong-base",
        "flash-lse",
        "tiled: the log-sum-exp in base 2 (log2 or exp2 without the "
        "matching scale) instead of the natural log",
    ),
    Diagnosis(
        "flash-lse-without-max",
        "flash-lse",
        "tiled: the log-sum-exp is ln l alone, without adding the running maximum m",
    ),
    Diagnosis(
        "digit-slip", None, "one digit wrong, or two neighbouring digits swapped; the rest is right"
    ),
    Diagnosis("arithmetic", None, "one or a few numbers wrong, with no pattern above"),
    Diagnosis("rounding", None, "differs only beyond the printed precision (a note, not an error)"),
)
"""Every diagnosis of a worked example, in the order they are tried, each with its part."""

DIAGNOSES: dict[str, str] = {d.code: d.sentence for d in DIAGNOSED}
"""Each diagnosis code and the slip it names, in the order they are tried."""


@dataclass(frozen=True)
class Finding:
    """What the checker found about one claimed row, e.g. the weights of the query "love".

    Attributes:
        step: the step name (``"Q"``, ``"scores"``, ``"weights"``, ...).
        token: the token whose row it is.
        position: the token's 0-based position.
        claimed: the numbers as claimed.
        printed: the same numbers as printed in the file (``"0.50"``), for their digits.
        expected: the correct numbers.
        status: one of :data:`STATUSES`.
        diagnosis: a code of :data:`DIAGNOSES` for a mismatch (``"rounding"`` for a note);
            None for ``ok`` and ``consequential``.
        message: what is wrong and what the step should have been, in plain words.
        marks: per number, ``"ok"``, ``"rounding"`` or ``"wrong"``.
        line: the line of the row in the file, when known.
        cause: for a consequential row, the (step, position) of the mistake it follows from.
        decimals: how many decimals to show the numbers of this row with.
        head: the head (0-based) of a per-head row (``claimed.per_head``), else None.
        tiled: a row of the tiled algorithm (``tiled.claimed``: ``running_max``, ...).
        key_block: for a per-tile row of a tiled example, the key block (from 0) after which
            the value holds; None for every other row.
    """

    step: str
    token: str
    position: int
    claimed: tuple[float, ...]
    printed: tuple[str, ...]
    expected: tuple[float, ...]
    status: str
    diagnosis: str | None
    message: str
    marks: tuple[str, ...]
    line: int | None = None
    cause: tuple[str, int] | None = None
    decimals: int = 4
    head: int | None = None
    tiled: bool = False
    key_block: int | None = None

    @property
    def wrong(self) -> bool:
        """A mismatch or a consequential error (notes and matches are not wrong)."""
        return self.status in ("mismatch", "consequential")

    def to_dict(self) -> dict[str, Any]:
        """The finding in the JSON schema: step, token, claimed, expected, status, diagnosis,
        message (and ``head``, counted from 0, for a per-head row). ``expected`` is
        rounded to 6 decimals; a masked score (−inf) is ``null``."""
        found: dict[str, Any] = {
            "step": self.step,
            "token": self.token,
            "claimed": [float(x) if math.isfinite(x) else None for x in self.claimed],
            "expected": [
                round(float(x), 6) + 0.0 if math.isfinite(x) else None for x in self.expected
            ],
            "status": self.status,
            "diagnosis": self.diagnosis,
            "message": self.message,
        }
        if self.head is not None:
            found["head"] = self.head
        if self.tiled:
            found["tiled"] = True
            found["key_block"] = self.key_block
        return found


@dataclass(frozen=True)
class ReportData:
    """The check of one worked example: a finding per claimed row, in the order of computation.

    Attributes:
        name: the example's title.
        source: where it came from (``"built-in i-love-statistics"`` or the file path).
        tokens: the example's tokens.
        findings: one per claimed row: the steps in the order Q, K, V, scores, scaled,
            exp, exp_sum, weights, products, context, output, and the tokens in their order
            within a step.
        query_tokens: the names of the queries when they are not ``tokens`` (Lq ≠ Lk).
    """

    name: str
    source: str | None
    tokens: tuple[str, ...]
    findings: tuple[Finding, ...]
    query_tokens: tuple[str, ...] | None = None

    @property
    def ok(self) -> bool:
        """True when no claimed row is wrong (notes do not count)."""
        return not any(f.wrong for f in self.findings)

    @property
    def first_wrong(self) -> Finding | None:
        """The first mistake in the order of computation, or None."""
        return next((f for f in self.findings if f.status == "mismatch"), None)

    def counts(self) -> dict[str, int]:
        """How many findings have each status."""
        return {s: sum(f.status == s for f in self.findings) for s in STATUSES}

    def visible(self) -> Self:
        """The report with every control character in its texts (tokens, name, source,
        messages, printed numbers) written out visibly, ``\\x1b`` for ESC: what the text and
        Markdown reports show, so that a token cannot act on the terminal."""
        findings = tuple(
            dataclasses.replace(
                f,
                token=visible(f.token),
                printed=tuple(visible(p) for p in f.printed),
                message=visible(f.message),
            )
            for f in self.findings
        )
        return dataclasses.replace(
            self,
            name=visible(self.name),
            source=None if self.source is None else visible(self.source),
            tokens=tuple(visible(t) for t in self.tokens),
            query_tokens=None
            if self.query_tokens is None
            else tuple(visible(t) for t in self.query_tokens),
            findings=findings,
        )

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": bool, "findings": [...]}``, see :meth:`Finding.to_dict`."""
        return {"ok": self.ok, "findings": [f.to_dict() for f in self.findings]}
