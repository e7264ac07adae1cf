"""Open an artifact directory and check it is whole and self-consistent before serving it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx

from tqexport.errors import TQExportError
from tqexport.export.artifact import MODEL_FILE, SPEC_FILE, WEIGHTS_FILE
from tqexport.export.onnx import read_spec_metadata
from tqexport.spec import ModelSpec, SpecError


@dataclass
class Artifact:
    path: Path
    spec: ModelSpec

    @property
    def model_file(self) -> Path:
        return self.path / MODEL_FILE


def open_artifact(path: str | Path) -> Artifact:
    """Validate presence, spec, graph I/O against the spec, and weight-file integrity."""
    root = Path(path)
    if not root.is_dir():
        raise TQExportError(f"artifact {root} not found; build one with `tqexport build`")
    spec_file = root / SPEC_FILE
    if not spec_file.is_file():
        raise TQExportError(f"{root} has no {SPEC_FILE}; is it a tqexport artifact?")
    try:
        spec = ModelSpec.from_json(spec_file.read_text())
    except SpecError as e:
        raise TQExportError(f"{spec_file}: {e}") from None
    model_file = root / MODEL_FILE
    if not model_file.is_file():
        raise TQExportError(f"{root} has no {MODEL_FILE}; rebuild the artifact")
    try:
        graph = onnx.load(str(model_file), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and others for a damaged file
        raise TQExportError(
            f"{model_file} is not a readable ONNX model ({type(e).__name__}); "
            "it may be truncated, rebuild the artifact"
        ) from None
    _check_io(spec, graph, model_file)
    embedded = json.loads(read_spec_metadata(graph))
    if embedded != json.loads(spec_file.read_text()):
        raise TQExportError(f"{spec_file} differs from the spec embedded in {MODEL_FILE}")
    _check_weights(graph, root)
    return Artifact(root, spec)


def _check_io(spec: ModelSpec, graph: onnx.ModelProto, model_file: Path) -> None:
    io = spec.graph_io()
    for kind, want, got in (
        ("inputs", io["inputs"], graph.graph.input),
        ("outputs", io["outputs"], graph.graph.output),
    ):
        want_names = [x["name"] for x in want]
        got_names = [x.name for x in got]
        if want_names != got_names:
            missing = sorted(set(want_names) - set(got_names)) or sorted(
                set(got_names) - set(want_names)
            )
            raise TQExportError(
                f"{model_file} {kind} do not match the spec (first difference: "
                f"{missing[:3] or 'order'}); the spec and graph come from different builds"
            )
        for w, g in zip(want, got, strict=True):
            elem = onnx.helper.tensor_dtype_to_np_dtype(g.type.tensor_type.elem_type)
            if str(elem) != w["dtype"]:
                raise TQExportError(
                    f"{model_file}: {g.name} is {elem} in the graph but {w['dtype']} in the spec"
                )


def _check_weights(graph: onnx.ModelProto, root: Path) -> None:
    need = 0
    for init in graph.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        if info:
            need = max(need, int(info.get("offset", 0)) + int(info.get("length", 0)))
    if need:
        data = root / WEIGHTS_FILE
        if not data.is_file() or data.stat().st_size < need:
            raise TQExportError(f"{data} is missing or truncated; rebuild the artifact")
