"""Test configuration: hypothesis profiles, and a fixture that runs PyTorch on one thread.

CI runs the "ci" profile: derandomized, so a run is reproducible; locally, examples are random
so that new cases keep being explored. Select with HYPOTHESIS_PROFILE=ci|dev.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tests run side by side (pytest -n 2): one PyTorch thread each keeps the cores from
    being oversubscribed, which makes many small parallel operations very slow. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
