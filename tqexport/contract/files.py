"""The files of an artifact directory and the ONNX metadata entry that embeds its spec."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from tqexport.errors import TQExportError
from tqexport.spec import ModelSpec

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
SPEC_FILE = "tqexport.json"
#: written by ``tqexport engine``: the serialized TensorRT engine and its profile limits
ENGINE_FILE = "engine.plan"
PROFILE_FILE = "engine.json"
SPEC_METADATA_KEY = "tqexport.spec"
#: written last by ``tqexport build``: every file the build wrote, so ``--force`` can tell an
#: artifact's files from a user's
MANIFEST_FILE = "tqexport.files.json"
#: files other commands add to a built artifact
ADDED_FILES = frozenset({ENGINE_FILE, PROFILE_FILE})
#: bytes a manifest may take (names of a few dozen files)
_MAX_MANIFEST_BYTES = 1 << 20


def write_manifest(root: Path) -> None:
    """List every file under ``root`` (a finished build) in its MANIFEST_FILE."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    (root / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1) + "\n")


def read_manifest(root: Path) -> frozenset[str] | None:
    """The files a build wrote into ``root`` (its manifest included), as relative POSIX paths;
    None when the manifest is missing or not one."""
    try:
        with (root / MANIFEST_FILE).open("rb") as f:
            data = json.loads(f.read(_MAX_MANIFEST_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(x, str) and x for x in files):
        return None
    return frozenset(files) | {MANIFEST_FILE}


def set_spec_metadata(model: onnx.ModelProto, spec: ModelSpec) -> None:
    """Embed ``spec`` in the graph (replacing an older copy)."""
    for prop in list(model.metadata_props):
        if prop.key == SPEC_METADATA_KEY:
            model.metadata_props.remove(prop)
    entry = model.metadata_props.add()
    entry.key, entry.value = SPEC_METADATA_KEY, spec.to_json()


def read_spec_metadata(model: onnx.ModelProto) -> str:
    """The spec JSON embedded in the graph."""
    for prop in model.metadata_props:
        if prop.key == SPEC_METADATA_KEY:
            return prop.value
    raise TQExportError(f"the ONNX model has no {SPEC_METADATA_KEY!r} metadata")
