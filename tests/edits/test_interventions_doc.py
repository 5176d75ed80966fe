"""docs/interventions.md runs as written: its Python examples (doctest) and its commands,
whose printed output must be, line for line, what the page shows. The commands read the
model of tests/support/flip_model.py, the one the page builds by hand: the same numbers in
both prove it."""

from __future__ import annotations

import doctest
import shlex
from pathlib import Path

import pytest

from qkv.cli import main
from tests.support.flip_model import save_flip_model

PAGE = Path(__file__).resolve().parents[2] / "docs" / "interventions.md"
PROMPTS = (
    "the cat sat on the mat\nthe dog ran to the big red house\n"
    "a quick brown fox jumps over the lazy dog\n"
)


def test_the_python_examples_run() -> None:
    result = doctest.testfile(
        str(PAGE),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted >= 40
    assert result.failed == 0


def _console_blocks() -> list[tuple[str, list[str]]]:
    """Each ``console`` block: its command (after ``$ ``) and the lines it shows."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line == "```console":
            current = []
        elif line == "```" and current is not None:
            blocks.append((current[0].removeprefix("$ "), current[1:]))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_commands_print_what_the_page_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    save_flip_model(tmp_path / "flip")
    (tmp_path / "prompts.txt").write_text(PROMPTS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    blocks = _console_blocks()
    assert [command.split()[:2] for command, _ in blocks] == [
        ["qkv", "patch"], ["qkv", "patch"], ["qkv", "patch"], ["qkv", "heads"]
    ]  # fmt: skip
    capsys.readouterr()
    for command, shown in blocks:
        assert main(shlex.split(command)[1:]) == 0
        assert capsys.readouterr().out.splitlines() == shown, command
