"""The examples in the user docs run and print what the docs say."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("name", ["attention.md"])
def test_doc_examples_run(name: str) -> None:
    result = doctest.testfile(
        str(DOCS / name),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted > 10
    assert result.failed == 0
