"""``qkv grade``: grade a class's attention, name each student's slip, credit each step.

A class hands in attention functions (``.py`` files or folders) or worked examples
(``.yaml``); :func:`grade_class` checks each one as ``qkv check`` does (code in its sandbox,
in parallel, each with a time limit), turns what it found into points per part of the
mechanism (:class:`Rubric`: scores, scaling, mask, softmax, weighted sum, heads), with
follow-through credit for steps done right on an earlier slip, and :func:`write_class`
writes ``grades.csv``, each student's ``STUDENT.json`` (Gradescope's ``results.json``
schema) and ``STUDENT.md``, and ``class.html``, the teacher's page. A submission that
cannot be checked is a grade too (``error`` or ``timeout``), never a stop. One submission
graded alone (Gradescope, PrairieLearn) has the same parts and total as in a class
(:func:`gradescope`, :func:`prairielearn`). docs/grading.md.

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
from qkv._format import visible
from qkv.grade._archive import ArchiveError
from qkv.grade._class_page import class_page
from qkv.grade._credit import STATUSES, Grade, PartResult
from qkv.grade._feedback import load_feedback, parse_feedback
from qkv.grade._kinds import KINDS, Kind, Settings, defined
from qkv.grade._outputs import (
    CSV_COLUMNS,
    feedback,
    grades_csv,
    gradescope,
    gradescope_json,
    prairielearn,
    prairielearn_json,
)
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
    "OutputError",
    "PartResult",
    "Rubric",
    "RubricError",
    "Settings",
    "check_output",
    "class_page",
    "feedback",
    "grade_class",
    "grades_csv",
    "gradescope",
    "gradescope_json",
    "load_feedback",
    "load_rubric",
    "parse_feedback",
    "parse_rubric",
    "prairielearn",
    "prairielearn_json",
    "write_class",
]

_MANIFEST = ".qkv-grade-files"
"""The file in OUT that lists what the last run wrote there (its stale files are removed)."""


class OutputError(ValueError):
    """An output folder qkv grade may not write into: one line that says why."""


def grade_class(
    source: str | os.PathLike[str],
    settings: Settings,
    *,
    jobs: int = 1,
    code_file: str | None = None,
    single: bool = False,
    skip: str | os.PathLike[str] | None = None,
    progress: Callable[[int, Grade | None], None] | None = None,
    skipped: list[str] | None = None,
) -> list[Grade]:
    """Grade every submission in ``source`` (a folder or a zip; with ``single``, one
    student's file or folder); ``skip`` is a folder in ``source`` that is no submission (the
    output folder). ``progress(total, grade)`` is called once with no grade when
    the submissions are known, then once per graded submission. Each entry of ``source``
    that is no submission (``__MACOSX``, the output folder) is a line added to ``skipped``.

    Raises:
        ArchiveError: a zip that cannot be unpacked safely.
        ValueError: ``source`` is no folder or zip, or holds no submission; an isolation not
            available here.
    """
    defines = defined(settings)
    with tempfile.TemporaryDirectory(prefix="qkv-grade-") as work:
        found = collect(
            Path(source),
            Path(work),
            code_file=code_file,
            single=single,
            skip=None if skip is None else Path(skip),
            defines=defines,
            skipped=skipped,
        )
        if progress is not None:
            progress(len(found), None)
        return grade_all(
            found,
            settings,
            jobs=jobs,
            progress=None if progress is None else lambda g: progress(len(found), g),
        )


def check_output(out: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Check that ``out`` may hold this run's files, and only them: it is new or empty, or,
    with ``overwrite``, holds only files an earlier ``qkv grade`` wrote (which the run then
    replaces, removing those it does not write again: a student no longer in the class
    keeps no feedback there).

    Raises:
        OutputError: ``out`` holds files, and ``overwrite`` is not given; or it holds files
            no earlier run wrote (they would be handed out with the grades).
    """
    folder = Path(out)
    if not folder.is_dir():
        return
    present = sorted((p.name for p in folder.iterdir()), key=lambda n: (n.startswith("."), n))
    if not present:
        return
    shown = visible(str(folder))
    if not overwrite:
        raise OutputError(
            f"--output {shown!r} is not empty ({len(present)} entries, e.g. "
            f"{visible(present[0])!r}). Hint: give a new folder, or --overwrite to replace "
            "the grades an earlier run wrote there"
        )
    ours = _earlier_run(folder)
    foreign = [n for n in present if n not in ours and n != _MANIFEST]
    if foreign:
        raise OutputError(
            f"--output {shown!r} holds {visible(foreign[0])!r}, which no earlier qkv grade "
            "wrote; --overwrite replaces only an earlier run's files. Hint: move it away, or "
            "give a new folder"
        )


def _earlier_run(folder: Path) -> set[str]:
    """The names an earlier run wrote into ``folder`` (its list, or, from a qkv that kept
    none, the files of a graded class beside its grades.csv and class.html)."""
    try:
        listed = (folder / _MANIFEST).read_text(encoding="utf-8").splitlines()
        return {n for n in listed if n and "/" not in n and n not in (".", "..")}
    except OSError:
        pass
    names = {p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    if not {"grades.csv", "class.html"} <= names:
        return set()
    return {n for n in names if n.endswith((".json", ".md")) or n in ("grades.csv", "class.html")}


def write_class(
    out: str | os.PathLike[str],
    grades: Sequence[Grade],
    *,
    title: str,
    overwrite: bool = False,
) -> list[str]:
    """Write ``grades.csv``, ``STUDENT.json``, ``STUDENT.md`` and ``class.html`` into the
    folder ``out`` (made if missing); return the names written.

    ``out`` holds only this run's files (:func:`check_output`): it must be new or empty,
    or, with ``overwrite``, an earlier run's, whose files this run does not write again are
    removed.

    All or nothing: every file is written first into a temporary folder inside ``out``, and
    only when all are written are they moved into place; a failure (a full disk) leaves
    ``out`` as it was.

    Raises:
        OutputError: ``out`` holds other files (:func:`check_output`).
        OSError: a file cannot be written (``qkv._io.WriteError``, naming the file).
    """
    folder = Path(out)
    check_output(folder, overwrite=overwrite)
    folder.mkdir(exist_ok=True)
    stale = _earlier_run(folder) if overwrite else set()
    files = {}
    for grade in grades:
        files[f"{grade.student}.json"] = gradescope_json(grade)
        files[f"{grade.student}.md"] = feedback(grade)
    files["class.html"] = class_page(grades, title=title)
    files["grades.csv"] = grades_csv(grades)
    files[_MANIFEST] = "".join(f"{name}\n" for name in files)
    staging = Path(tempfile.mkdtemp(prefix=".qkv-grade-", dir=folder))
    try:
        for name, text in files.items():
            _io.write_atomic(staging / name, text)
        for name in files:
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name in stale - set(files):
        (folder / name).unlink(missing_ok=True)
    return [name for name in files if name != _MANIFEST]
