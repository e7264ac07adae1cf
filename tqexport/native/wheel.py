"""``python -m tqexport.native.wheel [OUT_DIR]`` (``make wheel``): a platform wheel of tqexport
with the native kernel library built here inside it, so a machine without ONNX Runtime's
headers installs the kernels with the package (the library is not a Python extension: the
wheel is ``py3-none-<platform>``).

pip builds the pure wheel; the library and its ``build_info.json`` are added under
``tqexport/native/lib`` (:data:`tqexport.native.build.BUNDLED_DIR`, where an installed
package without the sources looks) and RECORD is written again with every file's hash.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.native import build as native_build
from tqexport.safe_files import replacing

#: where the library sits inside the wheel (and the installed package)
BUNDLED = "tqexport/native/lib"


def platform_tag() -> str:
    """This machine's wheel platform tag (``linux_x86_64``): the library runs where it was
    built."""
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _platform_wheel(pure: Path, out: Path, files: dict[str, bytes]) -> None:
    """``pure`` rewritten as ``out``: WHEEL tagged for this platform, ``files`` added, RECORD
    made anew."""
    tag = f"py3-none-{platform_tag()}"
    with zipfile.ZipFile(pure) as src:
        entries = {i.filename: src.read(i) for i in src.infolist()}
    record = next(n for n in entries if n.endswith(".dist-info/RECORD"))
    info = record.rsplit("/", 1)[0]
    wheel_meta = entries[f"{info}/WHEEL"].decode().splitlines()
    wheel_meta = [ln for ln in wheel_meta if not ln.startswith(("Tag:", "Root-Is-Purelib:"))]
    wheel_meta[1:1] = ["Root-Is-Purelib: false", f"Tag: {tag}"]
    entries[f"{info}/WHEEL"] = ("\n".join(wheel_meta) + "\n").encode()
    del entries[record]
    entries.update(files)
    lines = [f"{name},{_digest(data)},{len(data)}" for name, data in entries.items()]
    entries[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
    with replacing(out, 0o644) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            z.writestr(name, data)


#: what setuptools builds the package from (pyproject.toml names the packages and the readme)
PACKAGE_FILES = ("pyproject.toml", "README.md")
PACKAGE_DIRS = ("tqexport", "trt_plugins")


def _sources(dst: Path) -> Path:
    """A clean copy of what the wheel is built from: setuptools building in the checkout would
    leave build/ and egg-info there, and put files a build/ left behind in the wheel."""
    root = native_build.ROOT
    for d in PACKAGE_DIRS:
        shutil.copytree(root / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in PACKAGE_FILES:
        shutil.copy2(root / f, dst / f)
    return dst


def build_wheel(out_dir: Path) -> Path:
    """Build the library (an error without ONNX Runtime's headers: a wheel without it is the
    pure one), then the platform wheel in ``out_dir``; returns its path."""
    built = native_build.build()
    with tempfile.TemporaryDirectory() as tmp:
        src = _sources(Path(tmp) / "src")
        cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
               "--no-build-isolation", "--quiet", "-w", tmp]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        pure = sorted(Path(tmp).glob("tqexport-*.whl"))
        if res.returncode != 0 or len(pure) != 1:
            last = (res.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise TQExportError(f"pip could not build tqexport's wheel: {last}")
        name, version = pure[0].name.split("-")[:2]
        out = out_dir / f"{name}-{version}-py3-none-{platform_tag()}.whl"
        info = json.loads(built.library.with_name("build_info.json").read_text())
        info.pop("include", None)  # where this machine keeps the headers: not the wheel's
        files = {
            f"{BUNDLED}/{native_build.LIBRARY_NAME}": built.library.read_bytes(),
            f"{BUNDLED}/build_info.json": (json.dumps(info) + "\n").encode(),
        }
        _platform_wheel(pure[0], out, files)
    return out


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else native_build.ROOT / "dist"
    try:
        out = build_wheel(out_dir)
    except TQExportError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {out} (the native kernels inside: {BUNDLED}/{native_build.LIBRARY_NAME})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
