"""Tests that need a CUDA GPU (issue 19): marked ``cuda``; where torch sees no CUDA device
they are skipped, with a reason that names the marker, so ``pytest`` stays green on CPU.

Run them on a GPU machine with ``pytest -m cuda tests/cuda``.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``cuda``-marked test when torch has no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="marker 'cuda': needs a CUDA GPU (torch.cuda.is_available() is False); "
        "run `pytest -m cuda tests/cuda` on a GPU machine"
    )
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
