"""What CI runs: ``.ci/run`` is its entry point (docs/decisions.md, "Hypothesis is
derandomized in CI")."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import settings

CI_RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"


def test_ci_runs_the_derandomized_hypothesis_profile() -> None:
    script = CI_RUN.read_text(encoding="utf-8").splitlines()
    exported = [i for i, line in enumerate(script) if line == "export HYPOTHESIS_PROFILE=ci"]
    tests = [i for i, line in enumerate(script) if re.fullmatch(r"make test\b.*", line)]
    assert exported and tests and exported[0] < tests[0], script  # set before the tests run
    assert settings.get_profile("ci").derandomize
    assert not settings.get_profile("dev").derandomize
