"""The submissions of a class: one entry per student, found, named and put in a folder of
its own before anything runs.

SUBMISSIONS is a folder (or a zip, unpacked by :mod:`~qkv.grade._archive`) with one entry
per student: a ``.py`` file, a folder (its code, or one worked example), or a ``.yaml`` /
``.json`` worked example. A student's code can read the folder it runs from, so each ``.py``
file and each folder is copied into a private folder first: no student's code sees another's.
Nothing is followed out of the submissions: a link is a submission that cannot be graded,
as is a file of another kind; every such entry is still a row of the grades.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     root = Path(tmp, "class"); root.mkdir()
    ...     _ = Path(root, "ada.py").write_text("def attention(Q, K, V): ...")
    ...     _ = Path(root, "notes.txt").write_text("hello")
    ...     found = collect(root, Path(tmp, "work"))
    ...     [(s.student, s.form) for s in found]
    [('ada', 'code'), ('notes.txt', 'problem')]
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qkv._format import visible
from qkv._read import size_text
from qkv.grade._archive import extract

__all__ = ["EXAMPLE_SUFFIXES", "Submission", "collect", "student_name"]

EXAMPLE_SUFFIXES = (".yaml", ".yml", ".json")
"""The endings of a worked example handed in."""
_SKIPPED = ("__MACOSX", "__pycache__", "submission_metadata.yml", "Thumbs.db", "desktop.ini")
_MAX_FILES = 200  # files in one student's folder
_MAX_FOLDER = 32 << 20  # bytes in one student's folder
_MAX_CODE = 1 << 20  # bytes of one .py file


@dataclass(frozen=True)
class Submission:
    """One student's entry.

    Attributes:
        student: a name safe as a file name, unique in the class (``ada``, ``ada-2``).
        entry: the entry's name as handed in, control characters written out.
        form: ``"code"`` (``path`` is the .py file, in a private folder), ``"example"``
            (``path`` is the worked example) or ``"problem"`` (``problem`` says why it
            cannot be graded).
        path: the file to grade, or None.
        problem: why the entry cannot be graded, one line.
    """

    student: str
    entry: str
    form: str
    path: Path | None = None
    problem: str = ""


def student_name(entry: str, taken: set[str]) -> str:
    """A file-safe, unique name for a student from their entry's name.

    Example:
        >>> taken = set()
        >>> student_name("Ada Lovelace.py", taken), student_name("Ada_Lovelace.py", taken)
        ('Ada_Lovelace', 'Ada_Lovelace-2')
        >>> student_name("../..", taken)
        'student'
    """
    stem = entry
    for suffix in (".py", *EXAMPLE_SUFFIXES):
        if stem.lower().endswith(suffix) and len(stem) > len(suffix):
            stem = stem[: -len(suffix)]
            break
    name = re.sub(r"[^\w.-]+", "_", stem).strip("._-")[:80] or "student"
    unique, n = name, 1
    while unique.lower() in taken or unique.lower() in ("grades", "class"):
        n += 1
        unique = f"{name}-{n}"
    taken.add(unique.lower())
    return unique


def collect(
    source: Path,
    work: Path,
    *,
    code_file: str | None = None,
    single: bool = False,
    skip: Path | None = None,
) -> list[Submission]:
    """The submissions in ``source`` (a folder or a zip), code copied under ``work``.

    ``single`` takes ``source`` itself as one student's submission (a file or a folder, as
    Gradescope's ``/autograder/submission``). ``code_file`` names the ``.py`` file of a
    folder (default: its only ``.py`` file). ``skip`` is a folder that is no submission
    (the output folder, when it is inside the submissions).

    Raises:
        ArchiveError: a zip that cannot be unpacked safely.
        ValueError: ``source`` is neither a folder, a zip nor (with ``single``) a file.
    """
    work.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    if single:
        return [_one(source, work, taken, code_file)]
    if source.is_file() and zipfile.is_zipfile(source):
        root = work / "unpacked"
        extract(source, root)
        entries = _entries(root)
        while len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
            if any(p.suffix == ".py" for p in entries[0].iterdir()):
                break  # one student's folder, not a wrapper
            entries = _entries(entries[0])
    elif source.is_dir():
        entries = [e for e in _entries(source) if skip is None or not _same(e, skip)]
    else:
        raise ValueError(
            f"SUBMISSIONS {visible(str(source))!r} is not a folder or a zip file. Hint: give "
            "the folder with one .py file, folder or .yaml file per student, or the zip "
            "your course platform exported"
        )
    return [_one(entry, work, taken, code_file) for entry in entries]


def _same(entry: Path, other: Path) -> bool:
    try:
        return entry.resolve() == other.resolve()
    except OSError:
        return False


def _entries(folder: Path) -> list[Path]:
    return sorted(
        (p for p in folder.iterdir() if not p.name.startswith(".") and p.name not in _SKIPPED),
        key=lambda p: p.name,
    )


def _one(entry: Path, work: Path, taken: set[str], code_file: str | None) -> Submission:
    shown = visible(entry.name)
    student = student_name(entry.name, taken)
    info = os.lstat(entry)
    if stat.S_ISLNK(info.st_mode):
        return Submission(
            student,
            shown,
            "problem",
            problem=f"{shown}: is a link; qkv follows "
            "no link out of the submissions. Hint: hand in the file itself",
        )
    if stat.S_ISREG(info.st_mode):
        suffix = entry.suffix.lower()
        if suffix in EXAMPLE_SUFFIXES:
            return Submission(student, shown, "example", entry)
        if suffix == ".py":
            if info.st_size > _MAX_CODE:
                return Submission(student, shown, "problem", problem=_too_large(shown, _MAX_CODE))
            private = work / "code" / student
            private.mkdir(parents=True)
            shutil.copyfile(entry, private / entry.name)
            return Submission(student, shown, "code", private / entry.name)
    if stat.S_ISDIR(info.st_mode):
        return _folder(entry, work, student, shown, code_file)
    return Submission(
        student,
        shown,
        "problem",
        problem=f"{shown}: not a .py file, a folder or a .yaml worked example. Hint: each "
        "student hands in attention.py (or a folder with it), or a worked example",
    )


def _folder(entry: Path, work: Path, student: str, shown: str, code_file: str | None) -> Submission:
    top = [p for p in entry.iterdir() if not p.name.startswith(".") and p.is_file()]
    code = sorted(p for p in top if p.suffix == ".py" and not p.is_symlink())
    examples = sorted(p for p in top if p.suffix.lower() in EXAMPLE_SUFFIXES and not p.is_symlink())
    if code_file is not None:
        code = [p for p in code if p.name == code_file]
        if not code:
            return Submission(
                student,
                shown,
                "problem",
                problem=f"{shown}: no file "
                f"{visible(code_file)!r} in it. Hint: check --file, or the "
                "student named the file otherwise",
            )
    if not code:
        if len(examples) == 1:
            return Submission(student, shown, "example", examples[0])
        return Submission(
            student,
            shown,
            "problem",
            problem=f"{shown}: a folder with no .py "
            "file (and not one worked example). Hint: the student hands in "
            "attention.py",
        )
    if len(code) > 1:
        names = ", ".join(visible(p.name) for p in code[:5])
        return Submission(
            student,
            shown,
            "problem",
            problem=f"{shown}: {len(code)} .py files "
            f"({names}); which one holds the function? Hint: give --file NAME.py",
        )
    private = work / "code" / student
    problem = _copy_folder(entry, private, shown)
    if problem:
        return Submission(student, shown, "problem", problem=problem)
    return Submission(student, shown, "code", private / code[0].name)


def _copy_folder(source: Path, target: Path, shown: str) -> str:
    """Copy a student's folder without links or special files; a problem line, or ''."""
    files, size = 0, 0
    target.mkdir(parents=True)
    for folder, subfolders, names in os.walk(source, followlinks=False):
        here = Path(folder)
        rel = here.relative_to(source)
        subfolders[:] = [d for d in subfolders if not (here / d).is_symlink()]
        for d in subfolders:
            (target / rel / d).mkdir()
        for n in names:
            path = here / n
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode):
                continue  # links and special files stay behind
            files += 1
            size += info.st_size
            if files > _MAX_FILES or size > _MAX_FOLDER:
                return (
                    f"{shown}: the folder holds more than {_MAX_FILES} files or "
                    f"{size_text(_MAX_FOLDER)}. Hint: hand in the code only"
                )
            shutil.copyfile(path, target / rel / n, follow_symlinks=False)
    return ""


def _too_large(shown: str, limit: int) -> str:
    return f"{shown}: larger than {size_text(limit)}. Hint: hand in the code only"
