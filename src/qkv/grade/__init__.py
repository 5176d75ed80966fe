"""``qkv grade``: grade a class's attention, name each student's slip, credit each step.

A class hands in attention functions (``.py`` files or folders) or worked examples
(``.yaml``); :func:`grade_class` checks each one as ``qkv check`` does (code in its sandbox,
in parallel, each with a time limit), turns what it found into points per part of the
mechanism (:class:`Rubric`: scores, scaling, mask, softmax, weighted sum, heads), with
follow-through credit for steps done right on an earlier slip, and :func:`write_class`
writes ``grades.csv``, each student's ``STUDENT.json`` (Gradescope's ``results.json``
schema) and ``STUDENT.md``, and ``class.html``, the teacher's page. A submission that
cannot be checked is a grade too (``error`` or ``timeout``), never a stop. docs/grading.md.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     _ = Path(tmp, "ada.yaml").write_text('''
    ... tokens: [a, b]
    ... embeddings: [[1, 0], [0, 1]]
    ... weights: {W_q: [[1], [0]], W_k: [[1], [1]], W_v: [[1], [2]]}
    ... claimed: {V: {a: [1.0], b: [2.0]}, weights: {a: [0.5, 0.5]}}
    ... ''')
    ...     grades = grade_class(Path(tmp), Settings(kind="example"))
    >>> [(g.student, g.status, g.score, g.max_score) for g in grades]
    [('ada', 'ok', 4.0, 5.0)]
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from qkv import _io
from qkv.grade._archive import ArchiveError
from qkv.grade._class_page import class_page
from qkv.grade._credit import STATUSES, Grade, PartResult
from qkv.grade._kinds import KINDS, Kind, Settings
from qkv.grade._outputs import CSV_COLUMNS, feedback, grades_csv, gradescope, gradescope_json
from qkv.grade._parts import PART_TITLES, PARTS
from qkv.grade._rubric import Rubric, RubricError, load_rubric, parse_rubric
from qkv.grade._run import grade_all
from qkv.grade._submissions import collect

__all__ = [
    "CSV_COLUMNS",
    "KINDS",
    "PARTS",
    "PART_TITLES",
    "STATUSES",
    "ArchiveError",
    "Grade",
    "Kind",
    "PartResult",
    "Rubric",
    "RubricError",
    "Settings",
    "class_page",
    "feedback",
    "grade_class",
    "grades_csv",
    "gradescope",
    "gradescope_json",
    "load_rubric",
    "parse_rubric",
    "write_class",
]


def grade_class(
    source: str | os.PathLike[str],
    settings: Settings,
    *,
    jobs: int = 1,
    code_file: str | None = None,
    single: bool = False,
    skip: str | os.PathLike[str] | None = None,
    progress: Callable[[int, Grade | None], None] | None = None,
) -> list[Grade]:
    """Grade every submission in ``source`` (a folder or a zip; with ``single``, one
    student's file or folder); ``skip`` is a folder in ``source`` that is no submission (the
    output folder). ``progress(total, grade)`` is called once with no grade when
    the submissions are known, then once per graded submission.

    Raises:
        ArchiveError: a zip that cannot be unpacked safely.
        ValueError: ``source`` is no folder or zip; an isolation not available here.
    """
    with tempfile.TemporaryDirectory(prefix="qkv-grade-") as work:
        found = collect(
            Path(source),
            Path(work),
            code_file=code_file,
            single=single,
            skip=None if skip is None else Path(skip),
        )
        if progress is not None:
            progress(len(found), None)
        return grade_all(
            found,
            settings,
            jobs=jobs,
            progress=None if progress is None else lambda g: progress(len(found), g),
        )


def write_class(out: str | os.PathLike[str], grades: Sequence[Grade], *, title: str) -> list[str]:
    """Write ``grades.csv``, ``STUDENT.json``, ``STUDENT.md`` and ``class.html`` into the
    folder ``out`` (made if missing); return the names written.

    All or nothing: every file is written first into a temporary folder inside ``out``, and
    only when all are written are they moved into place; a failure (a full disk) leaves
    ``out`` as it was.

    Raises:
        OSError: a file cannot be written (``qkv._io.WriteError``, naming the file).
    """
    folder = Path(out)
    folder.mkdir(exist_ok=True)
    files = {}
    for grade in grades:
        files[f"{grade.student}.json"] = gradescope_json(grade)
        files[f"{grade.student}.md"] = feedback(grade)
    files["class.html"] = class_page(grades, title=title)
    files["grades.csv"] = grades_csv(grades)
    staging = Path(tempfile.mkdtemp(prefix=".qkv-grade-", dir=folder))
    try:
        for name, text in files.items():
            _io.write_atomic(staging / name, text)
        for name in files:
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return list(files)
