"""Shared test set-up: in CI, a skipped test fails unless it is GPU-only (and says why)."""

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and "gpu" not in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI without being GPU-only: {report.longrepr}"
