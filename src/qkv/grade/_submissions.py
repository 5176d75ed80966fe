"""The submissions of a class: one entry per student, found, named and put in a folder of
its own before anything runs.

SUBMISSIONS is a folder (or a zip, unpacked by :mod:`~qkv.grade._archive`) with one entry
per student: a ``.py`` file, a folder (its code, with any helper modules, or one worked
example), or a ``.yaml`` / ``.json`` worked example. A student's code can read the folder it
runs from, so each ``.py`` file and each folder is copied into a private folder first: no
student's code sees another's. Nothing is followed out of the submissions: a link is a
submission that cannot be graded, as is a file of another kind; every such entry is still a
row of the grades, named by its own name. An entry that is no submission (macOS's
``__MACOSX``, ``.DS_Store``, the output folder) is a line in ``skipped``.

What course platforms export works as it is:

- a zip whose only top folder holds the submissions (``zip -r class.zip export/``) is
  unwrapped;
- Gradescope's export: a folder ``submission_NNN`` per submission, named by the submitters
  in ``submission_metadata.yml``;
- Canvas: ``lastfirst_12345_67890_attention.py`` (``lastfirst_late_...`` when late); a
  student's several files become one folder, under the names they handed in;
- Moodle: ``Full Name_12345_assignsubmission_file_attention.py``, or a folder
  ``Full Name_12345_assignsubmission_file_`` per student.

The platform's id of the student is kept (:attr:`Submission.student_id`).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     root = Path(tmp, "class"); root.mkdir()
    ...     _ = Path(root, "ada.py").write_text("def attention(Q, K, V): ...")
    ...     _ = Path(root, "lovelacebo_late_4242_9001_attention.py").write_text("x = 1")
    ...     _ = Path(root, "notes.txt").write_text("hello")
    ...     _ = Path(root, ".DS_Store").write_text("")
    ...     skipped = []
    ...     found = collect(root, Path(tmp, "work"), skipped=skipped)
    >>> [(s.student, s.student_id, s.form) for s in found]
    [('ada', '', 'code'), ('lovelacebo', '4242', 'code'), ('notes.txt', '', 'problem')]
    >>> skipped
    [".DS_Store: macOS's folder settings, not a submission"]
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import stat
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from qkv._format import visible
from qkv._read import read_bytes, size_text
from qkv.grade._archive import extract

__all__ = ["EXAMPLE_SUFFIXES", "Submission", "collect", "lms_name", "student_name"]

EXAMPLE_SUFFIXES = (".yaml", ".yml", ".json")
"""The endings of a worked example handed in."""
_NOT_SUBMISSIONS = {
    "__MACOSX": "macOS's zip metadata",
    "__pycache__": "Python's compiled files",
    "submission_metadata.yml": "Gradescope's list of submitters (read for the students' names)",
    "Thumbs.db": "Windows' thumbnails",
    "desktop.ini": "Windows' folder settings",
    ".DS_Store": "macOS's folder settings",
    ".git": "a git repository's history",
    ".ipynb_checkpoints": "Jupyter's checkpoints",
}
_METADATA = "submission_metadata.yml"
_MAX_FILES = 200  # files in one student's folder
_MAX_FOLDER = 32 << 20  # bytes in one student's folder
_MAX_CODE = 1 << 20  # bytes of one .py file
_MAX_METADATA = 4 << 20
_CANVAS = re.compile(r"^(?P<name>[^_\s]+)_(?:late_)?(?P<id>\d+)_(?P<sub>\d+)_(?P<file>.+)$")
_MOODLE = re.compile(
    r"^(?P<name>.+?)_(?P<id>\d+)_assignsubmission_(?:file|onlinetext)(?:_(?P<file>.*))?$"
)


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
        problem: why the entry cannot be graded, one line the student reads.
        student_id: the course platform's id of the student (Canvas, Moodle, Gradescope's
            ``sid``), or empty.
    """

    student: str
    entry: str
    form: str
    path: Path | None = None
    problem: str = ""
    student_id: str = ""


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
    while unique.lower() in taken or unique.lower() in ("grades", "class", "results"):
        n += 1
        unique = f"{name}-{n}"
    taken.add(unique.lower())
    return unique


def lms_name(entry: str) -> tuple[str, str, str] | None:
    """(student, id, name as handed in) of an entry named by Canvas or Moodle, else None.

    Example:
        >>> lms_name("lovelaceada_late_12345_67890_attention-1.py")
        ('lovelaceada', '12345', 'attention.py')
        >>> lms_name("Ada Lovelace_12345_assignsubmission_file_attention.py")
        ('Ada Lovelace', '12345', 'attention.py')
        >>> lms_name("Ada Lovelace_12345_assignsubmission_file_")
        ('Ada Lovelace', '12345', '')
        >>> lms_name("ada_lovelace.py") is None
        True
    """
    found = _MOODLE.match(entry)
    if found:
        return found["name"].strip(), found["id"], found["file"] or ""
    found = _CANVAS.match(entry)
    if found:
        # Canvas numbers a file handed in again: attention-1.py
        handed = re.sub(r"-\d+(\.[^.]+)$", r"\1", found["file"])
        return found["name"], found["id"], handed
    return None


def collect(
    source: Path,
    work: Path,
    *,
    code_file: str | None = None,
    single: bool = False,
    skip: Path | None = None,
    defines: str | None = None,
    skipped: list[str] | None = None,
) -> list[Submission]:
    """The submissions in ``source`` (a folder or a zip), code copied under ``work``.

    ``single`` takes ``source`` itself as one student's submission (a file or a folder, as
    Gradescope's ``/autograder/submission``). ``code_file`` names the ``.py`` file of a
    folder; without it, a folder's code is its only ``.py`` file, or the one that defines
    ``defines`` (the function or class the assignment asks for; read, not run), the others
    being its helpers. ``skip`` is a folder that is no submission (the output folder, when
    it is inside the submissions). Each entry that is no submission is a line added to
    ``skipped``.

    Raises:
        ArchiveError: a zip that cannot be unpacked safely.
        ValueError: ``source`` is neither a folder, a zip nor (with ``single``) a file, or
            it holds no submission.
    """
    work.mkdir(parents=True, exist_ok=True)
    notes = skipped if skipped is not None else []
    taken: set[str] = set()
    if single:
        return [_one(source, work, taken, code_file, defines)]
    shown = visible(str(source))
    if source.is_file() and zipfile.is_zipfile(source):
        root = work / "unpacked"
        extract(source, root)
        root = _unwrap(root, defines)
    elif source.is_dir():
        root = source
    else:
        raise ValueError(
            f"SUBMISSIONS {shown!r} is not a folder or a zip file. Hint: give "
            "the folder with one .py file, folder or .yaml file per student, or the zip "
            "your course platform exported"
        )
    entries = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if skip is not None and _same(entry, skip):
            notes.append(f"{visible(entry.name)}: the output folder, not a submission")
        elif why := _not_a_submission(entry.name):
            notes.append(f"{visible(entry.name)}: {why}, not a submission")
        else:
            entries.append(entry)
    if not entries:
        raise ValueError(
            f"SUBMISSIONS {shown!r} holds no submission (it is empty"
            f"{', but for ' + str(len(notes)) + ' entries that are none' if notes else ''}). "
            "Hint: give the folder or zip with one .py file, folder or .yaml file per student"
        )
    people = _gradescope_names(root, notes)
    return _units(entries, work, taken, code_file, defines, people)


def _not_a_submission(name: str) -> str:
    """Why an entry is no submission (a platform's or a system's file), or ''."""
    if name in _NOT_SUBMISSIONS:
        return _NOT_SUBMISSIONS[name]
    if name.startswith("._"):
        return "macOS's record of a file's attributes"
    if "_assignsubmission_onlinetext" in name:
        return "Moodle's online text of a student (the code is in the file submission)"
    return ""


def _units(
    entries: Sequence[Path],
    work: Path,
    taken: set[str],
    code_file: str | None,
    defines: str | None,
    people: dict[str, tuple[str, str]],
) -> list[Submission]:
    """One submission per student: an entry, or a Canvas or Moodle student's files together."""
    units: list[tuple[Path | list[tuple[Path, str]], str | None, str]] = []
    groups: dict[tuple[str, str], list[tuple[Path, str]]] = {}
    for entry in entries:
        lms = lms_name(entry.name)
        if entry.name in people:
            units.append((entry, *people[entry.name]))
        elif lms is not None and stat.S_ISREG(os.lstat(entry).st_mode) and lms[2]:
            key = (lms[0], lms[1])
            if key not in groups:
                groups[key] = []
                units.append((groups[key], lms[0], lms[1]))
            groups[key].append((entry, lms[2]))
        elif lms is not None and entry.is_dir() and not entry.is_symlink():
            units.append((entry, lms[0], lms[1]))
        else:
            units.append((entry, None, ""))
    found = []
    for i, (what, name, sid) in enumerate(units):
        if isinstance(what, Path):
            found.append(_one(what, work, taken, code_file, defines, name=name, student_id=sid))
            continue
        # a Canvas or Moodle student's files, under the names they handed in (a file handed
        # in again replaces the earlier one: the platform lists them in order)
        folder = work / "handed-in" / str(i)
        folder.mkdir(parents=True)
        for path, handed in what:
            safe = handed if _plain_name(handed) else re.sub(r"[^\w.-]+", "_", handed)
            shutil.copyfile(path, folder / (safe.lstrip(".") or "file"), follow_symlinks=False)
        shown = visible(what[0][0].name)
        found.append(
            _one(folder, work, taken, code_file, defines, name=name, student_id=sid, shown=shown)
        )
    return found


def _plain_name(name: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]{1,100}", name)) and name not in (".", "..")


def _gradescope_names(root: Path, notes: list[str]) -> dict[str, tuple[str, str]]:
    """Gradescope's export: submission folder → (the submitters' names, their ids)."""
    path = root / _METADATA
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return {}
    except OSError:
        return {}
    try:
        text = read_bytes(path, limit=_MAX_METADATA, what="Gradescope's metadata").decode()
        data: Any = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError, RecursionError):
        notes.append(
            f"{_METADATA}: unreadable, so Gradescope's submissions are named by their folders"
        )
        return {}
    if not isinstance(data, dict):
        return {}
    names: dict[str, tuple[str, str]] = {}
    for folder, info in data.items():
        if not isinstance(folder, str) or not isinstance(info, dict):
            continue
        submitters = info.get(":submitters", info.get("submitters"))
        if not isinstance(submitters, list):
            continue
        people = [s for s in submitters if isinstance(s, dict)]
        who = [_field(s, "name") for s in people]
        ids = [_field(s, "sid") for s in people]
        if any(who):
            number = folder.rpartition("_")[2]
            names[folder] = (
                " & ".join(w for w in who if w),
                ";".join(i for i in ids if i) or number,
            )
    return names


def _field(person: dict[Any, Any], key: str) -> str:
    value = person.get(f":{key}", person.get(key))
    return "" if value is None or isinstance(value, dict | list) else str(value).strip()[:200]


def _unwrap(root: Path, defines: str | None) -> Path:
    """The folder of a zip that holds the submissions: a lone top folder that wraps them
    (``zip -r class.zip export/``) is entered, one student's lone folder is not."""
    while True:
        entries = [p for p in root.iterdir() if not _not_a_submission(p.name)]
        if len(entries) != 1 or not entries[0].is_dir() or entries[0].is_symlink():
            return root
        if not _wrapper(entries[0], defines):
            return root
        root = entries[0]


def _wrapper(folder: Path, defines: str | None) -> bool:
    """Whether a lone folder holds a class's submissions rather than one student's files."""
    entries = [p for p in folder.iterdir() if not _not_a_submission(p.name)]
    if (folder / _METADATA).is_file() or any(lms_name(p.name) for p in entries):
        return True
    files = [p for p in entries if p.is_file() and not p.is_symlink()]
    if not files:
        return True  # only folders: one per student
    code = [p for p in files if p.suffix == ".py"]
    examples = [p for p in files if p.suffix.lower() in EXAMPLE_SUFFIXES]
    if len(examples) > 1 and not code:
        return True  # a student hands in one worked example
    return defines is not None and sum(_defines(p, defines) is True for p in code) > 1


def _same(entry: Path, other: Path) -> bool:
    try:
        return entry.resolve() == other.resolve()
    except OSError:
        return False


def _one(
    entry: Path,
    work: Path,
    taken: set[str],
    code_file: str | None,
    defines: str | None,
    *,
    name: str | None = None,
    student_id: str = "",
    shown: str | None = None,
) -> Submission:
    shown = shown or visible(entry.name)
    student = student_name(name or entry.name, taken)
    info = os.lstat(entry)
    if stat.S_ISLNK(info.st_mode):
        return Submission(
            student,
            shown,
            "problem",
            problem=f"{shown}: is a link; qkv follows "
            "no link out of the submissions. Hint: hand in the file itself",
            student_id=student_id,
        )
    if stat.S_ISREG(info.st_mode):
        suffix = entry.suffix.lower()
        if suffix in EXAMPLE_SUFFIXES:
            return Submission(student, shown, "example", entry, student_id=student_id)
        if suffix == ".py":
            if info.st_size > _MAX_CODE:
                return Submission(
                    student, shown, "problem", problem=_too_large(shown, _MAX_CODE),
                    student_id=student_id,
                )  # fmt: skip
            private = work / "code" / student
            private.mkdir(parents=True)
            shutil.copyfile(entry, private / entry.name, follow_symlinks=False)
            return Submission(student, shown, "code", private / entry.name, student_id=student_id)
    if stat.S_ISDIR(info.st_mode):
        found = _folder(entry, work, student, shown, code_file, defines)
        return Submission(
            found.student, found.entry, found.form, found.path, found.problem, student_id
        )
    return Submission(
        student,
        shown,
        "problem",
        problem=f"{shown}: not a .py file, a folder or a .yaml worked example. Hint: "
        "hand in your attention .py file (or a folder with it), or a worked example",
        student_id=student_id,
    )


def _folder(
    entry: Path, work: Path, student: str, shown: str, code_file: str | None, defines: str | None
) -> Submission:
    top = [p for p in entry.iterdir() if not _not_a_submission(p.name) and p.is_file()]
    code = sorted(p for p in top if p.suffix == ".py" and not p.is_symlink())
    examples = sorted(p for p in top if p.suffix.lower() in EXAMPLE_SUFFIXES and not p.is_symlink())
    if code_file is not None:
        code = [p for p in code if p.name == code_file]
        if not code:
            return Submission(
                student,
                shown,
                "problem",
                problem=f"{shown}: no file {visible(code_file)!r} in it. Hint: the assignment "
                f"asks for your code in {visible(code_file)}",
            )
    if not code:
        if len(examples) == 1:
            return Submission(student, shown, "example", examples[0])
        return Submission(
            student,
            shown,
            "problem",
            problem=f"{shown}: a folder with no .py "
            "file (and not one worked example). Hint: hand in your attention .py file",
        )
    if len(code) > 1:
        picked = _picked(code, defines)
        if isinstance(picked, str):
            return Submission(student, shown, "problem", problem=f"{shown}: {picked}")
        code = [picked]
    private = work / "code" / student
    problem = _copy_folder(entry, private, shown)
    if problem:
        return Submission(student, shown, "problem", problem=problem)
    return Submission(student, shown, "code", private / code[0].name)


def _picked(code: list[Path], defines: str | None) -> Path | str:
    """The file of several that defines ``defines`` (the others are its helpers), or why
    none can be picked."""
    names = ", ".join(visible(p.name) for p in code[:5])
    if defines is None:
        return f"{len(code)} .py files ({names}), and a worked example was expected"
    verdicts = [_defines(p, defines) for p in code]
    defining = [p for p, v in zip(code, verdicts, strict=True) if v is True]
    if len(defining) == 1:
        return defining[0]
    unreadable = [p for p, v in zip(code, verdicts, strict=True) if v is None]
    if not defining and len(unreadable) == 1:
        return unreadable[0]  # checked, so that the student reads its error
    if defining:
        both = ", ".join(visible(p.name) for p in defining[:5])
        return (
            f"{len(defining)} files define {defines!r} ({both}); which one is your answer? "
            f"Hint: define {defines} in one file, and import it in the others"
        )
    return (
        f"{len(code)} .py files ({names}), and none defines {defines!r}. Hint: the assignment "
        f"asks for {defines}; define it in one of your files"
    )


def _defines(path: Path, name: str) -> bool | None:
    """Whether the module ``path`` defines ``name`` at its top level (a def, a class, an
    assignment or an import; read with ``ast``, never run); None when it cannot be read."""
    try:
        if os.lstat(path).st_size > _MAX_CODE:
            return None
        tree = ast.parse(path.read_bytes(), filename=path.name)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return _binds(tree.body, name)


def _binds(body: list[ast.stmt], name: str) -> bool:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name) and leaf.id == name:
                        return True
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any((a.asname or a.name.partition(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            if _binds(inner, name):
                return True
    return False


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
