"""Shared test set-up: in CI, a skipped test fails unless it is GPU-only (and says why)."""

import hashlib
import os

import pytest
from filelock import FileLock

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
    """``get(model, kv_dtype, skip, **build options)``: the artifact, built once per test run.
    Under pytest-xdist the workers share one directory (a file lock per artifact), so an
    artifact two workers need is built once; tests must not modify them (copy first)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "artifacts"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("artifacts")

    def get(model, kv_dtype, skip=(), **kw):
        key = repr((model, kv_dtype, tuple(skip), tuple(sorted(kw.items()))))
        out = root / f"{model}-{kv_dtype}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        with FileLock(f"{out}.lock"):
            if not (out / "tqexport.json").is_file():
                opts = BuildOptions(
                    kv_cache_dtype=kv_dtype, skip_layers=list(skip), boundary=False, **kw
                )
                build_artifact(model, out, opts)
        return out

    return get
