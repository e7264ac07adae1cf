"""Shared test set-up: in CI, a skipped test fails unless it is GPU-only (and says why)."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from tqexport.export.artifact_build import build_artifact
from tqexport.spec import BuildRequest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and "gpu" not in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI without being GPU-only: {report.longrepr}"


def _artifacts_root(tmp_path_factory) -> Path:
    """One folder for the run's artifacts: the controller's temp folder under pytest-xdist (its
    workers' folders sit inside it), the run's own otherwise."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "artifacts"


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """``get(model, kv_dtype, skip, **build options)``: the artifact, built once per test run.
    Under pytest-xdist the workers share one directory (a file lock per artifact), so an
    artifact two workers need is built once; tests must not modify them (copy first)."""
    root = _artifacts_root(tmp_path_factory)
    root.mkdir(exist_ok=True)

    def get(model, kv_dtype, skip=(), **kw):
        key = repr((model, kv_dtype, tuple(skip), tuple(sorted(kw.items()))))
        out = root / f"{model}-{kv_dtype}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        with FileLock(f"{out}.lock"):
            if not (out / "tqexport.json").is_file():
                opts = BuildRequest(
                    kv_cache_dtype=kv_dtype, skip_layers=list(skip), boundary=False, **kw
                )
                build_artifact(model, out, opts)
        return out

    return get


def pytest_sessionfinish(session):
    """The run's artifacts go when the run ends (the controller's hook runs after every
    worker's): kept, the real models' would fill the disk over a few runs."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_artifacts_root(factory), ignore_errors=True)
