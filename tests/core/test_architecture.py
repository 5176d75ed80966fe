"""docs/architecture.md is true (issue 36 §3, §6): its table of layers names every module
of ``src/qkv`` and only files that exist, its paths in ``tests/`` exist, each extension
point of "Where to add things" lists at most two files in ``src/``, one in ``docs/`` and
one in ``tests/``, all of which exist, and no layer below the CLI leans on the package
face (``import qkv``)."""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

import qkv

ROOT = Path(__file__).parents[2]
SRC = Path(qkv.__file__).parent
PAGE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def _layer_rows() -> list[tuple[list[str], str]]:
    """(the packages a row names, the row's text) of the table of layers."""
    section = PAGE.split("## The layers, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first, rest = line.strip("|").split("|", 1)
            rows.append((re.findall(r"`([\w.]+)`", first), rest))
    return rows


def test_the_layer_table_names_every_module_of_qkv() -> None:
    named = {name for packages, _ in _layer_rows() for name in packages}
    modules = {
        path.stem if path.is_file() else path.name
        for path in SRC.iterdir()
        if (path.suffix == ".py" and path.stem not in ("__init__", "__main__"))
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert sorted(modules - named) == []


def test_every_file_the_layer_table_names_exists_in_its_layer() -> None:
    missing = []
    for packages, text in _layer_rows():
        folders = [SRC / p for p in packages if (SRC / p).is_dir()] or [SRC]
        for name in re.findall(r"`(_[\w*]+\.py)`", text):
            if not any(list(folder.glob(name)) for folder in folders):
                missing.append(f"{name} in {packages}")
    assert missing == []


def test_every_path_in_tests_the_page_names_exists() -> None:
    paths = set(re.findall(r"`(tests/[\w/*.]+)`", PAGE))
    assert paths, "the page names test files"
    assert sorted(p for p in paths if not list(ROOT.glob(p.rstrip("/")))) == []


def _entry(title: str) -> str:
    section = PAGE.split("## Where to add things", 1)[1].split("\n## ", 1)[0]
    start = section.index(f"- **{title}**")
    end = section.find("\n- **", start + 1)
    return section[start : end if end > 0 else None]


ENTRIES = {
    "A backend": ("BACKENDS", "attention/_backends.py"),
    "A mask rule": ("RULES", "masks/_builtin.py"),
    "A kind of edit": ("EDITS", "edits/_specs.py"),
    "A slip code of attention code": ("CODES", "check/_function_codes.py"),
    "A slip code of FlashAttention code": ("FLASH_CODES", "check/_flash_codes.py"),
    "A kind of submission for `qkv grade`": ("KINDS", "grade/_kinds.py"),
}


@pytest.mark.parametrize("title", ENTRIES)
def test_each_extension_point_lists_few_files_that_exist(title: str) -> None:
    """At most two files in src/ (the registry and the implementation), one in docs/, one
    in tests/: the checklist a newcomer follows, each path real."""
    registry, home = ENTRIES[title]
    entry = _entry(title)
    assert f"(registry: `{registry}` in `{home}`)" in entry
    files = re.findall(r"`([\w/.*]+)`", entry.split("Files:", 1)[1].split("\n  -", 1)[0])
    by_top = {
        top: [f for f in files if f.startswith(top + "/")] for top in ("src", "docs", "tests")
    }
    assert len(by_top["src"]) <= 2 and len(by_top["docs"]) <= 1 and len(by_top["tests"]) <= 1
    assert sum(map(len, by_top.values())) == len(files), files
    assert [f for f in files if not list(ROOT.glob(f))] == []


def test_the_newcomers_changes_touched_only_what_the_checklists_name() -> None:
    """The table of the four changes made from the checklists alone (issue 36): each
    touched at most four files, all named by its checklist."""
    record = PAGE.split("<!-- newcomer -->", 1)[1].split("<!-- /newcomer -->", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in record.strip().splitlines()[2:]
    ]
    assert len(rows) == 4
    for change, checklist, files, run_by in rows:
        assert checklist in ENTRIES and run_by, change
        entry = _entry(checklist)
        allowed = re.findall(r"`([\w/.*]+)`", entry.split("Files:", 1)[1].split("\n  -", 1)[0])
        touched = re.findall(r"`([\w/.]+)`", files)
        assert 0 < len(touched) <= 4, change
        outside = [f for f in touched if not any(fnmatch(f, a) or f.startswith(a) for a in allowed)]
        assert outside == [], change


def test_no_layer_below_the_cli_imports_the_package_face() -> None:
    """``import qkv`` inside qkv made render/_lab.py lean on the front door; each layer
    imports the layers it needs."""
    top = {p.stem for p in SRC.iterdir()} | {p.name for p in SRC.iterdir() if p.is_dir()}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where.startswith("cli/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(a.name == "qkv" for a in node.names):
                found.append(f"{where}:{node.lineno}")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "qkv"
                and node.level == 0
                and any(a.name not in top for a in node.names)
            ):
                found.append(f"{where}:{node.lineno}")
    assert found == []
