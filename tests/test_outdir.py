"""Where `build` writes: parents created, --force replaces only artifacts, nothing left behind."""

import os
import shutil
import stat
import subprocess
import sys
from collections import namedtuple

import pytest

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.export import artifact as artifact_module
from tqexport.export import outdir
from tqexport.export.artifact import BuildOptions, build_artifact


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd,
    )  # fmt: skip


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_missing_parents_are_created_and_files_share_one_mode(tmp_path):
    out = tmp_path / "a" / "b" / "art"
    result = build_artifact("tiny-llama", out, BuildOptions())
    assert result.out_dir == out and open_artifact(out).spec.layers
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    mask = os.umask(0)
    os.umask(mask)
    assert set(modes.values()) == {0o666 & ~mask}, modes
    assert tree(tmp_path)[:3] == ["a", "a/b", "a/b/art"]


def test_force_refuses_a_directory_that_is_not_an_artifact(tmp_path):
    victim = tmp_path / "v"
    victim.mkdir()
    (victim / "important.txt").write_text("x")
    r = cli("build", "tiny-llama", "-o", str(victim), "--force")
    assert r.returncode == 2 and "is not a tqexport artifact" in r.stderr, r.stderr
    assert (victim / "important.txt").read_text() == "x"
    assert tree(tmp_path) == ["v", "v/important.txt"]


def test_force_refuses_the_current_directory(artifacts, tmp_path):
    shutil.copytree(artifacts("tiny-llama", "auto"), tmp_path / "art")
    before = tree(tmp_path)
    r = cli("build", "tiny-llama", "-o", ".", "--force", cwd=tmp_path / "art")
    assert r.returncode == 2 and "current directory" in r.stderr, r.stderr
    assert tree(tmp_path) == before


def test_force_replaces_an_artifact_and_an_empty_directory(artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifacts("tiny-llama", "auto"), art)
    assert open_artifact(art).spec.layers[0].kv_cache_dtype == "auto"
    build_artifact("tiny-llama", art, BuildOptions(kv_cache_dtype="fp8", force=True))
    assert open_artifact(art).spec.layers[0].kv_cache_dtype == "fp8"
    empty = tmp_path / "empty"
    empty.mkdir()
    build_artifact("tiny-llama", empty, BuildOptions(force=True))
    assert open_artifact(empty).spec.layers
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_stale_staging_of_dead_builds_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    stale = [tmp_path / f".art.tmp-{dead}", tmp_path / f".art.old-{dead}"]
    other = tmp_path / f".other.tmp-{dead}"
    for p in [*stale, other]:
        p.mkdir()
        (p / "model.onnx").write_bytes(b"partial")
    live = tmp_path / f".art.tmp-{os.getppid()}"  # a running process: left alone
    live.mkdir()
    build_artifact("tiny-llama", tmp_path / "art", BuildOptions())
    assert not any(p.exists() for p in stale)
    assert other.exists() and live.exists()


def test_a_file_in_the_way_is_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(artifact_module, "load_model", pytest.fail)
    with pytest.raises(TQExportError, match="is not a directory"):
        build_artifact("tiny-llama", tmp_path / "f" / "art", BuildOptions())
    with pytest.raises(TQExportError, match="is not a directory"):
        build_artifact("tiny-llama", tmp_path / "f", BuildOptions(force=True))
    assert tree(tmp_path) == ["f"]


def test_unwritable_location_fails_before_loading(tmp_path, monkeypatch):
    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(artifact_module, "load_model", pytest.fail)
    monkeypatch.setattr(outdir.Path, "mkdir", refuse)
    with pytest.raises(TQExportError, match="cannot write into .*Permission denied"):
        build_artifact("tiny-llama", tmp_path / "art", BuildOptions())
    assert tree(tmp_path) == []


def test_full_disk_and_failed_export_leave_nothing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(TQExportError, match="MiB free but the artifact needs"):
        build_artifact("tiny-llama", tmp_path / "x" / "art", BuildOptions())
    assert tree(tmp_path) == []
    monkeypatch.undo()

    def broken(*a, **k):
        raise RuntimeError("export failed")

    monkeypatch.setattr(artifact_module, "export_model", broken)
    with pytest.raises(RuntimeError):
        build_artifact("tiny-llama", tmp_path / "x" / "art", BuildOptions())
    assert tree(tmp_path) == []
