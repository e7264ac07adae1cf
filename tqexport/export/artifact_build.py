"""``tqexport build``: model -> artifact directory (graph, spec, tokenizer), written atomically.

Layout of an artifact:
``model.onnx`` + ``model.onnx.data`` (weights), ``tqexport.json`` (the spec, also embedded in the
graph's metadata), tokenizer files, chat template and ``generation_config.json`` when the model
has them, and ``tqexport.files.json`` (the list of these files). Everything is written into a
staging sibling that is swapped in at the end, so a failed build leaves nothing behind (see
:mod:`tqexport.export.outdir` for what ``--force`` may replace).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from tqexport import validate
from tqexport.contract.files import (
    MODEL_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    set_spec_metadata,
    write_manifest,
)
from tqexport.errors import TQExportError
from tqexport.export.block_fusions import silu_and_muls
from tqexport.export.onnx import export_model
from tqexport.export.outdir import Staging, check_target
from tqexport.export.source import BuildSource
from tqexport.kvplan.fitting import (
    calibrate_key_transforms,
    calibrate_scales,
    held_out_calibration_text,
)
from tqexport.kvplan.resolve import resolve
from tqexport.models.config import describe_model
from tqexport.models.loader import LoadedModel
from tqexport.spec import BuildRequest, ModelSpec
from tqexport.spec.weights import StoredTensor, WeightsSpec
from tqexport.weights.graph import store_weights
from tqexport.weights.precision import ACCURACY_LEVEL


@dataclass
class BuildResult:
    out_dir: Path
    spec: ModelSpec
    warnings: list[str] = field(default_factory=list)
    #: what ``--force`` replaced ("the artifact that was in DIR (N files)"), None if nothing
    replaced: str | None = None

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.out_dir.iterdir() if p.is_file())


def check_request(model: str, request: BuildRequest) -> None:
    """Resolve from the config only and read the calibration text: bad input fails before the
    weights load."""
    if request.calibration_text is not None:
        validate.text_file(request.calibration_text, "--calibration-text")
    resolve(describe_model(model, request.dtype), request)
    BuildSource(model, request).check()


def resolve_spec(
    model: str,
    lm: LoadedModel,
    request: BuildRequest,
    progress: Callable[[str], None] = lambda stage: None,
) -> tuple[ModelSpec, list[str]]:
    """The artifact's spec for a loaded model (kv scales and key transforms fitted when asked)
    and the warnings."""
    own_text = None
    if request.calibration_text is not None:
        own_text = validate.text_file(request.calibration_text, "--calibration-text")
    fixed_scale = request.fixed_kv_scale
    scales = fitted = None
    if fixed_scale is None:
        progress("calibrate")
        plain = resolve(lm.description, request).spec
        scales = calibrate_scales(lm, plain, own_text or held_out_calibration_text())
    elif fixed_scale != 1.0:
        scales = {la.index: (fixed_scale, fixed_scale) for la in lm.description.layers}
    if request.key_transform:
        progress("calibrate")
        text = own_text or held_out_calibration_text()
        fitted = calibrate_key_transforms(lm, text, request.key_transform)
    resolved = resolve(lm.description, request, kv_scales=scales, key_transforms=fitted)
    model_id = {**resolved.spec.model, "path": _source_path(model)}
    spec = dataclasses.replace(resolved.spec, model=model_id, io=resolved.spec.graph_io())
    return spec, list(resolved.warnings)


def build_artifact(
    model: str,
    out_dir: Path,
    request: BuildRequest,
    progress: Callable[[str], None] = lambda stage: None,
    force: bool = False,
) -> BuildResult:
    """Load, resolve, export and save; raises TQExportError on bad input before heavy work.
    ``force`` replaces an existing artifact (:mod:`tqexport.export.outdir` says what may be)."""
    target = check_target(Path(out_dir), force)
    check_request(model, request)
    staging = Staging(target, force)  # locks, proves the location writable
    try:
        progress("load")
        source = BuildSource(model, request)
        spec, warnings = resolve_spec(model, source.as_loaded(), request, progress)
        source.release()
        staging.check_free_space(source.weight_bytes() + (64 << 20))
        progress("export")
        graph, spec = _export(source, spec, request, staging.path / WEIGHTS_FILE)
        warnings += source.export.notes if source.export is not None else []
        progress("save")
        try:
            _save(graph, spec, source.tokens, staging.path)
            replaced = staging.commit()
        except OSError as e:
            why = e.strerror or str(e)
            raise TQExportError(f"cannot write the artifact to {out_dir}: {why}") from None
    except BaseException:
        staging.discard()
        raise
    return BuildResult(target, spec, warnings, replaced)


def _export(source: BuildSource, spec: ModelSpec, request: BuildRequest, data_file: Path):
    """The graph of ``spec`` and the spec with its weights section: the stored weights (if the
    build stores any) replace their stand-ins, their bytes written to ``data_file`` as made,
    and each SwiGLU on a packed gate and up product becomes one node."""
    graph = export_model(source.export_model, spec, request.opset)
    stored = source.export
    if stored is None:
        return graph, spec
    records = store_weights(graph, stored.stored, data_file=data_file)
    silu_and_muls(graph)  # on the packed gate and up products store_weights made
    records += [StoredTensor(name, "fp32", None, kind) for name, kind in stored.floats.items()]
    spec = dataclasses.replace(spec, weights=WeightsSpec(tuple(records), ACCURACY_LEVEL))
    set_spec_metadata(graph, spec)
    return graph, spec


def _save(graph: onnx.ModelProto, spec: ModelSpec, tokens: tuple, tmp: Path) -> None:
    onnx.save_model(
        graph,
        tmp / MODEL_FILE,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=WEIGHTS_FILE,
    )
    onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
    (tmp / SPEC_FILE).write_text(spec.to_json() + "\n")
    tokenizer, generation_config = tokens
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    write_manifest(tmp)


def _source_path(model: str) -> str:
    """What parity needs to reload the source model: a built-in name or an absolute path."""
    from tqexport.models.builtins import BUILTIN_NAMES

    return model if model in BUILTIN_NAMES else str(Path(model).resolve())
