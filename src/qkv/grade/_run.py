"""Grading a class: every submission checked in parallel, each a grade whatever happens.

Each code submission runs in its own sandboxed process (``qkv check --function``), so
:func:`grade_all` keeps ``jobs`` of them running at once from a pool of threads that only
wait. A submission that breaks anything (its code, its file, qkv itself) becomes an ``error``
grade with its reason; the run goes on. Only a setting of the teacher's that no submission
can meet (an isolation this machine lacks) stops it, before any grade.

Every grade has the parts of the assignment (its kind and rubric), whatever the others of
the class did: a submission graded alone (Gradescope, PrairieLearn) has the parts and total
it has in a class.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

from qkv.check._sandbox import IsolationError
from qkv.grade._credit import Grade
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
    return [g for g in grades if g is not None]


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
