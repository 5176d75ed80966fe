"""Writing files: errors that name the user's file (never a temporary one), with a hint; a
failed write leaves nothing half-written; several outputs are written all or none (issue 12,
items 13 and 16).

The tests run as any user, root included, so an unwritable folder or a full disk is faked by
making the system call fail (``chmod`` does not stop root).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import _io
from qkv.cli import main


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv: error: ") and "Hint:" in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def disk_full(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_names_the_file_and_leaves_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "page.md"
    target.write_text("old", encoding="utf-8")
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="disk is full") as caught:
        _io.write_atomic(target, "new")
    message = str(caught.value)
    assert str(target) in message and "disk is full" in message and "Hint:" in message
    assert ".tmp" not in message
    assert caught.value.errno == errno.ENOSPC
    assert target.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]  # no temporary file


def test_an_unwritable_folder_names_the_users_path_not_a_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out.md"

    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".out.md.x.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert main(["explain", "-o", str(target)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--output" in line and f"{str(target)!r}" in line and "permission denied" in line
    assert ".tmp" not in line
    assert not target.exists()


def test_a_device_is_written_in_place_not_replaced(tmp_path: Path) -> None:
    """``-o /dev/null`` (here a named pipe, to be safe) must stay what it is: renaming a
    temporary file over it would turn it into a plain file."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()), daemon=True)
    reader.start()
    try:
        _io.write_atomic(pipe, "through the pipe")
    finally:
        if reader.is_alive() and not got:  # unblock the reader if nothing opened the pipe
            with open(pipe, "wb"):
                pass
        reader.join(timeout=10)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    assert got == [b"through the pipe"]


def test_html_and_plot_errors_name_their_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["explain", "--plot", str(tmp_path / "weights.pdf")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--plot" in line and ".png" in line

    monkeypatch.setattr(os, "fsync", disk_full)
    assert main(["explain", "--html", str(tmp_path / "page.html")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--html" in line and "page.html" in line and "disk is full" in line
    assert ".tmp" not in line and ".qkv-" not in line
    assert list(tmp_path.iterdir()) == []


def test_several_outputs_are_written_all_or_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qkv import render

    plot, page, text = tmp_path / "w.png", tmp_path / "p.html", tmp_path / "t.md"
    text.write_text("old", encoding="utf-8")

    def too_big(*args: object, **kwargs: object) -> str:
        raise ValueError("the page would hold too many numbers. Hint: keep fewer steps")

    monkeypatch.setattr(render, "html", too_big)
    argv = ["explain", "--plot", str(plot), "--html", str(page), "-o", str(text)]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--html" in line
    assert not plot.exists() and not page.exists()
    assert text.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.md"]  # no temporary file


def test_targets_are_checked_before_any_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "w.png"
    argv = ["explain", "--plot", str(plot), "--html", str(tmp_path / "no" / "p.html")]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--html" in line and "does not exist" in line
    assert not plot.exists()

    assert main(["explain", "--plot", str(plot), "--html", str(plot)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--html" in line and "--plot" in line
    assert not plot.exists()


def test_all_outputs_written_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, page, text = tmp_path / "w.svg", tmp_path / "p.html", tmp_path / "t.md"
    argv = ["explain", "--plot", str(plot), "--html", str(page), "-o", str(text), "-f", "markdown"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert plot.read_text(encoding="utf-8").lstrip().startswith("<?xml")
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert text.read_text(encoding="utf-8").startswith("# ")
    assert err.count("qkv: wrote") == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.html", "t.md", "w.svg"]


FILES = st.sampled_from(["a.md", "b.html", "c.png", "d.svg"])


@given(
    names=st.lists(FILES, min_size=1, max_size=4, unique=True),
    old=st.sets(FILES),
    failing=st.none() | st.integers(0, 3),
)
@settings(max_examples=40, deadline=None)
def test_write_all_writes_every_output_or_none(
    names: list[str], old: set[str], failing: int | None
) -> None:
    """Whatever output fails, and whichever targets existed, the folder ends either with
    every new content or exactly as it was, with no temporary file."""
    from qkv.cli._common import CommandError, Output, write_all

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for name in old:
            (root / name).write_text(f"old {name}", encoding="utf-8")
        before = {p.name: p.read_text(encoding="utf-8") for p in root.iterdir()}

        def writer(index: int, name: str) -> Callable[[Path], None]:
            def write(path: Path) -> None:
                if index == failing:
                    raise OSError(errno.ENOSPC, "No space left on device")
                _io.write_atomic(path, f"new {name}")

            return write

        outputs = [
            Output(f"--out{i}", str(root / name), writer(i, name), "test")
            for i, name in enumerate(names)
        ]
        if failing is not None and failing < len(names):
            with pytest.raises(CommandError, match=f"--out{failing}"):
                write_all(outputs)
            after = {p.name: p.read_text(encoding="utf-8") for p in root.iterdir()}
            assert after == before
        else:
            write_all(outputs)
            after = {p.name: p.read_text(encoding="utf-8") for p in root.iterdir()}
            assert after == {**before, **{name: f"new {name}" for name in names}}
