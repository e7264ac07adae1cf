"""What each TensorRT plugin launches, derived from its ONNX node's attributes alone.

A node's attributes (``tqexport.ops.attributes``) give the layer's codec; from it come the
TensorRT-order Triton entry point (arguments: the node's inputs, then int32 scalars, then the
outputs), its constexprs, the grid and the scalar values as functions of the input shapes.
Shape arithmetic uses only ``*``, ``[]`` and constants, so the same functions serve plain ints
(tests, emulation) and TensorRT's symbolic shape expressions (the AOT launch).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import Codec, codec_for
from tqexport.ops.attributes import (
    ATTENTION_ATTRS,
    CACHE_ATTRS,
    CACHE_WRITE,
    DOMAIN,
    NODE_ATTRS,
    PAGED_ATTENTION,
    SEGMENT_ATTRS,
)
from tqexport.ops.triton import cache_write as triton_write
from tqexport.ops.triton import trt_attention
from tqexport.ops.triton.common import supports

NAMESPACE = DOMAIN
#: Attributes every plugin declares, with the Python type TensorRT hands them over as
#: (``plugin_namespace`` only routes the node and is not declared).
CACHE_WRITE_ATTRS: dict[str, type] = {**CACHE_ATTRS, **NODE_ATTRS}
PAGED_ATTENTION_ATTRS: dict[str, type] = {**CACHE_ATTRS, **ATTENTION_ATTRS, **NODE_ATTRS}
#: A PagedAttention node of a layer with a recent window also carries ``recent_window``.
PAGED_ATTENTION_RECENT_ATTRS: dict[str, type] = {
    **CACHE_ATTRS, **ATTENTION_ATTRS, "recent_window": SEGMENT_ATTRS["recent_window"],
    **NODE_ATTRS,
}  # fmt: skip
#: ... and one whose recent cache also holds the sink tokens carries ``sink_tokens`` too.
PAGED_ATTENTION_SINK_ATTRS: dict[str, type] = {
    **CACHE_ATTRS, **ATTENTION_ATTRS, **SEGMENT_ATTRS, **NODE_ATTRS
}  # fmt: skip
ATTRS = {CACHE_WRITE: CACHE_WRITE_ATTRS, PAGED_ATTENTION: PAGED_ATTENTION_ATTRS}
#: attention plugins by what the layer's recent cache holds: nothing, a window, also sinks
_SEGMENT_ATTRS = {"Recent": PAGED_ATTENTION_RECENT_ATTRS, "RecentSink": PAGED_ATTENTION_SINK_ATTRS}

# A QDP plugin has a fixed number of inputs and outputs, so each op has one plugin per cache
# arity: "Slot" (TurboQuant: K and V packed in ONE uint8 tensor) and "KV" (two tensors); a layer
# with a recent window attends through a "...Recent" plugin taking its recent cache and table
# as three more inputs (its recent cache is written by a plain CacheWriteKV node), and one
# whose recent cache also holds sink tokens through "...RecentSink" (same inputs).
_STEPS = ("block_tables", "seq_lens", "query_start_loc", "positions")
_RECENT = ("recent_k_cache", "recent_v_cache", "recent_block_tables")
_INPUTS = {
    ("CacheWrite", 1, ""): ("cache", "k", "v", "slot_mapping"),
    ("CacheWrite", 2, ""): ("k_cache", "v_cache", "k", "v", "slot_mapping"),
    ("PagedAttention", 1, ""): ("q", "cache", *_STEPS),
    ("PagedAttention", 2, ""): ("q", "k_cache", "v_cache", *_STEPS),
    **{("PagedAttention", 1, seg): ("q", "cache", *_STEPS, *_RECENT) for seg in _SEGMENT_ATTRS},
    **{
        ("PagedAttention", 2, seg): ("q", "k_cache", "v_cache", *_STEPS, *_RECENT)
        for seg in _SEGMENT_ATTRS
    },
}
_OUTPUTS = {"CacheWrite": {1: ("cache_out",), 2: ("k_cache_out", "v_cache_out")},
            "PagedAttention": {1: ("out",), 2: ("out",)}}  # fmt: skip
_SUFFIX = {1: "Slot", 2: "KV"}
#: int32 scalars after the inputs: the block tables' dims (input name, dim).
_SCALAR_DIMS = {"num_seqs": ("block_tables", 0), "max_blocks": ("block_tables", 1),
                "max_recent_blocks": ("recent_block_tables", 1)}  # fmt: skip


def plugin_name(op: str, num_cache_tensors: int, segments: str = "") -> str:
    """Registered plugin name (without namespace) for an op, its cache arity and what its
    recent cache holds (``""``: none, ``"Recent"``: a window, ``"RecentSink"``: also sinks)."""
    return f"{op}{_SUFFIX[num_cache_tensors]}{segments}"


PLUGINS = {plugin_name(*key): key for key in _INPUTS}


class UnsupportedLayerError(TQExportError):
    """A layer's kv-cache dtype has no Triton kernel, hence no TensorRT plugin."""


def inputs_of(plugin: str) -> tuple[str, ...]:
    return _INPUTS[PLUGINS[plugin]]


def outputs_of(plugin: str) -> tuple[str, ...]:
    op, arity, _ = PLUGINS[plugin]
    return _OUTPUTS[op][arity]


def attrs_of(plugin: str) -> dict[str, type]:
    op, _, segments = PLUGINS[plugin]
    return _SEGMENT_ATTRS[segments] if segments else ATTRS[op]


def codec_of(attrs: dict) -> Codec:
    """The layer's codec from its node attributes; refused clearly where no kernel exists."""
    kv = attrs["kv_cache_dtype"]
    codec = codec_for(kv, int(attrs["head_size"]), attrs["model_dtype"],
                      float(attrs["k_scale"]), float(attrs["v_scale"]))  # fmt: skip
    if not supports(codec):
        raise UnsupportedLayerError(
            f"layer {attrs.get('layer', '?')}: kv-cache dtype {kv} ({attrs['quant_mode']}, head "
            f"size {attrs['head_size']}) has no Triton kernel, so no TensorRT plugin; TensorRT "
            "covers auto, fp8, fp8_e5m2 and TurboQuant (turboquant_*, tqx_*) at power-of-two "
            "head sizes"
        )
    return codec


def num_cache_tensors(attrs: dict) -> int:
    return len(codec_of(attrs).tensors)


def plugin_for(op: str, attrs: dict) -> str:
    """The plugin a node of ``op`` with these attributes runs as."""
    segments = ""
    if op == PAGED_ATTENTION and attrs.get("recent_window"):
        segments = "RecentSink" if attrs.get("sink_tokens") else "Recent"
    return plugin_name(op, num_cache_tensors(attrs), segments)


@dataclass(frozen=True)
class LaunchPlan:
    """One node's kernel: entry point, signature, constexprs and the shape-derived launch."""

    plugin: str
    kernel: Callable
    signature: dict[str, str]
    constexprs: dict
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    options: dict = field(default_factory=dict)

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Kernel parameters that are not constexpr, in order (the PTX ``.entry`` list)."""
        return tuple(n for n, t in self.signature.items() if t != "constexpr")

    @property
    def aliases(self) -> dict[int, int]:
        """Output index -> input index it aliases (caches are updated in place)."""
        return {i: i for i in range(len(self.outputs))} if self.plugin.startswith("Cache") else {}

    def grid(self, shapes: Sequence[Sequence]) -> tuple:
        """Programs (x, y, z) from the input shapes: (T*KVH) for a write, (T, KVH, 1) to attend."""
        c = self.constexprs
        tokens = shapes[self.inputs.index("q" if "q" in self.inputs else "k")][0]
        if self.plugin.startswith("Cache"):
            return (tokens * c["H"], 1, 1)
        return (tokens, c["KVH"], 1)

    def scalar_values(self, shapes: Sequence[Sequence]) -> tuple:
        """The int32 scalars, each a block table's dim (``max_recent_blocks``: the recent one)."""
        dims = [_SCALAR_DIMS[n] for n in self.scalars]
        return tuple(shapes[self.inputs.index(table)][dim] for table, dim in dims)


def launch_plan(plugin: str, attrs: dict) -> LaunchPlan:
    """The launch plan of ``plugin`` for a node with these attributes."""
    op, _, recent = PLUGINS[plugin]
    codec = codec_of(attrs)
    want = plugin_for(op, attrs)
    if want != plugin:
        raise TQExportError(
            f"layer {attrs.get('layer', '?')}: {plugin} does not fit a node with "
            f"{attrs['kv_cache_dtype']} ({len(codec.tensors)} cache tensor(s), recent window "
            f"{attrs.get('recent_window', 0)}, sink tokens {attrs.get('sink_tokens', 0)}); use "
            f"{want}"
        )
    heads, dtype = int(attrs["num_kv_heads"]), attrs["model_dtype"]
    if op == CACHE_WRITE:
        fn, sig, consts = triton_write.trt_kernel_variant(codec, heads, dtype)
        scalars, options = (), dict(triton_write.LAUNCH)
    else:
        fn, sig, consts = trt_attention.trt_kernel_variant(
            codec, int(attrs["num_heads"]), heads, int(attrs["block_size"]), dtype,
            scale=float(attrs["scale"]), softcap=float(attrs["softcap"]),
            window=int(attrs["window"]), recent_window=int(attrs.get("recent_window", 0)),
            sink_tokens=int(attrs.get("sink_tokens", 0)),
        )  # fmt: skip
        scalars = ("num_seqs", "max_blocks") + (("max_recent_blocks",) if recent else ())
        options = {}
    return LaunchPlan(plugin, fn, sig, consts, inputs_of(plugin), scalars, outputs_of(plugin),
                      options)  # fmt: skip


def output_shapes(plugin: str, shapes: Sequence[Sequence]) -> list[tuple]:
    """Output shapes: a write's caches keep their shapes; attention's output is q's shape."""
    if plugin.startswith("Cache"):
        return [tuple(s) for s in shapes[: len(outputs_of(plugin))]]
    return [tuple(shapes[0])]


def register_signature(plugin: str, tensor_type: type) -> inspect.Signature:
    """The ``@trtp.register`` signature: tensor inputs, then every declared attribute."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind, annotation=tensor_type) for n in inputs_of(plugin)]
    params += [inspect.Parameter(n, kind, annotation=t) for n, t in attrs_of(plugin).items()]
    n_out = len(outputs_of(plugin))
    ret = tensor_type if n_out == 1 else tuple[(tensor_type,) * n_out]
    return inspect.Signature(params, return_annotation=ret)
