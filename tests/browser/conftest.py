"""Fixtures of the browser tests: one Chromium per module, one tab per test."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.browser import CHROMIUM, Browser, Tab


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM}: the browser test cannot run. "
            "Hint: run `make test` (it installs Chromium), or "
            "`apt-get update && apt-get install -y chromium`, or set QKV_CHROMIUM."
        )
    profile = Path(tempfile.mkdtemp(prefix="qkv-chromium-"))
    chromium = Browser(CHROMIUM, profile)
    try:
        yield chromium
    finally:
        chromium.close()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def tab(browser: Browser) -> Iterator[Tab]:
    page = Tab(browser)
    try:
        yield page
    finally:
        page.close()
