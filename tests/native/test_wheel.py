"""`make wheel` and the install warning: the native kernels on a machine without ONNX Runtime's
headers, either through a platform wheel or by the exact command the warning names."""

import os
import subprocess
import sys
import zipfile
from importlib.metadata import version

import pytest
from filelock import FileLock

from tqexport.native import build as native_build
from tqexport.native.__main__ import main as native_main
from tqexport.native.wheel import BUNDLED, build_wheel, platform_tag


def test_without_headers_the_install_warning_names_the_exact_command(monkeypatch, capsys):
    monkeypatch.setattr(native_build, "find_ort_headers", lambda: None)
    monkeypatch.setattr(native_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr("importlib.metadata.version", lambda name: "1.22.1")
    assert native_main([]) == 0
    release = "onnxruntime-linux-x64-1.22.1"
    assert capsys.readouterr() == ("", (
        "warning: native kernels not built: ONNX Runtime C/C++ API headers not found: set "
        "ORT_INCLUDE_DIR to the folder with onnxruntime_cxx_api.h, e.g. `curl -L "
        f"https://github.com/microsoft/onnxruntime/releases/download/v1.22.1/{release}.tgz | "
        f"tar xz && ORT_INCLUDE_DIR=$PWD/{release}/include make native` (or install "
        "libonnxruntime-dev where the distribution has it); the function bodies run\n"
    ))  # fmt: skip


def test_the_wheel_carries_the_native_kernels_to_a_machine_without_headers(artifacts, tmp_path):
    """Installed from the wheel (no sources, no headers: ORT_INCLUDE_DIR unset), the package
    runs the artifact's layers on the library the wheel carries."""
    if native_build.find_ort_headers() is None:
        pytest.skip("ONNX Runtime C/C++ API headers not found: set ORT_INCLUDE_DIR to build it")
    art = artifacts("tiny-llama", "fp8")
    out = native_build.library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out.parent}.lock"):  # the native kernel tests build the same library
        wheel = build_wheel(tmp_path / "dist")
    assert wheel.name == f"tqexport-{version('tqexport')}-py3-none-{platform_tag()}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        bundled = z.read(f"{BUNDLED}/{native_build.LIBRARY_NAME}")
    assert f"Tag: py3-none-{platform_tag()}" in meta and "Root-Is-Purelib: false" in meta
    assert bundled == out.read_bytes()
    assert not any(n.startswith(("plugins/", "tests/")) for n in names)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site)]
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k != "ORT_INCLUDE_DIR"}
    env["PYTHONPATH"] = str(site)
    cmd = [sys.executable, "-m", "tqexport", "parity", str(art), "--steps", "1", "--batch", "1",
           "--prompt-len", "4", "--kernels", "native"]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ONNX Runtime runs the layers on native kernels ({native_build.LIBRARY_NAME})" in (
        r.stdout
    )
    where = [sys.executable, "-c", "import tqexport.native.build as b; print(b.BUNDLED_DIR)"]
    r = subprocess.run(where, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == str(site / BUNDLED)


def test_an_install_without_sources_or_bundled_library_runs_the_bodies_saying_why(
    monkeypatch, tmp_path
):
    from tqexport.native import kernel_choice

    monkeypatch.setattr(native_build, "SOURCE_DIR", tmp_path / "plugins")  # none: installed
    monkeypatch.setattr(native_build, "BUNDLED_DIR", tmp_path / "lib")
    kernel_choice._ready_library.cache_clear()
    try:
        assert kernel_choice._ready_library() == (None, (
            "this install has neither the native kernel sources nor a bundled library; install "
            "a wheel made by `make wheel`, or tqexport from its sources with ONNX Runtime's "
            "headers"
        ))  # fmt: skip
        (tmp_path / "lib").mkdir()
        (tmp_path / "lib" / native_build.LIBRARY_NAME).write_bytes(b"not a library")
        (tmp_path / "lib" / "build_info.json").write_text('{"source_hash": "x"}')
        kernel_choice._ready_library.cache_clear()
        path, why = kernel_choice._ready_library()
        assert path is None and why.startswith(f"{tmp_path / 'lib'}/libtqexport_ort.so is not ")
    finally:
        kernel_choice._ready_library.cache_clear()
