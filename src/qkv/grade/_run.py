"""Grading a class: every submission checked in parallel, each a grade whatever happens.

Each code submission runs in its own sandboxed process (``qkv check --function``), so
:func:`grade_all` keeps ``jobs`` of them running at once from a pool of threads that only
wait. A submission that breaks anything (its code, its file, qkv itself) becomes an ``error``
grade with its reason; the run goes on. Only a setting of the teacher's that no submission
can meet (an isolation this machine lacks) stops it, before any grade.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

from qkv.check._sandbox import IsolationError
from qkv.grade._credit import Grade, PartResult
from qkv.grade._kinds import Settings, grade_one
from qkv.grade._submissions import Submission

__all__ = ["grade_all"]


def grade_all(
    submissions: Sequence[Submission],
    settings: Settings,
    *,
    jobs: int = 1,
    progress: Callable[[Grade], None] | None = None,
) -> list[Grade]:
    """The grade of every submission, in their order; ``progress`` is called as each ends.

    Raises:
        IsolationError: the isolation asked for is not available on this machine.
    """
    grades: list[Grade | None] = [None] * len(submissions)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        running = {pool.submit(_safely, s, settings): i for i, s in enumerate(submissions)}
        try:
            for done in concurrent.futures.as_completed(running):
                grade = done.result()
                grades[running[done]] = grade
                if progress is not None:
                    progress(grade)
        except BaseException:
            for future in running:
                future.cancel()
            raise
    return _same_parts([g for g in grades if g is not None])


def _safely(submission: Submission, settings: Settings) -> Grade:
    try:
        return grade_one(submission, settings)
    except IsolationError:
        raise
    except Exception as error:  # qkv's own failure on a hostile file: a row, never a stop
        from qkv._format import visible

        why = visible(" ".join(str(error).split()))[:300] or type(error).__name__
        return dataclasses.replace(
            grade_one(
                dataclasses.replace(
                    submission, form="problem", path=None, problem=f"{submission.entry}: {why}"
                ),
                settings,
            ),
        )


def _same_parts(grades: list[Grade]) -> list[Grade]:
    """Grade every submission of one kind on the same parts: those most of the class was
    graded on. A part a submission lacks (a function without the mask argument in a class
    whose functions take one, a submission that could not be checked) earns nothing."""
    seen: dict[str, list[tuple[tuple[str, float], ...]]] = collections.defaultdict(list)
    for g in grades:
        if g.status in ("ok", "slip"):
            seen[g.kind].append(tuple((p.part, p.max_score) for p in g.parts))
    common = {kind: collections.Counter(s).most_common(1)[0][0] for kind, s in seen.items()}
    out = []
    for g in grades:
        if g.kind not in common:
            out.append(g)
            continue
        have = {p.part: p for p in g.parts}
        parts = tuple(
            have.get(part) or PartResult(part, 0.0, points, shown=g.status not in ("ok", "slip"))
            for part, points in common[g.kind]
        )
        out.append(dataclasses.replace(g, parts=parts))
    return out
