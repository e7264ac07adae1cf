"""Which kernels serve an artifact's tqexport nodes on ONNX Runtime: native or function bodies.

ONNX Runtime runs a registered custom-op kernel for EVERY node of its domain and op type, so
the library is registered only when it serves every layer of the artifact (each layer's cache
format and head size is in the generated tables) and was built from the sources here; otherwise
the portable function bodies run, and the choice says why.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.native import KERNEL_CHOICES
from tqexport.native import build as native_build
from tqexport.native.header import supported


@dataclass(frozen=True)
class KernelChoice:
    kernels: str  # "native" or "bodies"
    library: Path | None
    reason: str  # why bodies, or what serves the layers


def build_info(path: Path) -> dict:
    """What a library says it was built from (ORT API version, source hash)."""
    lib = ctypes.CDLL(str(path))
    fn = lib.tqx_build_info
    fn.restype = ctypes.c_char_p
    return json.loads(fn().decode())


@lru_cache(maxsize=4)
def _ready_library(sanitize: bool = False) -> tuple[Path | None, str]:
    """(the library built from the current sources, or None with the reason)."""
    if not native_build.SOURCE_DIR.is_dir() and not sanitize:
        return _bundled_library()  # an installed wheel: no sources to hash or build
    path = native_build.library_path(sanitize)
    want = native_build.source_hash(sanitize)
    if path.is_file() and not sanitize:  # a sanitized library loads only under its runtime
        try:
            info = build_info(path)
        except (OSError, AttributeError, ValueError) as e:
            return None, f"{path} is not a tqexport kernel library ({e})"
        if info.get("source_hash") == want:
            return path, ""
    try:  # missing or stale: rebuilt when the headers are here
        built = native_build.build(sanitize)
    except TQExportError as e:
        state = "is stale" if path.is_file() else "is not built"
        return None, f"the native kernel library {state}: {str(e).splitlines()[0]}"
    return built.library, ""


def _bundled_library() -> tuple[Path | None, str]:
    """The library a platform wheel carries (``make wheel``), when its build says it is this
    library (the hash it was built with matches what the wheel recorded)."""
    path = native_build.BUNDLED_DIR / native_build.LIBRARY_NAME
    if not path.is_file():
        return None, (
            "this install has neither the native kernel sources nor a bundled library; install "
            "a wheel made by `make wheel`, or tqexport from its sources with ONNX Runtime's "
            "headers"
        )
    try:
        want = json.loads((native_build.BUNDLED_DIR / "build_info.json").read_text())
        got = build_info(path)
    except (OSError, AttributeError, ValueError) as e:
        return None, f"{path} is not a tqexport kernel library ({e})"
    if got.get("source_hash") != want.get("source_hash"):
        return None, f"{path} is not the library this wheel was built with; reinstall it"
    return path, ""


def unsupported_layers(spec) -> list[str]:
    """Layers whose cache the native kernels do not serve, as ``layer i (dtype, D)``."""
    return [
        f"layer {layer.index} ({b.cache.kv_cache_dtype}, head size {b.cache.head_size})"
        for layer in spec.layers
        for b in layer.bindings
        if not supported(b.cache.kv_cache_dtype, b.cache.head_size)
    ]


def choose(spec, kernels: str = "auto", sanitize: bool = False) -> KernelChoice:
    """The kernels that serve ``spec`` on ONNX Runtime's CPU provider."""
    validate.choice(kernels, "--kernels", KERNEL_CHOICES)
    if kernels == "bodies":
        return KernelChoice("bodies", None, "function bodies (--kernels bodies)")
    missing = unsupported_layers(spec)
    if missing:
        reason = f"no native kernel for {', '.join(missing[:3])}"
    else:
        path, reason = _ready_library(sanitize)
        if path is not None:
            return KernelChoice("native", path, f"native kernels ({path.name})")
    if kernels == "native":
        raise TQExportError(f"--kernels native: {reason}; use --kernels bodies")
    return KernelChoice("bodies", None, f"function bodies: {reason}")
