"""Build a TensorRT engine (``engine.plan``) from an artifact, the tqexport nodes as plugins.

The ONNX graph is parsed with each ``tqexport`` node renamed to its plugin (one per op and cache
arity, see :mod:`trt_plugins.contract`), a strongly typed network preferring the AOT plugin
implementations, and one optimization profile from the serving limits. ``tensorrt`` is imported
lazily: without it (or without a GPU) the build stops with a one-line error saying what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx.inliner

from tqexport import validate
from tqexport.contract.artifact import open_artifact
from tqexport.contract.files import ENGINE_FILE, PROFILE_FILE
from tqexport.errors import TQExportError
from tqexport.ops.attributes import DOMAIN, FUSIONS, cache_write_attrs
from tqexport.safe_files import write_file
from tqexport.spec import ModelSpec
from trt_plugins.toolchain import require_gpu, require_tensorrt


def check_layers(spec: ModelSpec) -> None:
    """Refuse (one line) a spec with a layer no TensorRT plugin covers."""
    from trt_plugins.contract import codec_of

    for layer in spec.layers:
        codec_of({**cache_write_attrs(layer.cache), "layer": layer.index})


def check_weights(spec: ModelSpec) -> None:
    """Refuse (one line) an artifact whose matrices are stored in blocks: TensorRT's blocked
    dequantize takes only INT4 codes with strictly positive scales, which a GGUF's blocks do not
    promise, and no engine of that form has been built and checked yet."""
    w = spec.weights
    blocked = [t for t in (w.tensors if w is not None else ()) if t.block_size is not None]
    if blocked:
        raise TQExportError(
            f"engine: this artifact stores {len(blocked)} matrices in integer blocks "
            f"({w.summary()}); TensorRT engines are built from float weights for now: rebuild "
            "with --weights fp16 (or fp32)"
        )


def node_attributes(node: onnx.NodeProto) -> dict:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}


def unfuse(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its fusion nodes (RotateHalf, FusedAddRMSNorm, SiluAndMul) replaced by
    their function bodies (standard ONNX ops TensorRT fuses itself; no plugin implements
    them)."""
    return onnx.inliner.inline_selected_functions(model, [(DOMAIN, op) for op in FUSIONS])


def use_plugins(model: onnx.ModelProto) -> dict[str, int]:
    """Rename every tqexport node to its plugin (in place); returns nodes per plugin name.

    The renamed op has no model-local function, so TensorRT can only resolve it to the plugin.
    """
    from trt_plugins.contract import plugin_for

    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        name = plugin_for(node.op_type, node_attributes(node))
        node.op_type = name
        node.overload = ""
        counts[name] = counts.get(name, 0) + 1
    return counts


def profile_shapes(
    spec: ModelSpec, max_batch: int, max_tokens: int, max_blocks: int
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape of every graph input: opt is a full decode batch.

    ``max_blocks`` bounds the cache pool (dim 0 of every cache) and so each block table's width.
    """
    if max_batch < 1 or max_tokens < max_batch or max_blocks < 2:
        raise TQExportError(
            "need --max-batch >= 1, --max-num-batched-tokens >= --max-batch and --max-blocks >= 2 "
            f"(got {max_batch}, {max_tokens}, {max_blocks})"
        )
    dims = {
        "T": (1, max_batch, max_tokens),
        "num_seqs": (1, max_batch, max_batch),
        "num_seqs_plus_1": (2, max_batch + 1, max_batch + 1),
        "L": (0, max_batch, max_tokens),
        "num_blocks": (2, max_blocks, max_blocks),
        "num_recent_blocks": (2, max_blocks, max_blocks),
    }
    for g in spec.groups:
        dims[f"max_blocks_{g.id}"] = (1, max_blocks - 1, max_blocks - 1)
    out = {}
    for x in spec.graph_io()["inputs"]:
        sizes = [dims[d] if isinstance(d, str) else (d, d, d) for d in x["shape"]]
        out[x["name"]] = tuple(tuple(s[i] for s in sizes) for i in range(3))
    return out


def check_sizes(max_batch: int, max_tokens: int, max_blocks: int) -> None:
    """The engine profile's limits (``--max-batch``, ...), before anything is read."""
    validate.integer(max_batch, "--max-batch", 1, validate.MAX_NUM_SEQS)
    validate.integer(max_tokens, "--max-num-batched-tokens", 1, validate.MAX_NUM_BATCHED_TOKENS)
    validate.integer(max_blocks, "--max-blocks", 2, validate.MAX_NUM_BLOCKS)


def build_engine(artifact_dir: str | Path, max_batch: int, max_tokens: int, max_blocks: int,
                 workspace_gib: float = 4.0) -> Path:  # fmt: skip
    """Write ``engine.plan`` (and its profile limits, ``engine.json``) into the artifact."""
    art = open_artifact(artifact_dir)
    check_layers(art.spec)
    check_weights(art.spec)
    shapes = profile_shapes(art.spec, max_batch, max_tokens, max_blocks)
    trt = require_tensorrt()
    require_gpu()
    import trt_plugins.plugins  # noqa: F401  (registers the plugins)

    model = onnx.load(str(art.model_file), load_external_data=False)
    model = unfuse(model)
    use_plugins(model)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    # the path lets the parser find the external weights file next to model.onnx
    if not parser.parse(model.SerializeToString(), str(art.model_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TQExportError(f"TensorRT could not parse {art.model_file}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    if hasattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03"):
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TQExportError("TensorRT failed to build the engine (see its log above)")
    limits = {"max_batch": max_batch, "max_num_batched_tokens": max_tokens,
              "max_blocks": max_blocks, "tensorrt": trt.__version__}  # fmt: skip
    _replace(art.path / ENGINE_FILE, bytes(plan))
    _replace(art.path / PROFILE_FILE, json.dumps(limits, indent=2).encode())
    return art.path / ENGINE_FILE


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` as a new file (a fresh temporary name, then renamed over it): a link or
    FIFO left at ``path`` is replaced, never written through, and no reader sees half a file."""
    write_file(path, data)
