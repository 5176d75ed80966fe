"""Hostile inputs to ``qkv patch`` and ``qkv heads``, in a child under a memory and time
limit: a device or a huge file as --texts, too many prompts, a prompt longer than the
model's positions, control characters and markup as tokens. Each is one line, exit 2, and
the outside text in it is written out visibly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf_models import save_tiny
from tests.support.isolated import run_cli_isolated

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("gpt2", tmp_path_factory.mktemp("hostile") / "gpt2")


def test_hostile_texts_files_are_refused_in_one_line(folder: Path, tmp_path: Path) -> None:
    huge = tmp_path / "huge.txt"
    huge.write_text("the cat\n" * 200_000, encoding="utf-8")  # 1.6 MB
    many = tmp_path / "many.txt"
    many.write_text("the cat\n" * 1001, encoding="utf-8")
    long = tmp_path / "long.txt"
    long.write_text("the " * 100 + "\n", encoding="utf-8")  # GPT-2 here has 64 positions
    runs = [
        ["heads", "--hf", str(folder), "--texts", "/dev/zero"],
        ["heads", "--hf", str(folder), "--texts", str(huge)],
        ["heads", "--hf", str(folder), "--texts", str(many)],
        ["heads", "--hf", str(folder), "--texts", str(long)],
        ["heads", "--hf", str(folder), "--texts", str(tmp_path)],
    ]
    expected = [
        "is not a regular file",
        "more than the 1.0 MB a file of prompts may hold",
        "holds 1001 prompts, more than 1000",
        "--texts line 1: text: 100 tokens, more than the 64 positions",
        "is a directory",
    ]
    for (status, err), message in zip(run_cli_isolated(runs, seconds=120), expected, strict=True):
        assert status == 2, err
        assert message in err and err.count("\n") == 1, err


def test_hostile_tokens_are_written_out_visibly(folder: Path) -> None:
    base = ["patch", "--hf", str(folder), "--clean", "the cat", "--corrupt", "the dog"]
    runs = [
        [*base, "--answer", "\x1b]0;pwned\x07"],
        [*base, "--answer", "cat", "--wrong", "<script>alert(1)</script>\u202e"],
        [*base[:4], "the cat sat", "--corrupt", "\x1b[2Jthe", "--answer", "cat"],
    ]
    results = run_cli_isolated(runs, seconds=120)
    for status, err in results:
        assert status == 2 and err.count("\n") == 1, err
        assert "\x1b" not in err and "\u202e" not in err and "\x07" not in err, err
    assert "\\x1b]0;pwned\\x07" in results[0][1]
    assert "<script>alert(1)</script>\\u202e" in results[1][1]
    assert "--corrupt has 2 tokens and --clean 3" in results[2][1]
