"""Shared test set-up: in CI, a skipped test fails unless it is GPU-only (and says why)."""

import os

import pytest

from tqexport.export.artifact import BuildOptions, build_artifact


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and "gpu" not in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI without being GPU-only: {report.longrepr}"


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    built = {}

    def get(model, kv_dtype, skip=(), **kw):
        key = (model, kv_dtype, tuple(skip), tuple(sorted(kw.items())))
        if key not in built:
            out = root / f"{model}-{kv_dtype}-{len(built)}"
            opts = BuildOptions(
                kv_cache_dtype=kv_dtype, skip_layers=list(skip), boundary=False, **kw
            )
            built[key] = build_artifact(model, out, opts).out_dir
        return built[key]

    return get
