"""Credit per part from what ``qkv check`` found: the grade of one submission, as plain data.

``qkv check`` already decides follow-through: a worked example's row done right on wrong
numbers from an earlier step is ``consequential``, not a mistake; a function whose numbers
one named slip reproduces on every probe made that slip and nothing else. So a part loses
points only for the slips found in it (:func:`~qkv.grade._parts.part_of`), at the rubric's
price; every later part computed right on the slipped numbers keeps its points.

Two cases earn no credit: a function whose outputs no known slip reproduces (``unrecognised``
on the main probes: no step can be shown right), and, in a worked example, a part with no
claimed row at its step or after it (nothing shows it was done).

Example:
    >>> from qkv.check import check
    >>> from qkv.examples import builtin
    >>> grade = credit_example("seed", check("i-love-statistics"), builtin("i-love-statistics"),
    ...                        Rubric())
    >>> grade.status, grade.score, grade.max_score, grade.first_slip
    ('slip', 1.0, 5.0, 'arithmetic')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qkv._format import number, visible
from qkv.check import Finding, FunctionReport, Report
from qkv.check._probes import probes
from qkv.examples import Example
from qkv.grade._parts import PART_TITLES, PARTS, part_of
from qkv.grade._rubric import Rubric

__all__ = [
    "HIDDEN_NOTE",
    "NOT_TAKEN",
    "STATUSES",
    "Grade",
    "PartResult",
    "credit_example",
    "credit_function",
    "failed",
    "function_parts",
    "part_text",
    "seen",
]

STATUSES = ("ok", "slip", "error", "timeout")
"""A graded submission's status: right (notes allowed), a slip, unusable, or out of time."""

HIDDEN_NOTE = "A hidden probe failed at this step (its inputs are not shown)."
NOT_TAKEN = (
    "Not graded: the function does not take what this part needs (the mask argument), so "
    "this part of the assignment earns nothing."
)


@dataclass(frozen=True)
class PartResult:
    """One part of the mechanism in a grade.

    Attributes:
        part: its name (:data:`~qkv.grade._parts.PARTS`).
        score: the points earned.
        max_score: the points it is worth.
        codes: the slip codes that cost it points (or notes found in it), in order.
        findings: what ``qkv check`` found in it (mistakes and notes).
        follow_through: rows of this part done right on wrong numbers from before.
        shown: False for a worked example's part with no claimed row at or after it, and
            for a part of the assignment the submission cannot take (no mask argument).
        why: for a part not shown, why it earned nothing, as the student reads it.
    """

    part: str
    score: float
    max_score: float
    codes: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    follow_through: bool = False
    shown: bool = True
    why: str = ""

    @property
    def title(self) -> str:
        """The part's name and formula, as a student reads it."""
        return PART_TITLES[self.part]

    @property
    def full(self) -> bool:
        """Whether the part earned all its points."""
        return self.score >= self.max_score


@dataclass(frozen=True)
class Grade:
    """The grade of one submission.

    Attributes:
        student: the student's name (the submission's file or folder name).
        status: one of :data:`STATUSES`.
        parts: the credit per part, in the order of computation.
        reason: for ``error`` and ``timeout``, the one line that says why; else empty.
        kind: what was graded (``attention``, ``causal``, ``multi-head``, ``example``).
        title: what was checked (``attention in alice.py``).
        findings: everything ``qkv check`` found, in its order.
        hidden: the probes whose inputs the student's feedback must not show.
        example: for a worked example, the steps' rows: (step, token) → (claimed numbers
            as printed, correct numbers), for the class page.
        isolation: for code run sandboxed, the isolation it ran at (``bubblewrap``, ...).
        teacher: the teacher's own words for the slip codes found (``--feedback``).
        student_id: the student's id in the course platform's export, or empty.
    """

    student: str
    status: str
    parts: tuple[PartResult, ...]
    reason: str = ""
    kind: str = "attention"
    title: str = ""
    findings: tuple[Finding, ...] = ()
    hidden: frozenset[str] = frozenset()
    example: dict[tuple[str, str], tuple[tuple[str, ...], tuple[float, ...]]] = field(
        default_factory=dict
    )
    isolation: str | None = None
    teacher: dict[str, str] = field(default_factory=dict)
    student_id: str = ""

    @property
    def score(self) -> float:
        """The points earned, over every part."""
        return round(sum(p.score for p in self.parts), 6)

    @property
    def max_score(self) -> float:
        """The points the submission could earn."""
        return round(sum(p.max_score for p in self.parts), 6)

    @property
    def slips(self) -> tuple[str, ...]:
        """The slip codes found (notes such as ``masked-row-nan`` included, ``rounding`` not),
        each once, in the order of computation."""
        found = [
            f.diagnosis
            for f in self.findings
            if f.diagnosis
            and (f.status == "mismatch" or (f.status == "note" and f.diagnosis != "rounding"))
        ]
        return tuple(dict.fromkeys(found))

    @property
    def first_slip(self) -> str:
        """The first mistake's code (not a note), or an empty text."""
        return next((f.diagnosis or "" for f in self.findings if f.status == "mismatch"), "")

    def part(self, name: str) -> PartResult:
        """The result of the part ``name`` (``"scaling"``, ``"softmax"``, ...).

        Raises:
            KeyError: the grade has no such part; the message lists those it has.
        """
        for p in self.parts:
            if p.part == name:
                return p
        raise KeyError(f"no part {name!r} in this grade; its parts: {[p.part for p in self.parts]}")

    def feedback(self, name: str) -> str:
        """What the student reads about the part ``name``: "Right.", or each slip in it in
        ``qkv check``'s words with the numbers computed and the correct ones."""
        return part_text(self, self.part(name))

    @property
    def first_wrong_part(self) -> str | None:
        """The first part that lost points, or None."""
        return next((p.part for p in self.parts if p.score < p.max_score), None)


def seen(grade: Grade, finding: Finding) -> bool:
    """Whether the student may see this finding's code, probe and numbers (not hidden)."""
    return finding.token not in grade.hidden


def part_text(grade: Grade, part: PartResult) -> str:
    """What a student reads about one part, in plain text."""
    if grade.status in ("error", "timeout"):
        return grade.reason
    if not part.shown and grade.kind == "example":
        return "Not shown: no claimed row at this step or after it, so nothing shows it was done."
    if not part.shown:
        return part.why or NOT_TAKEN
    lines: list[str] = []
    for code in part.codes:
        finding = next(f for f in part.findings if (f.diagnosis or "unrecognised") == code)
        if not seen(grade, finding):
            lines.append(HIDDEN_NOTE)
            continue
        kind = "note" if finding.status == "note" else "slip"
        lines.append(f"{kind} {code}: {visible(finding.message)}")
        if finding.printed:
            lines.append("  computed: " + ", ".join(visible(p) for p in finding.printed))
            lines.append("  correct:  " + ", ".join(number(x, 4) for x in finding.expected))
        if code in grade.teacher:
            lines.append("  from your teacher: " + visible(" ".join(grade.teacher[code].split())))
    if not lines:
        lines.append(
            "Right, on the numbers of an earlier step that were wrong (follow-through credit)."
            if part.follow_through
            else "Right."
        )
    return "\n".join(dict.fromkeys(lines))


def failed(
    student: str,
    status: str,
    reason: str,
    parts: Sequence[str],
    rubric: Rubric,
    *,
    kind: str,
    title: str,
) -> Grade:
    """The grade of a submission that could not be checked: every part of the assignment
    is there, and none earns a point (``reason`` says why)."""
    results = tuple(
        PartResult(p, 0.0, rubric.points_of(p), shown=False, why=reason)
        for p in parts
        if rubric.points_of(p)
    )
    return Grade(student, status, results, reason=reason, kind=kind, title=title)


def function_parts(kind: str, *, with_mask: bool, batched: bool) -> tuple[str, ...]:
    """The parts a function of ``kind`` is graded on."""
    mask = kind == "causal" or with_mask  # a multi-head class may be causal (--kind module)
    if kind in ("multi-head", "gqa"):
        masked = ("mask",) if mask else ()
        return ("projections", "scores", "scaling", *masked, "softmax", "weighted-sum", "heads")
    found = ("scores", "scaling", *(("mask",) if mask else ()), "softmax", "weighted-sum")
    return (*found, *(("batched",) if batched else ()))


def credit_function(
    student: str,
    report: FunctionReport,
    rubric: Rubric,
    *,
    batched: bool,
    hidden: bool,
    assignment: Sequence[str] | None = None,
) -> Grade:
    """The grade of a checked function: each finding costs its part (the rubric's price).

    ``assignment`` is the parts of the assignment (:func:`function_parts` of its kind, by
    default those the function was checked on): a part the function cannot take (the mask,
    for a function without a mask argument) earns nothing, with the reason; a part the
    assignment lacks is left out. So a submission has the same parts and total whether it
    is graded alone or in a class.

    ``hidden`` hides every probe but the first: the feedback names a slip found on the first
    probe, and says of the others only that a hidden probe failed.

    Example:
        >>> from qkv.check import check_function
        >>> import numpy as np
        >>> def attention(Q, K, V):
        ...     s = Q @ K.T / np.sqrt(Q.shape[-1])
        ...     w = np.exp(s - s.max(-1, keepdims=True))
        ...     return (w / w.sum(-1, keepdims=True)) @ V
        >>> grade = credit_function("ada", check_function(attention), Rubric(), batched=False,
        ...     hidden=False, assignment=function_parts("attention", with_mask=True, batched=False))
        >>> grade.score, grade.max_score, grade.part("mask").shown
        (4.0, 5.0, False)
    """
    all_probes = probes(report.kind, with_mask=report.with_mask, batched=batched)
    roles = {p.name: p.role for p in all_probes}
    secret = frozenset(p.name for p in all_probes[1:]) if hidden else frozenset()
    taken = function_parts(report.kind, with_mask=report.with_mask, batched=batched)
    parts = tuple(assignment) if assignment is not None else taken
    costs: dict[str, list[Finding]] = {p: [] for p in parts}
    for f in report.findings:
        if f.status not in ("mismatch", "note"):
            continue
        code = f.diagnosis or "unrecognised"
        if code == "unrecognised" and roles.get(f.token) == "main" and f.step != "weights":
            for found in costs.values():  # nothing reproduces it: no step is shown right
                found.append(f)
            continue
        part = (
            "softmax"
            if code == "unrecognised" and roles.get(f.token) == "large"
            else "mask"
            if code == "unrecognised" and roles.get(f.token) == "masked-row"
            else part_of(code, f.step)
        )
        if part not in costs:  # a part the assignment does not grade: the step's part
            heads = 2 if report.kind in ("multi-head", "gqa") else 1
            part = part_of(None, f.step, heads=heads)
        costs.setdefault(part if part in costs else parts[-1], []).append(f)
    # follow-through only after a mistake: a note (masked-row-nan) is no earlier slip
    first = next(
        (i for i, p in enumerate(parts) if any(f.status == "mismatch" for f in costs[p])),
        len(parts),
    )
    results = tuple(
        _part(p, costs[p], rubric, follow=i > first)
        if p in taken
        else PartResult(p, 0.0, rubric.points_of(p), shown=False, why=_not_taken(report, p))
        for i, p in enumerate(parts)
        if rubric.points_of(p)
    )
    return Grade(
        student,
        "ok" if report.ok else "slip",
        results,
        kind=report.kind,
        title=report.name,
        findings=report.findings,
        hidden=secret,
        isolation=report.isolation,
    )


def _not_taken(report: FunctionReport, part: str) -> str:
    """Why a part of the assignment could not be checked on this submission."""
    if part == "mask":
        return NOT_TAKEN
    return (
        f"Not graded: the submission was not checked on this part ({PART_TITLES[part]}), so "
        "it earns nothing."
    )


def example_parts(example: Example) -> tuple[str, ...]:
    """The parts a worked example is graded on, from what it computes."""
    found = []
    if example.inputs == "embeddings":
        found.append("projections")
    if example.inputs != "scores":
        found.append("scores")
    if example.scale is not False:
        found.append("scaling")
    if example.causal or example.mask is not None or example.key_length is not None:
        found.append("mask")
    found += ["softmax", "weighted-sum"]
    if example.heads > 1:
        found.append("heads")
    elif example.W_o is not None:
        found.append("output")
    return tuple(found)


def credit_example(student: str, report: Report, example: Example, rubric: Rubric) -> Grade:
    """The grade of a checked worked example: each mistake costs its part; a row done right
    on wrong numbers (``consequential``) costs nothing; a part with no claimed row at or
    after its step earns nothing."""
    parts = example_parts(example)
    order = {p: i for i, p in enumerate(PARTS)}
    costs: dict[str, list[Finding]] = {p: [] for p in parts}
    follow: set[str] = set()
    reached = -1
    for f in report.findings:
        part = part_of(f.diagnosis, f.step, heads=example.heads)
        step_part = part_of(None, f.step, heads=example.heads)
        reached = max(reached, order[step_part])
        if f.status == "consequential":
            follow.add(step_part)
        if f.status in ("mismatch", "note") and f.diagnosis:
            costs.setdefault(part if part in costs else step_part, []).append(f)
    results = tuple(
        _part(p, costs.get(p, []), rubric, follow=p in follow, shown=order[p] <= reached)
        for p in parts
        if rubric.points_of(p)
    )
    rows = {(f.step, f.token): (f.printed, f.expected) for f in report.findings}
    return Grade(
        student,
        "ok" if report.ok else "slip",
        results,
        kind="example",
        title=report.name,
        findings=report.findings,
        example=rows,
    )


def _part(
    part: str,
    found: Sequence[Finding],
    rubric: Rubric,
    *,
    follow: bool = False,
    shown: bool = True,
) -> PartResult:
    points = rubric.points_of(part)
    codes = tuple(dict.fromkeys(f.diagnosis or "unrecognised" for f in found))
    lost = sum(rubric.penalty(c, points) for c in codes)
    score = 0.0 if not shown else max(0.0, points - lost)
    return PartResult(part, round(score, 6), points, codes, tuple(found), follow, shown)
