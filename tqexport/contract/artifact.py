"""Open an artifact directory and check it is whole and self-consistent before serving it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx

from tqexport import validate
from tqexport.contract.files import (
    MODEL_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    artifact_file,
    read_artifact_file,
    read_spec_metadata,
)
from tqexport.errors import TQExportError
from tqexport.spec import MAX_SPEC_BYTES, ModelSpec, SpecError, parse_spec_json, spec_from_dict

#: digits of an external-data offset or length (2^64 has 20)
_MAX_OFFSET_DIGITS = 20


@dataclass
class Artifact:
    path: Path
    spec: ModelSpec

    @property
    def model_file(self) -> Path:
        """The graph's path, checked to be a regular file inside the artifact (what ONNX Runtime
        and TensorRT open by path)."""
        path = artifact_file(self.path, MODEL_FILE)
        if path is None:
            raise TQExportError(f"{self.path} has no {MODEL_FILE}; rebuild the artifact")
        return path


def open_artifact(path: str | Path) -> Artifact:
    """Validate presence, spec, graph I/O against the spec, and weight-file integrity; every
    file is checked by ``contract.files.artifact_file`` (regular, inside the artifact)."""
    root = Path(path)
    kind = validate.path_kind(root)
    if kind is None:
        raise TQExportError(f"artifact {root} not found; build one with `tqexport build`")
    if kind != "a folder":
        raise TQExportError(
            f"artifact {root} is {kind}, not an artifact folder; give the folder `tqexport "
            "build -o` wrote"
        )
    spec_file = root / SPEC_FILE
    raw = read_artifact_file(root, SPEC_FILE, MAX_SPEC_BYTES + 1)  # the loader refuses more
    if raw is None:
        raise TQExportError(f"{root} has no {SPEC_FILE}; is it a tqexport artifact?")
    try:
        data = parse_spec_json(raw)
        spec = spec_from_dict(data)
    except SpecError as e:
        raise TQExportError(f"{spec_file}: {e}") from None
    model_file = root / MODEL_FILE
    serialized = read_artifact_file(root, MODEL_FILE)
    if serialized is None:
        raise TQExportError(f"{root} has no {MODEL_FILE}; rebuild the artifact")
    try:
        graph = onnx.load_model_from_string(serialized)
    except Exception as e:  # onnx raises DecodeError and others for a damaged file
        raise TQExportError(
            f"{model_file} is not a readable ONNX model ({type(e).__name__}); "
            "it may be truncated, rebuild the artifact"
        ) from None
    need = _check_external_data(graph, model_file)
    _check_io(spec, graph, model_file)
    try:
        embedded = parse_spec_json(read_spec_metadata(graph))
    except SpecError as e:
        raise TQExportError(f"{model_file}: its embedded spec: {e}") from None
    if embedded != data:
        raise TQExportError(f"{spec_file} differs from the spec embedded in {MODEL_FILE}")
    _check_weights(root, need)
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
            try:
                elem = onnx.helper.tensor_dtype_to_np_dtype(g.type.tensor_type.elem_type)
            except (KeyError, ValueError, TypeError):
                elem = f"element type {g.type.tensor_type.elem_type}"
            if str(elem) != w["dtype"]:
                raise TQExportError(
                    f"{model_file}: {g.name} is {elem} in the graph but {w['dtype']} in the spec"
                )


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model that may hold data: initializers, sparse initializers and
    tensor attributes of nodes, in the graph, its subgraphs and the model's functions."""
    graphs = [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            g = graphs.pop()
            yield from g.initializer
            for sp in g.sparse_initializer:
                yield from (sp.values, sp.indices)
            nodes.extend(g.node)
            continue
        for a in nodes.pop().attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sp in [a.sparse_tensor] * a.HasField("sparse_tensor") + list(a.sparse_tensors):
                yield from (sp.values, sp.indices)
            if a.HasField("g"):
                graphs.append(a.g)
            graphs.extend(a.graphs)


def _check_external_data(graph: onnx.ModelProto, model_file: Path) -> int:
    """Every external tensor lives in the artifact's own weights file: refuse any other location
    (absolute, ``..``, another file) before anything follows it. Returns the bytes needed."""
    need = 0
    for t in _tensors(graph):
        if not t.external_data and t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location")
        if location != WEIGHTS_FILE:
            raise TQExportError(
                f"{model_file}: tensor {t.name[:80]!r} keeps its data at {location!r:.120}, not "
                f"in the artifact's {WEIGHTS_FILE}; refusing to read outside the artifact, "
                "rebuild it"
            )
        ends = []
        for key in ("offset", "length"):
            text = info.get(key, "0")
            if not (text.isascii() and text.isdigit() and len(text) <= _MAX_OFFSET_DIGITS):
                raise TQExportError(
                    f"{model_file}: tensor {t.name[:80]!r} has external-data {key} "
                    f"{text!r:.40}, not a byte count; rebuild the artifact"
                )
            ends.append(int(text))
        need = max(need, sum(ends))
    return need


def _check_weights(root: Path, need: int) -> None:
    """The weights file (when the graph has external data) is a regular file inside the
    artifact, at least as long as the graph's tensors need."""
    if need:
        data = artifact_file(root, WEIGHTS_FILE)
        if data is None or data.stat().st_size < need:
            raise TQExportError(
                f"{root / WEIGHTS_FILE} is missing or truncated; rebuild the artifact"
            )
