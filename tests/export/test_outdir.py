"""Where `build` writes: parents created, --force replaces only artifacts, nothing left behind."""

import os
import re
import shutil
import stat
import subprocess
import sys
from collections import namedtuple

import pytest

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.export import artifact_build as artifact_module
from tqexport.export import outdir
from tqexport.export import source as source_module
from tqexport.export.artifact_build import build_artifact
from tqexport.spec import BuildRequest


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd,
    )  # fmt: skip


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_missing_parents_are_created_and_files_share_one_mode(tmp_path):
    out = tmp_path / "a" / "b" / "art"
    result = build_artifact("tiny-llama", out, BuildRequest())
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
    assert r.returncode == 2, r.stderr
    assert f"{victim} is not a tqexport artifact (it holds important.txt)" in r.stderr, r.stderr
    assert (victim / "important.txt").read_text() == "x"
    assert tree(tmp_path) == ["v", "v/important.txt"]


def test_force_refuses_the_current_directory(artifacts, tmp_path):
    shutil.copytree(artifacts("tiny-llama", "auto"), tmp_path / "art")
    before = tree(tmp_path)
    r = cli("build", "tiny-llama", "-o", ".", "--force", cwd=tmp_path / "art")
    assert r.returncode == 2 and "current directory" in r.stderr, r.stderr
    assert tree(tmp_path) == before


def test_force_replaces_an_artifact_and_an_empty_directory_and_says_so(artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifacts("tiny-llama", "auto"), art)
    assert open_artifact(art).spec.layers[0].kv_cache_dtype == "auto"
    assert sorted(os.listdir(art)) == [
        "generation_config.json", "model.onnx", "model.onnx.data", "tqexport.files.json",
        "tqexport.json",
    ]  # fmt: skip
    r = cli("build", "tiny-llama", "-o", str(art), "--kv-cache-dtype", "fp8", "--force")
    assert r.returncode == 0, r.stderr
    assert f"replaced the artifact that was in {art} (5 files)\n" in r.stdout, r.stdout
    assert open_artifact(art).spec.layers[0].kv_cache_dtype == "fp8"
    empty = tmp_path / "empty"
    empty.mkdir()
    result = build_artifact("tiny-llama", empty, BuildRequest(), force=True)
    assert result.replaced == f"the empty directory {empty}"
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
    build_artifact("tiny-llama", tmp_path / "art", BuildRequest())
    assert not any(p.exists() for p in stale)
    assert other.exists() and live.exists()


def test_a_file_in_the_way_is_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(source_module, "load_model", pytest.fail)
    with pytest.raises(TQExportError, match="is not a directory"):
        build_artifact("tiny-llama", tmp_path / "f" / "art", BuildRequest())
    with pytest.raises(TQExportError, match="is not a directory"):
        build_artifact("tiny-llama", tmp_path / "f", BuildRequest(), force=True)
    assert tree(tmp_path) == ["f"]


def test_unwritable_location_fails_before_loading(tmp_path, monkeypatch):
    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(source_module, "load_model", pytest.fail)
    monkeypatch.setattr(outdir.Path, "mkdir", refuse)
    with pytest.raises(TQExportError, match="cannot write into .*Permission denied"):
        build_artifact("tiny-llama", tmp_path / "art", BuildRequest())
    assert tree(tmp_path) == []


def test_a_folder_that_cannot_be_searched_is_one_line_before_any_work(tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    """As an unprivileged user in a folder without search permission, every stat under it
    fails with EACCES (root is never refused, so the refusal is simulated): one line, exit 2,
    before --kv-bits measures its table."""
    from helpers import main_inproc

    from tqexport.kvplan import calibration

    locked = tmp_path / "locked"
    locked.mkdir()
    real = outdir.Path.lstat

    def lstat(self):
        if str(self).startswith(str(locked) + os.sep):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(outdir.Path, "lstat", lstat)
    monkeypatch.setattr(calibration, "measure", pytest.fail)
    out = locked / "inner" / "x"
    code, stdout, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-bits", "8")
    assert (code, stdout) == (2, "")
    assert err == (
        f"error: {out} cannot be looked at (Permission denied), so -o {out} cannot be checked; "
        "choose another -o\n"
    )
    assert tree(tmp_path) == ["locked"]


def test_full_disk_and_failed_export_leave_nothing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(TQExportError, match="MiB free but the artifact needs"):
        build_artifact("tiny-llama", tmp_path / "x" / "art", BuildRequest())
    assert tree(tmp_path) == []
    monkeypatch.undo()

    def broken(*a, **k):
        raise RuntimeError("export failed")

    monkeypatch.setattr(artifact_module, "export_model", broken)
    with pytest.raises(RuntimeError):
        build_artifact("tiny-llama", tmp_path / "x" / "art", BuildRequest())
    assert tree(tmp_path) == []


@pytest.fixture(params=["renameat2", "fallback"])
def renames(request, monkeypatch):
    """Swaps with Linux renameat2, and with the fallback for filesystems without it."""
    if request.param == "fallback":
        monkeypatch.setattr(outdir, "renameat2", lambda src, dst, flags: False)


def staged(target, force=False):
    """A Staging holding a tiny fake build."""
    staging = outdir.Staging(target, force)
    (staging.path / "model.onnx").write_text("new")
    return staging


@pytest.mark.parametrize("user_files", [(), ("mine.txt",)])
def test_a_target_created_during_the_build_is_left_untouched(tmp_path, renames, user_files):
    target = tmp_path / "art"
    staging = staged(target)
    target.mkdir()
    for name in user_files:
        (target / name).write_text("mine")
    with pytest.raises(TQExportError) as e:
        staging.commit()
    staging.discard()
    assert str(e.value) == (
        f"{target} was created by something else during the build; left it as it is and "
        "discarded this build; remove it or choose another -o"
    )
    assert tree(tmp_path) == ["art", *(f"art/{n}" for n in user_files)]
    assert all((target / n).read_text() == "mine" for n in user_files)


def test_a_build_leaves_a_directory_made_at_its_target_just_before_the_swap(tmp_path, monkeypatch):
    target = tmp_path / "art"
    commit = outdir.Staging.commit

    def user_makes_the_target_first(self):
        target.mkdir()
        (target / "mine.txt").write_text("mine")
        return commit(self)

    monkeypatch.setattr(outdir.Staging, "commit", user_makes_the_target_first)
    with pytest.raises(TQExportError) as e:
        build_artifact("tiny-llama", target, BuildRequest())
    assert str(e.value).startswith(f"{target} was created by something else during the build")
    assert tree(tmp_path) == ["art", "art/mine.txt"]
    assert (target / "mine.txt").read_text() == "mine"


def test_two_swaps_into_one_new_target_exactly_one_wins(tmp_path, renames):
    target = tmp_path / "art"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_text(name)
    outdir.rename_noreplace(tmp_path / "a", target)
    with pytest.raises(FileExistsError):
        outdir.rename_noreplace(tmp_path / "b", target)
    assert tree(tmp_path) == ["art", "art/model.onnx", "b", "b/model.onnx"]
    assert (target / "model.onnx").read_text() == "a"


def test_a_second_build_to_a_target_fails_at_once_and_the_first_wins(tmp_path):
    target = tmp_path / "art"
    first = outdir.Staging(target)
    (first.path / "model.onnx").write_text("first")
    with pytest.raises(TQExportError) as e:
        outdir.Staging(target)
    assert str(e.value) == (
        f"another tqexport build (pid {os.getpid()}) is writing {target}; wait for it to "
        "finish or choose another -o"
    )
    first.commit()
    assert tree(tmp_path) == ["art", "art/model.onnx"]
    assert (target / "model.onnx").read_text() == "first"


def test_two_concurrent_cli_builds_to_one_new_target_one_wins(tmp_path):
    out = tmp_path / "art"
    args = [sys.executable, "-m", "tqexport", "build", "tiny-llama", "-o", str(out)]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    runs = [(p, *p.communicate(timeout=600)) for p in procs]
    assert sorted(p.returncode for p, _, _ in runs) == [0, 2], [err for _, _, err in runs]
    (loser_err,) = [err for p, _, err in runs if p.returncode == 2]
    last = [ln for ln in loser_err.splitlines() if ln.strip()][-1]
    busy = rf"another tqexport build \(pid \d+\) is writing {out}; wait for it to finish or"
    late = rf"{out} already exists; pass --force to replace it"
    assert re.fullmatch(rf"error: ({busy} choose another -o|{late})", last), loser_err
    assert "Traceback" not in loser_err
    assert open_artifact(out).spec.layers
    assert os.listdir(tmp_path) == ["art"]


def _edit_extra(art):
    (art / "notes.txt").write_text("mine")


def _edit_subdir(art):
    (art / "mine").mkdir()
    (art / "mine" / "a.txt").write_text("mine")


def _edit_no_weights(art):
    (art / "model.onnx.data").unlink()


def _edit_bad_spec(art):
    (art / "tqexport.json").write_text("{}")


def _edit_no_manifest(art):
    (art / "tqexport.files.json").unlink()


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            _edit_extra,
            "{art} holds files no tqexport build wrote there: notes.txt; --force only replaces "
            "a whole artifact, so move them out or choose another -o",
        ),
        (
            _edit_subdir,
            "{art} holds files no tqexport build wrote there: mine, mine/a.txt; --force only "
            "replaces a whole artifact, so move them out or choose another -o",
        ),
        (
            _edit_no_weights,
            "{art} is an incomplete artifact (missing model.onnx.data); --force only replaces a "
            "whole artifact, so remove it yourself or choose another -o",
        ),
        (_edit_bad_spec, "{art} is not a valid artifact ({art}/tqexport.json: "),
        (
            _edit_no_manifest,
            "{art} has no readable tqexport.files.json listing the files its build wrote (an "
            "artifact of an older tqexport?), so --force cannot tell them from yours; remove it "
            "yourself or choose another -o",
        ),
    ],
)
def test_force_refuses_anything_but_exactly_an_artifact_and_deletes_nothing(
    artifacts, tmp_path, monkeypatch, edit, message
):
    art = tmp_path / "art"
    shutil.copytree(artifacts("tiny-llama", "auto"), art)
    edit(art)
    before = {p: p.read_bytes() for p in art.rglob("*") if p.is_file()}
    monkeypatch.setattr(source_module, "load_model", pytest.fail)
    with pytest.raises(TQExportError) as e:
        build_artifact("tiny-llama", art, BuildRequest(), force=True)
    assert str(e.value).startswith(message.format(art=art)), str(e.value)
    assert "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in art.rglob("*") if p.is_file()} == before
    assert os.listdir(tmp_path) == ["art"]


def test_force_puts_back_an_artifact_that_changed_during_the_build(artifacts, tmp_path, renames):
    art = tmp_path / "art"
    shutil.copytree(artifacts("tiny-llama", "auto"), art)
    staging = staged(art, force=True)
    (art / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in art.rglob("*") if p.is_file()}
    with pytest.raises(TQExportError) as e:
        staging.commit()
    staging.discard()
    assert str(e.value) == (
        f"{art} changed during the build (files added, removed or rewritten since the check); "
        "left it as it is and discarded this build; build again"
    )
    assert {p: p.read_bytes() for p in art.rglob("*") if p.is_file()} == before
    assert os.listdir(tmp_path) == ["art"]


def test_force_swap_of_an_unchanged_artifact_removes_only_it(artifacts, tmp_path, renames):
    art = tmp_path / "art"
    shutil.copytree(artifacts("tiny-llama", "auto"), art)
    assert staged(art, force=True).commit() == f"the artifact that was in {art} (5 files)"
    assert tree(tmp_path) == ["art", "art/model.onnx"]
    assert (art / "model.onnx").read_text() == "new"
