"""Test configuration: hypothesis profiles.

CI runs the "ci" profile: derandomized, so a run is reproducible; locally, examples are random
so that new cases keep being explored. Select with HYPOTHESIS_PROFILE=ci|dev.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
