"""docs/flash_attn.md's examples run and print what the page says."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest

import qkv.flash_attn

PAGE = Path(__file__).resolve().parents[2] / "docs" / "flash_attn.md"


def test_the_migration_page_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qkv.flash_attn._install, "_real_flash_attn", lambda: None)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    try:
        result = doctest.testfile(
            str(PAGE),
            module_relative=False,
            optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
        )
    finally:
        qkv.flash_attn.uninstall()
    assert result.attempted > 15 and result.failed == 0
