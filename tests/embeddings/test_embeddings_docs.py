"""The examples of docs/embeddings.md run and print what the page says."""

from __future__ import annotations

import doctest
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_embeddings_guide_examples_run() -> None:
    result = doctest.testfile(
        str(DOCS / "embeddings.md"),
        module_relative=False,
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS,
    )
    assert result.attempted > 20
    assert result.failed == 0
