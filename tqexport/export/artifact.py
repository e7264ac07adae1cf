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
import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from tqexport import validate
from tqexport.contract.files import (
    MODEL_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    set_spec_metadata,
    write_manifest,
)
from tqexport.errors import TQExportError
from tqexport.export.onnx import export_model
from tqexport.export.outdir import Staging, check_target
from tqexport.export.source import BuildSource
from tqexport.kvquant import transforms
from tqexport.models.config import describe_model
from tqexport.models.loader import LoadedModel
from tqexport.resolve import resolve
from tqexport.spec import BuildRequest, ModelSpec
from tqexport.spec.weights import StoredTensor, WeightsSpec
from tqexport.weights.graph import store_weights
from tqexport.weights.precision import ACCURACY_LEVEL

#: vLLM's calculate_kv_scales: k_scale = max|k| / 200, v_scale = max|v| / 100.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


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


def held_out_calibration_text(min_chars: int = 24000) -> str:
    """The default calibration text (scales, key transforms, ``calibrate``): pydoc topics from
    the END of the sorted keys (at least ``min_chars``), so it shares nothing with the start of
    the evaluation text that ``bench quality`` scores."""
    from pydoc_data.topics import topics

    picked: list[str] = []
    for key in reversed(sorted(topics)):
        picked.insert(0, topics[key])
        if sum(map(len, picked)) >= min_chars:
            break
    return "\n\n".join(picked)


def _tokens(lm: LoadedModel, spec: ModelSpec, text: str, max_tokens: int) -> list[int]:
    if lm.tokenizer is not None:
        return lm.tokenizer(text)["input_ids"][:max_tokens]
    vocab = int(spec.model.get("vocab_size") or 256)
    return [b % vocab for b in text.encode()[:max_tokens]]


def _prefill(lm: LoadedModel, spec: ModelSpec, tokens: list[int], **observers) -> None:
    """One functional prefill of ``tokens`` from an empty cache, for the observers' sake."""
    from tqexport.contract.caches import allocate_caches
    from tqexport.contract.steps import SeqChunk, build_step, ordered_inputs
    from tqexport.models.paged import PagedCausalLM

    blocks = -(-len(tokens) // spec.block_size)
    caches = allocate_caches(spec, blocks + 1)
    tables = [list(range(1, blocks + 1)) for _ in spec.groups]
    step = build_step(spec, [SeqChunk(tokens, 0, tables, "last")])
    module = PagedCausalLM(lm.model, spec, mode="functional", **observers)
    with torch.no_grad():
        module(*ordered_inputs(spec, step, caches))


#: per model (weakly held: a freed model's id may be reused), per (text, tokens, window)
_KEY_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def key_statistics(
    lm: LoadedModel, text: str, max_tokens: int = 4096, window: int = 2048
) -> dict[int, transforms.KeyStats]:
    """Per-layer key/query statistics of the UNQUANTIZED model over ``text`` (prefills of
    ``window`` tokens from an empty cache), so they depend on the model and text alone; kept
    for the process (a bench scores several transforms of one model)."""
    key = (hashlib.sha256(text.encode()).hexdigest(), max_tokens, window)
    cached = _KEY_STATS.setdefault(lm.model, {})
    if key not in cached:
        plain = resolve(lm.description, BuildRequest()).spec
        tokens = _tokens(lm, plain, text, max_tokens)
        stats: dict[int, transforms.KeyStats] = {}

        def observe(layer, q, k, positions):
            stats.setdefault(layer.index, transforms.KeyStats()).add(q, k, positions)

        for at in range(0, len(tokens), window):
            _prefill(lm, plain, tokens[at : at + window], key_observer=observe)
        cached[key] = stats
    return cached[key]


def calibrate_key_transforms(
    lm: LoadedModel, text: str, kinds: tuple[str, ...]
) -> dict[int, transforms.KeyTransform]:
    """Every layer's fitted key transform (``signs`` alone needs no text); resolve attaches
    them to the layers it quantizes."""
    stats = key_statistics(lm, text) if transforms.needs_text(kinds) else {}
    return {
        la.index: transforms.fit(
            kinds,
            stats.get(la.index),
            la.index,
            num_kv_heads=la.num_kv_heads,
            head_size=la.head_size,
        )
        for la in lm.description.layers
    }


def calibrate_scales(lm: LoadedModel, spec: ModelSpec, text: str, max_tokens: int = 512):
    """Per-layer (k_scale, v_scale) from one prefill of ``text``, vLLM's rule (max|x| / range),
    each rounded to a float32: the value a node attribute (and so a plugin) carries exactly."""
    amax: dict[int, list[float]] = {}

    def observe(layer, k, v):
        amax[layer.index] = [float(k.abs().max()), float(v.abs().max())]

    _prefill(lm, spec, _tokens(lm, spec, text, max_tokens), observer=observe)

    def f32(x: float) -> float:
        return float(torch.tensor(max(x, 1e-8), dtype=torch.float32))

    return {i: (f32(k / K_SCALE_RANGE), f32(v / V_SCALE_RANGE)) for i, (k, v) in amax.items()}


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
    build stores any) replace their stand-ins, their bytes written to ``data_file`` as made."""
    graph = export_model(source.export_model, spec, request.opset)
    stored = source.export
    if stored is None:
        return graph, spec
    records = store_weights(graph, stored.stored, data_file=data_file)
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
