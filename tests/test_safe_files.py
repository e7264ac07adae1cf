"""No write through a link someone planted: every writer of tqexport, with a link (or another
user's file) at the names it uses, leaves the link's target untouched."""

import ast
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import main_inproc

from tqexport import safe_files
from tqexport.errors import TQExportError
from tqexport.export import outdir
from tqexport.kvplan.calibration import Table

PRECIOUS = "precious bytes\n"


@pytest.fixture
def victim(tmp_path):
    """A file a planted link points at; the test checks it is never written."""
    v = tmp_path / "precious.txt"
    v.write_text(PRECIOUS)
    yield v
    assert v.read_text() == PRECIOUS


def test_write_file_replaces_a_link_at_its_name_never_its_target(tmp_path, victim):
    out = tmp_path / "t.json"
    out.symlink_to(victim)
    safe_files.write_file(out, "new\n")
    assert not out.is_symlink() and out.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_write_file_without_force_refuses_anything_at_its_name(tmp_path, victim):
    out = tmp_path / "t.json"
    out.symlink_to(victim)
    with pytest.raises(FileExistsError):
        safe_files.write_file(out, "new\n", force=False)
    assert out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt", "t.json"]


def test_write_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        safe_files.write_file(tmp_path / "a", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640


@pytest.mark.parametrize(
    ("make", "force", "message"),
    [
        (lambda p, v: p.write_text("x"), False, "already exists (a file); pass --force"),
        (lambda p, v: p.symlink_to(v), False, "already exists (a symbolic link); pass --force"),
        (lambda p, v: p.mkdir(), True, "is a folder; give a file name"),
        (lambda p, v: os.mkfifo(p), True, "is a named pipe (FIFO); --force replaces only a file"),
    ],
)
def test_check_output_file_refuses_what_it_must_not_replace(tmp_path, victim, make, force,
                                                             message):  # fmt: skip
    out = tmp_path / "o.json"
    make(out, victim)
    with pytest.raises(TQExportError, match=message.replace("(", r"\(").replace(")", r"\)")):
        safe_files.check_output_file(out, force)


def test_check_output_file_refuses_a_file_on_the_way(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(TQExportError, match="a_file is not a directory"):
        safe_files.check_output_file(tmp_path / "a_file" / "sub.json", False)


def _table():
    return Table(model={"name": "m"}, text={"name": "t", "tokens": 2}, candidates=("fp8",),
                 cost=((0.0,),), baseline_ppl=1.0, elapsed_seconds=0.0)  # fmt: skip


def test_calibration_table_through_a_link_at_any_old_temporary_name(tmp_path, victim):
    out = tmp_path / "t6.json"
    (tmp_path / ".t6.json.tmp").symlink_to(victim)  # the name the table once was written under
    _table().write(out)
    assert out.is_file() and not out.is_symlink()
    assert json.loads(out.read_text())["candidates"] == ["fp8"]
    with pytest.raises(TQExportError, match="already exists"):
        _table().write(out)
    _table().write(out, force=True)


def test_calibrate_refuses_an_existing_table_and_a_bad_folder_before_measuring(tmp_path, capsys):
    (tmp_path / "t.json").write_text("{}")
    code, _, err = main_inproc(capsys, "calibrate", "tiny-llama", "-o", str(tmp_path / "t.json"),
                               "--candidates", "fp8", "--tokens", "16")  # fmt: skip
    assert code == 2 and "already exists (a file); pass --force to replace it" in err
    assert (tmp_path / "t.json").read_text() == "{}"
    code, _, err = main_inproc(capsys, "calibrate", "tiny-llama", "-o",
                               str(tmp_path / "t.json" / "sub.json"), "--candidates", "fp8",
                               "--tokens", "16")  # fmt: skip
    assert code == 2 and "t.json is not a directory" in err


def test_calibrate_with_a_planted_temporary_link_writes_its_own_file(tmp_path, victim, capsys):
    (tmp_path / ".t6.json.tmp").symlink_to(victim)
    code, _, err = main_inproc(capsys, "calibrate", "tiny-llama", "-o", str(tmp_path / "t6.json"),
                               "--candidates", "fp8", "--tokens", "16")  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "t6.json").is_file() and not (tmp_path / "t6.json").is_symlink()
    assert (tmp_path / ".t6.json.tmp").is_symlink()  # not ours: left as it is


def test_build_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, victim):
    target = tmp_path / "x"
    (tmp_path / ".x.lock").symlink_to(victim)
    with pytest.raises(TQExportError, match=r"\.x\.lock is a symbolic link that no tqexport"):
        outdir.Staging(target)
    assert not target.exists()
    assert not any(p.name.startswith(".x.tmp") for p in tmp_path.iterdir())


def test_a_stale_lock_file_is_replaced_never_truncated(tmp_path, victim):
    target = tmp_path / "x"
    os.link(victim, tmp_path / ".x.lock")  # a hard link: a regular file whose data is the victim
    staging = outdir.Staging(target)
    try:
        lock = tmp_path / ".x.lock"
        assert lock.read_text() == f"{os.getpid()}\n"
        assert not os.path.samefile(lock, victim)
    finally:
        staging.discard()
    assert not (tmp_path / ".x.lock").exists()


def test_a_planted_staging_folder_or_link_is_not_removed(tmp_path, victim):
    target = tmp_path / "x"
    dead = 2**22 + 7  # above the default pid_max, so no process has it
    (tmp_path / f".x.tmp-{dead}").symlink_to(tmp_path)
    assert outdir.remove_stale_staging(target) == []
    assert (tmp_path / f".x.tmp-{dead}").is_symlink()


def test_native_build_outputs_replace_links_at_their_names(tmp_path, victim, monkeypatch):
    from tqexport.native import build

    if build.find_ort_headers() is None:
        pytest.skip("ONNX Runtime headers not found (set ORT_INCLUDE_DIR)")
    monkeypatch.setattr(build, "BUILD_DIR", tmp_path / "b")
    out = build.library_path()
    out.parent.mkdir(parents=True)
    for name in (out.name, "build_info.json", "generated", "attention_kernel_base.o"):
        (out.parent / name).symlink_to(victim)
    monkeypatch.setattr(build, "_run", lambda cmd: Path(cmd[cmd.index("-o") + 1]).write_bytes(b""))
    build.build()
    assert out.is_file() and not out.is_symlink()
    assert json.loads(out.with_name("build_info.json").read_text())["source_hash"]
    assert not any(p.name.endswith(".tmp") for p in out.parent.iterdir())


def test_report_files_replace_links_and_refuse_without_force(tmp_path, victim):
    from benchmarks.report import report

    (tmp_path / "results.json").symlink_to(victim)
    with pytest.raises(TQExportError, match="results.json already exists"):
        report.check_out(tmp_path, force=False)
    report.check_out(tmp_path, force=True)
    safe_files.write_file(tmp_path / "results.json", "{}")
    assert not (tmp_path / "results.json").is_symlink()


def test_builtin_chunks_join_without_following_a_link(tmp_path, victim, monkeypatch):
    from tqexport.models import builtins

    monkeypatch.setenv("TQEXPORT_CACHE", str(tmp_path / "cache"))
    parts = [tmp_path / "p1", tmp_path / "p2"]
    parts[0].write_bytes(b"ab")
    parts[1].write_bytes(b"cd")
    import hashlib

    entry = builtins.ChunkedGGUF(file="m.gguf", sha256=hashlib.sha256(b"abcd").hexdigest(),
                                 chunks=(("a", "p1"), ("b", "p2")), wheels=("w",))  # fmt: skip
    monkeypatch.setitem(builtins.CHUNKED_GGUFS, "m", entry)
    monkeypatch.setattr(builtins, "_chunk_path", lambda m, f: tmp_path / f)
    target = tmp_path / "cache" / "builtin" / "m.gguf"
    target.parent.mkdir(parents=True)
    target.symlink_to(victim)
    assert builtins.chunked_gguf("m") == target
    assert target.read_bytes() == b"abcd" and not target.is_symlink()


#: writers allowed to call a plain file-creating API: they write inside a folder they just made
#: with mkdtemp or a build's own staging folder (names nobody else can have planted)
FRESH_FOLDER_WRITERS = {
    "tqexport/export/artifact_build.py",  # into the build's staging folder (outdir.Staging)
    "tqexport/contract/files.py",  # write_manifest: into the staging folder
    "tqexport/runtime/text.py",  # the tokenizer, into a TemporaryDirectory
    "tqexport/models/loader.py",  # the converted GGUF, into make_temp_dir's folder
    "tqexport/weights/graph.py",  # stored weights, into the build's staging folder
}
_CREATING_ATTRS = {"write_text", "write_bytes", "savefig", "symlink_to", "hardlink_to", "touch"}


def _creating_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in _CREATING_ATTRS:
            yield node.lineno, f.attr
        elif isinstance(f, ast.Name) and f.id == "open" or (
            isinstance(f, ast.Attribute) and f.attr == "open"
            and not (isinstance(f.value, ast.Name) and f.value.id in ("os", "tarfile"))
        ):  # fmt: skip
            mode = node.args[1] if len(node.args) > 1 else None
            mode = next((k.value for k in node.keywords if k.arg == "mode"), mode)
            if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                yield node.lineno, f"open(..., {mode.value!r})"


def test_every_file_is_created_through_safe_files():
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted((root / "tqexport").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "tqexport/safe_files.py" or rel in FRESH_FOLDER_WRITERS:
            continue
        for line, what in _creating_calls(ast.parse(path.read_text())):
            bad.append(f"{rel}:{line} {what}")
    assert bad == [], "create files with tqexport.safe_files instead: " + ", ".join(bad)


NOBODY = "nobody"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a link as another user")
def test_root_build_in_a_sticky_folder_with_a_link_planted_by_another_user(tmp_path, victim):
    shared = Path(tempfile.mkdtemp(prefix="tqexport-sticky-"))  # in /tmp, reachable by all
    try:
        shared.chmod(0o1777)
        uid = pwd.getpwnam(NOBODY).pw_uid
        subprocess.run(["ln", "-s", str(victim), str(shared / ".x.lock")], check=True, user=uid,
                       cwd="/", timeout=60)  # fmt: skip
        assert (shared / ".x.lock").lstat().st_uid == uid
        r = subprocess.run([sys.executable, "-m", "tqexport", "build", "tiny-llama", "-o",
                            str(shared / "x"), "--kv-cache-dtype", "fp8"],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1
        assert "is a symbolic link that no tqexport build made" in r.stderr
        assert sorted(p.name for p in shared.iterdir()) == [".x.lock"]
    finally:
        shutil.rmtree(shared)
