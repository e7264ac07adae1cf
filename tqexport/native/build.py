"""Build the native ONNX Runtime kernels (``plugins/``) with the system C++ compiler.

Headers come from ``ORT_INCLUDE_DIR``, then pkg-config (``libonnxruntime``), then the system
include path. The library records the ORT API version it was built for and a hash of
everything it was built from (sources, the generated constants header, compiler flags), so the
loader can tell a stale or foreign library from this one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.native import header
from tqexport.safe_files import make_temp_dir, write_file

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "plugins"
BUILD_DIR = ROOT / "build" / "plugins"
LIBRARY_NAME = "libtqexport_ort.so"
#: the library a platform wheel carries (``make wheel``): what an installed package without
#: the sources (``plugins/``) loads
BUNDLED_DIR = Path(__file__).resolve().parent / "lib"
#: the C API version the sources are written against (a newer runtime serves it too)
ORT_API_VERSION = 21

COMMON_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra",
                "-Wno-unused-parameter", "-ffp-contract=off"]  # fmt: skip
#: the attention kernel may reorder and fuse its sums (so they vectorize); encoding keeps IEEE
#: order. It is compiled once per instruction set; the library picks one at run time.
ATTENTION_SOURCE = "attention_kernel"
ATTENTION_FLAGS = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                   "-ffp-contract=fast"]  # fmt: skip
#: linked in this order, the baseline first: a definition the kernels still share (a standard
#: library template they all instantiate) then resolves to the copy every x86-64 CPU runs
ISA_FLAGS = {"base": [], "avx2": ["-march=haswell"],
             "avx512": ["-march=skylake-avx512", "-mprefer-vector-width=512"]}  # fmt: skip
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                  "-fno-omit-frame-pointer", "-O1", "-g"]  # fmt: skip


@dataclass(frozen=True)
class Built:
    library: Path
    source_hash: str


def _header_dirs() -> list[Path]:
    """Candidate include dirs holding ``onnxruntime_cxx_api.h``, in the documented order."""
    dirs: list[Path] = []
    env = os.environ.get("ORT_INCLUDE_DIR")
    if env:
        base = Path(env)
        dirs += [base, base / "onnxruntime", base / "include" / "onnxruntime"]
    if shutil.which("pkg-config"):
        res = subprocess.run(["pkg-config", "--cflags-only-I", "libonnxruntime"],
                             capture_output=True, text=True)  # fmt: skip
        if res.returncode == 0:
            for flag in res.stdout.split():
                dirs += [Path(flag[2:]), Path(flag[2:]) / "onnxruntime"]
    dirs += [Path("/usr/include/onnxruntime"), Path("/usr/local/include/onnxruntime")]
    return dirs


def find_ort_headers() -> Path | None:
    """The directory holding ONNX Runtime's C/C++ API headers, or None."""
    for d in _header_dirs():
        if (d / "onnxruntime_cxx_api.h").is_file():
            return d
    return None


def headers_command() -> str:
    """The command that gets the headers of the installed ONNX Runtime (its release's include
    folder) and builds the kernels with them."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("onnxruntime")
    except PackageNotFoundError:
        ver = "1.22.0"
    ver = ".".join(ver.split(".")[:3]).split("+")[0]
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "aarch64", "arm64": "aarch64"}.get(
        platform.machine().lower(), "x64"
    )
    name = f"onnxruntime-linux-{arch}-{ver}"
    url = f"https://github.com/microsoft/onnxruntime/releases/download/v{ver}/{name}.tgz"
    return f"curl -L {url} | tar xz && ORT_INCLUDE_DIR=$PWD/{name}/include make native"


def header_api_version(include: Path) -> int:
    text = (include / "onnxruntime_c_api.h").read_text(errors="replace")
    m = re.search(r"#define ORT_API_VERSION (\d+)", text)
    return int(m.group(1)) if m else 0


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cc", ".h"))


def source_hash(sanitize: bool = False) -> str:
    """Hash of everything the library is built from (sources, generated header, flags)."""
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(header.render().encode())
    flags = [COMMON_FLAGS, ATTENTION_FLAGS, ISA_FLAGS, sanitize and SANITIZE_FLAGS]
    h.update(json.dumps(flags).encode())
    return h.hexdigest()[:16]


def library_path(sanitize: bool = False) -> Path:
    return BUILD_DIR / ("asan" if sanitize else "release") / LIBRARY_NAME


def build(sanitize: bool = False, compiler: str | None = None) -> Built:
    """Compile the library (skipped when the one on disk was built from these sources)."""
    if not SOURCE_DIR.is_dir():
        raise TQExportError(f"native kernel sources not found at {SOURCE_DIR}")
    include = find_ort_headers()
    if include is None:
        raise TQExportError(
            "ONNX Runtime C/C++ API headers not found: set ORT_INCLUDE_DIR to the folder with "
            f"onnxruntime_cxx_api.h, e.g. `{headers_command()}` (or install libonnxruntime-dev "
            "where the distribution has it); the function bodies run"
        )
    if header_api_version(include) < ORT_API_VERSION:
        raise TQExportError(
            f"the ONNX Runtime headers at {include} are older than API {ORT_API_VERSION}; "
            "point ORT_INCLUDE_DIR at 1.21 or newer"
        )
    digest = source_hash(sanitize)
    out = library_path(sanitize)
    info = out.with_name("build_info.json")
    try:
        if out.is_file() and json.loads(info.read_text())["source_hash"] == digest:
            return Built(out, digest)
    except (OSError, ValueError, KeyError):
        pass
    work = make_temp_dir(out)  # objects and the link made in a fresh folder, then moved
    try:
        _compile(work, out, digest, include, sanitize, compiler)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Built(out, digest)


def compile_objects(work: Path, include: Path, sanitize: bool = False, compiler: str | None = None,
                    digest: str = "") -> list[Path]:  # fmt: skip
    """Every object of the library, compiled in ``work`` (the units at once, one per core), in
    link order: the other sources, then the attention kernel once per instruction set."""
    gen_dir = work / "generated"
    gen_dir.mkdir()
    write_file(gen_dir / "tqx_generated.h", header.render())
    cxx = compiler or os.environ.get("CXX") or "g++"
    flags = [*COMMON_FLAGS, *(SANITIZE_FLAGS if sanitize else []), f"-I{include}",
             f"-I{gen_dir}", f"-I{SOURCE_DIR}", f'-DTQX_SOURCE_HASH="{digest}"']  # fmt: skip
    units = [(src, f"{src.stem}.o", []) for src in sorted(SOURCE_DIR.glob("*.cc"))
             if src.stem != ATTENTION_SOURCE]  # fmt: skip
    kernel = SOURCE_DIR / f"{ATTENTION_SOURCE}.cc"
    units += [(kernel, f"{ATTENTION_SOURCE}_{isa}.o",
               [*ATTENTION_FLAGS, *march, f"-DTQX_ISA={isa}"])
              for isa, march in ISA_FLAGS.items()]  # fmt: skip
    commands = [[cxx, *flags, *extra, "-c", str(src), "-o", str(work / name)]
                for src, name, extra in units]  # fmt: skip
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_run, commands))
    return [work / name for _, name, _ in units]


def _compile(work: Path, out: Path, digest: str, include: Path, sanitize: bool,
             compiler: str | None) -> None:  # fmt: skip
    """Compile and link in ``work``; the library and its build_info.json replace the old."""
    cxx = compiler or os.environ.get("CXX") or "g++"
    objects = compile_objects(work, include, sanitize, cxx, digest)
    linked = work / out.name
    link = [cxx, "-shared", *(["-fsanitize=address,undefined"] if sanitize else [])]
    _run([*link, *map(str, objects), "-o", str(linked)])
    os.replace(linked, out)
    write_file(out.with_name("build_info.json"),
               json.dumps({"source_hash": digest, "ort_api_version": ORT_API_VERSION,
                           "include": str(include), "compiler": cxx}) + "\n")  # fmt: skip


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise TQExportError(f"native kernel build failed: {' '.join(cmd[:2])} ...\n{res.stderr}")
