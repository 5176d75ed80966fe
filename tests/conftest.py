"""Test configuration: hypothesis profiles, seeded random generators, one PyTorch thread.

CI runs the "ci" profile (``.ci/run`` sets HYPOTHESIS_PROFILE=ci; so does a set ``CI``):
derandomized, so a run is reproducible; locally, examples are random so that new cases keep
being explored. Select with HYPOTHESIS_PROFILE=ci|dev. In both, a
failing property prints its falsifying example and an ``@reproduce_failure(...)`` line: paste
that line above the test to replay the exact failure (the printed example alone can round the
numbers of an array, and ``--hypothesis-seed`` alone does not replay examples from the local
database). Neither profile fails a test for slow data generation: on a busy two-core machine
that says nothing about qkv.

Tests that draw from the global generators (``random``, ``numpy.random``, ``torch``) get them
seeded from the test's own name before each test, so what they draw does not depend on which
tests ran before them in the same worker (``pytest -n 2`` shares tests out differently on every
run): a failure comes back when the test is run again, alone or in the suite.
"""

from __future__ import annotations

import os
import random
import sys
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# Hypothesis loads its own derandomized "ci" profile when CI is set, and a profile registered
# without a value inherits the loaded one: so "dev" says derandomize=False itself.
settings.register_profile(
    "dev",
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# auto's compiled path on CPU compiles FlexAttention (tens of seconds per rule and shape) from
# the third call with one rule and shape: only tests/kernels/test_compiled_cpu.py turns it on.
os.environ.setdefault("QKV_AUTO_COMPILE", "0")


@pytest.fixture(autouse=True)
def _seeded_global_generators(request: pytest.FixtureRequest) -> None:
    """Seed ``random``, ``numpy.random`` and (when imported) ``torch`` from the test's id."""
    seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    random.seed(seed)
    np.random.seed(seed)  # the legacy global generator, which such tests draw from
    if "torch" in sys.modules:  # not imported here: numpy-only tests stay free of torch
        sys.modules["torch"].manual_seed(seed)


@pytest.fixture(autouse=True)
def _one_torch_thread_by_default() -> None:
    """Every test starts with one PyTorch thread (once torch is imported): two pytest workers
    on two cores, each with a thread per core, oversubscribe them, and small operations then
    spin for their threads (a flash-attention check: 0.2 s alone, 10 s so). A test that is
    about threads sets its own count; the next test starts from one again. Alone or in the
    suite, a test runs with the same count."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One PyTorch thread for the test even if it imports torch itself (the autouse default
    above applies from the first test after torch's import); the count is restored after.
    Use it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
