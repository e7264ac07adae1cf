"""``tqexport build``: model -> artifact directory (graph, spec, tokenizer), written atomically.

Layout of an artifact:
``model.onnx`` + ``model.onnx.data`` (weights), ``tqexport.json`` (the spec, also embedded in the
graph's metadata), tokenizer files, chat template and ``generation_config.json`` when the model
has them, and ``tqexport.files.json`` (the list of these files). Everything is written into a
staging sibling that is swapped in at the end, so a failed build leaves nothing behind (see
:mod:`tqexport.export.outdir` for what ``--force`` may replace).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from tqexport import validate
from tqexport.contract.files import MODEL_FILE, SPEC_FILE, WEIGHTS_FILE, write_manifest
from tqexport.errors import TQExportError
from tqexport.export.onnx import DEFAULT_OPSET, export_model
from tqexport.export.outdir import Staging, check_target
from tqexport.kvquant import transforms
from tqexport.models.config import describe_model
from tqexport.models.loader import LoadedModel, load_model
from tqexport.resolve import resolve
from tqexport.spec import ModelSpec
from tqexport.validate import DEFAULT_BLOCK_SIZE

#: vLLM's calculate_kv_scales: k_scale = max|k| / 200, v_scale = max|v| / 100.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


@dataclass
class BuildOptions:
    kv_cache_dtype: str = "auto"
    skip_layers: Sequence[str] = ()
    boundary: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    recent_window: int = 0
    sink_tokens: int = 0  # the first N tokens, kept in the recent-window cache
    dtype: str | None = None
    opset: int = DEFAULT_OPSET
    force: bool = False
    kv_scales: str = "1.0"  # a number, or "calibrate"
    calibration_text: Path | None = None
    key_transform: str = transforms.NONE  # kinds joined by "+", see kvquant.transforms
    kv_layers: str | None = None  # per-layer caches, see tqexport.kv_layers


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


def parse_kv_scales(value: str) -> float | None:
    if value == "calibrate":
        return None
    try:
        scale = float(value)
    except ValueError:
        raise TQExportError(f"--kv-scales must be a number or 'calibrate', got {value!r}") from None
    if not 0 < scale < float("inf"):  # also refuses nan: tqexport.json must stay JSON
        raise TQExportError(f"--kv-scales must be a positive finite number, got {value}")
    return scale


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
        plain = resolve(lm.description, "auto").spec
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


def _save_tokenizer(lm: LoadedModel, target: Path) -> None:
    if lm.tokenizer is not None:
        lm.tokenizer.save_pretrained(target)
    if lm.generation_config is not None:
        lm.generation_config.save_pretrained(target)


def check_options(model: str, options: BuildOptions):
    """Validate options and resolve from the config only: bad input fails before weights load."""
    fixed_scale = parse_kv_scales(options.kv_scales)
    kinds = transforms.parse_key_transform(options.key_transform)
    if options.calibration_text is not None:
        if fixed_scale is not None and not transforms.needs_text(kinds):
            raise TQExportError(
                "--calibration-text is read only by --kv-scales calibrate (and "
                "--kv-key-transform center or smooth); add --kv-scales calibrate or drop "
                "--calibration-text"
            )
        validate.text_file(options.calibration_text, "--calibration-text")
    desc = describe_model(model, options.dtype)
    resolve(
        desc,
        options.kv_cache_dtype,
        options.skip_layers,
        boundary=options.boundary,
        block_size=options.block_size,
        recent_window=options.recent_window,
        sink_tokens=options.sink_tokens,
        key_transform=kinds,
        kv_layers=options.kv_layers,
    )


def resolve_spec(
    model: str,
    lm: LoadedModel,
    options: BuildOptions,
    progress: Callable[[str], None] = lambda stage: None,
) -> tuple[ModelSpec, list[str]]:
    """The artifact's spec for a loaded model (kv scales calibrated when asked) and warnings."""
    fixed_scale = parse_kv_scales(options.kv_scales)
    kinds = transforms.parse_key_transform(options.key_transform)
    kw = dict(
        boundary=options.boundary,
        block_size=options.block_size,
        recent_window=options.recent_window,
        sink_tokens=options.sink_tokens,
        key_transform=kinds,
        kv_layers=options.kv_layers,
    )
    own_text = None
    if options.calibration_text is not None:
        own_text = validate.text_file(options.calibration_text, "--calibration-text")
    plain = resolve(lm.description, options.kv_cache_dtype, options.skip_layers, **kw)
    scales = fitted = None
    if fixed_scale is None:
        progress("calibrate")
        scales = calibrate_scales(lm, plain.spec, own_text or held_out_calibration_text())
    elif fixed_scale != 1.0:
        scales = {la.index: (fixed_scale, fixed_scale) for la in lm.description.layers}
    if kinds:
        progress("calibrate")
        text = own_text or held_out_calibration_text()
        fitted = calibrate_key_transforms(lm, text, kinds)
    resolved = resolve(
        lm.description,
        options.kv_cache_dtype,
        options.skip_layers,
        kv_scales=scales,
        key_transforms=fitted,
        **kw,
    )
    spec = resolved.spec
    spec = ModelSpec(
        model={**spec.model, "path": _source_path(model)},
        dtype=spec.dtype,
        block_size=spec.block_size,
        layers=spec.layers,
        groups=spec.groups,
        request={**spec.request, "kv_scales": options.kv_scales, "opset": options.opset},
        io=spec.graph_io(),
    )
    return spec, list(resolved.warnings)


def build_artifact(
    model: str,
    out_dir: Path,
    options: BuildOptions,
    progress: Callable[[str], None] = lambda stage: None,
) -> BuildResult:
    """Load, resolve, export and save; raises TQExportError on bad input before heavy work."""
    target = check_target(Path(out_dir), options.force)
    check_options(model, options)
    staging = Staging(target, options.force)  # locks, proves the location writable
    try:
        progress("load")
        lm = load_model(model, options.dtype)
        spec, warnings = resolve_spec(model, lm, options, progress)
        staging.check_free_space(_weight_bytes(lm) + (64 << 20))
        progress("export")
        graph = export_model(lm.model, spec, options.opset)
        progress("save")
        try:
            _save(graph, spec, lm, staging.path)
            replaced = staging.commit()
        except OSError as e:
            why = e.strerror or str(e)
            raise TQExportError(f"cannot write the artifact to {out_dir}: {why}") from None
    except BaseException:
        staging.discard()
        raise
    return BuildResult(target, spec, warnings, replaced)


def _save(graph: onnx.ModelProto, spec: ModelSpec, lm: LoadedModel, tmp: Path) -> None:
    onnx.save_model(
        graph,
        tmp / MODEL_FILE,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=WEIGHTS_FILE,
    )
    onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
    (tmp / SPEC_FILE).write_text(spec.to_json() + "\n")
    _save_tokenizer(lm, tmp)
    write_manifest(tmp)


def _weight_bytes(lm: LoadedModel) -> int:
    """Bytes the exported weights take (what model.onnx.data will hold, roughly)."""
    return sum(p.numel() * p.element_size() for p in lm.model.state_dict().values())


def _source_path(model: str) -> str:
    """What parity needs to reload the source model: a built-in name or an absolute path."""
    from tqexport.models.builtins import BUILTIN_NAMES

    return model if model in BUILTIN_NAMES else str(Path(model).resolve())
