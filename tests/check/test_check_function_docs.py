"""docs/check-function.md runs: every file it shows is written, every ``$ qkv ...`` command
of its console blocks is run on them, and prints what the page says, with the exit status
``$ echo $?`` shows; the autograder's failure is the page's ``E   `` lines.

The page shows ``isolation: bubblewrap`` (``make test`` installs it); on a machine without
it the line names the level that ran, and only that line may differ."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from qkv.check._sandbox import choose
from qkv.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "check-function.md"
TEXT = DOC.read_text(encoding="utf-8")
FILES = {
    m.group(1): m.group(2) for m in re.finditer(r"```python\n# (\w+\.py)\n(.*?)```", TEXT, re.S)
}
CONSOLES = re.findall(r"```console\n(.*?)```", TEXT, re.S)


def _steps(block: str) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, body in FILES.items():
        (tmp_path / name).write_text(f"# {name}\n{body}", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for name in ("COLUMNS", "LINES", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_page_shows_files_and_commands() -> None:
    assert {"attention.py", "gqa.py", "mha.py", "notebook.py", "loop.py"} <= set(FILES)
    assert len(CONSOLES) >= 5


@pytest.mark.parametrize("block", CONSOLES, ids=lambda b: shlex.split(b.split("\n")[0])[3])
def test_each_console_block_prints_what_the_page_says(
    folder: Path, capsys: pytest.CaptureFixture[str], block: str
) -> None:
    status = None
    for command, expected in _steps(block):
        if command == "echo $?":
            assert [str(status)] == expected
            continue
        argv = shlex.split(command)
        assert argv[0] == "qkv"
        status = main(argv[1:])
        out, err = capsys.readouterr()
        here = f"isolation: {choose('auto')}"
        wanted = [here if line == "isolation: bubblewrap" else line for line in expected]
        assert (out + err).splitlines() == wanted, out + err


def test_the_autograder_fails_with_the_lines_the_page_shows(folder: Path) -> None:
    spec = importlib.util.spec_from_file_location("docs_test_attention", "test_attention.py")
    assert spec is not None and spec.loader is not None
    autograder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(autograder)
    with pytest.raises(AssertionError) as caught:
        autograder.test_attention()
    shown = re.search(r"```text\n(E   .*?)```", TEXT, re.S)
    assert shown is not None
    wanted = [line.removeprefix("E   ") for line in shown.group(1).splitlines()]
    assert f"AssertionError: {caught.value}".splitlines() == wanted
