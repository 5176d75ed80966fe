"""Submissions as a course platform hands them over: a folder or a zip, read safely. A zip
that tries to write outside the folder it is unpacked into, links to the teacher's files or
unpacks to gigabytes is refused in one line, leaving nothing behind; run under a memory and
time limit, as every hostile-input test."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.grade._archive import MAX_ENTRIES, ArchiveError, extract
from qkv.grade._submissions import collect
from tests.support.isolated import run_cli_isolated


def _zip(path: Path, entries: dict[str, bytes], *, links: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, target)
    return path


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"../evil.py": b"x"}, "would be written outside"),
        ({"/etc/evil.py": b"x"}, "would be written outside"),
        ({"ok/../../evil.py": b"x"}, "would be written outside"),
        ({"C:/evil.py": b"x"}, "would be written outside"),
        ({"a.py": b"x", "A/../a.py": b"y"}, "would be written outside"),
    ],
)
def test_zip_slip_is_refused_and_nothing_is_left(
    tmp_path: Path, entries: dict[str, bytes], message: str
) -> None:
    source = _zip(tmp_path / "class.zip", entries)
    with pytest.raises(ArchiveError, match=message):
        extract(source, tmp_path / "out" / "unpacked")
    assert not (tmp_path / "out" / "unpacked").exists()
    assert not (tmp_path / "evil.py").exists()


def test_a_link_in_a_zip_is_refused(tmp_path: Path) -> None:
    source = _zip(tmp_path / "class.zip", {"ada.py": b"x"}, links={"bob.py": "/etc/passwd"})
    with pytest.raises(ArchiveError, match=r"'bob.py' is a link or a special file"):
        extract(source, tmp_path / "unpacked")


def test_a_zip_bomb_is_refused_within_limits(tmp_path: Path) -> None:
    source = tmp_path / "bomb.zip"
    with zipfile.ZipFile(source, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("ada.py", b"\0" * (12 << 20))  # 12 MiB of zeros pack to ~12 KiB
    ((status, err),) = run_cli_isolated(
        [["grade", str(source), "-o", str(tmp_path / "out")]], memory=1 << 30, seconds=120
    )
    assert status == 2
    assert "'ada.py' unpacks to" in err and "times its packed size (a zip bomb?)" in err
    assert not list((tmp_path / "out").glob("*"))


def test_too_many_entries_and_a_file_that_is_not_a_zip(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "many.zip", "w") as archive:
        for i in range(MAX_ENTRIES + 1):
            archive.writestr(f"d{i}/", b"")
    with pytest.raises(ArchiveError, match=rf"{MAX_ENTRIES + 1} entries, more than"):
        extract(tmp_path / "many.zip", tmp_path / "unpacked")
    (tmp_path / "fake.zip").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(ArchiveError, match="not a readable zip file"):
        extract(tmp_path / "fake.zip", tmp_path / "unpacked2")


def test_an_exported_zip_is_unwrapped_to_one_entry_per_student(tmp_path: Path) -> None:
    # Gradescope's export: one wrapper folder, a folder per submission, a metadata file
    source = _zip(
        tmp_path / "export.zip",
        {
            "assignment_export/submission_metadata.yml": b"{}",
            "assignment_export/submission_101/attention.py": b"def attention(Q, K, V): ...",
            "assignment_export/submission_102/attention.py": b"def attention(Q, K, V): ...",
            "assignment_export/__MACOSX/._x": b"",
        },
    )
    found = collect(source, tmp_path / "work")
    assert [(s.student, s.form, s.path.name if s.path else None) for s in found] == [
        ("submission_101", "code", "attention.py"),
        ("submission_102", "code", "attention.py"),
    ]
    # each student's code sits in a private folder of its own, away from the others
    assert found[0].path is not None and found[1].path is not None
    assert found[0].path.parent != found[1].path.parent
    assert list(found[0].path.parent.iterdir()) == [found[0].path]


def test_a_folder_entry_does_not_copy_links_out(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("teacher")
    root = tmp_path / "class" / "ada"
    root.mkdir(parents=True)
    (root / "attention.py").write_text("def attention(Q, K, V): ...")
    (root / "notes.txt").symlink_to(secret)
    (found,) = collect(tmp_path / "class", tmp_path / "work")
    assert found.path is not None
    assert sorted(p.name for p in found.path.parent.iterdir()) == ["attention.py"]


def test_cli_zip_slip_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _zip(tmp_path / "class.zip", {"../evil.py": b"x"})
    assert main(["grade", str(source), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: class.zip: the entry '../evil.py' would be written")
    assert err.count("\n") == 1
    assert not (tmp_path / "evil.py").exists()
