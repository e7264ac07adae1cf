"""The files of an artifact directory and the ONNX metadata entry that embeds its spec."""

from __future__ import annotations

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
