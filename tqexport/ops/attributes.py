"""The static parameters of each op node, derived from a layer's spec (one place for both ops).

Node attributes carry them (TensorRT plugins read them); the ONNX function body of a node is
chosen by ``variant``, a readable id of exactly these parameters, so layers that store and
attend alike share one function body.
"""

from __future__ import annotations

import hashlib
import json

from tqexport.spec import KVCacheSpec, LayerSpec

DOMAIN = "tqexport"
CACHE_WRITE = "CacheWrite"
PAGED_ATTENTION = "PagedAttention"
#: ``y + (x's block sums) @ offsets``: what the offsets of a matrix's blocks (GGUF's mins) add
#: to its product, one node per matrix (:mod:`tqexport.weights.graph`)
ADD_BLOCK_OFFSETS = "AddBlockOffsets"
#: ``x * cos + rotate_half(x) * sin``: a rotary embedding in one node
#: (:mod:`tqexport.export.fusable`)
ROTATE_HALF = "RotateHalf"
#: ``sum = x + residual``, ``out = rms_norm(sum) * weight``: a residual add and the RMS norm
#: reading it in one node, both results out (vLLM's ``fused_add_rms_norm``;
#: :mod:`tqexport.export.block_fusions`)
FUSED_ADD_RMS_NORM = "FusedAddRMSNorm"
#: ``silu(x[..., :F]) * x[..., F:]`` over a last axis of ``2F``: a SwiGLU MLP's gate and up
#: products, packed into one product, in one node (vLLM's ``silu_and_mul``;
#: :mod:`tqexport.export.block_fusions`)
SILU_AND_MUL = "SiluAndMul"
#: the ops that only fuse standard ONNX ops (their bodies compute exactly that): a runtime with
#: no kernel for them (TensorRT) runs their bodies inlined
FUSIONS = (ROTATE_HALF, FUSED_ADD_RMS_NORM, SILU_AND_MUL)
#: the ONNX opset the bodies of AddBlockOffsets, RotateHalf, FusedAddRMSNorm and SiluAndMul
#: import (written by hand; a model of a later opset runs them as they are)
BODY_OPSET = 21
#: the version of the tqexport domain a model imports
DOMAIN_VERSION = 1


def import_domain(model) -> None:
    """Add the tqexport domain to an ONNX ``model``'s opset imports unless it is there."""
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=DOMAIN, version=DOMAIN_VERSION)


#: Every attribute a node may carry, with the Python type of its value: the TensorRT plugins
#: declare them from these tables, the native kernels read them by these names (generated
#: header) and the functions below make each node's from them, each value read from the spec
#: field of its name unless given. A cache's (both ops):
CACHE_ATTRS: dict[str, type] = {
    "kv_cache_dtype": str, "quant_mode": str, "model_dtype": str, "num_kv_heads": int,
    "head_size": int, "block_size": int, "k_scale": float, "v_scale": float,
}  # fmt: skip
#: a PagedAttention's own
ATTENTION_ATTRS: dict[str, type] = {"num_heads": int, "scale": float, "softcap": float,
                                    "window": int}  # fmt: skip
#: a PagedAttention's with a recent window (and sink tokens in it), only then present
SEGMENT_ATTRS: dict[str, type] = {"recent_window": int, "sink_tokens": int}
#: a FusedAddRMSNorm's: the norm's epsilon
NORM_ATTRS: dict[str, type] = {"epsilon": float}
#: every node's, after the static parameters
NODE_ATTRS: dict[str, type] = {"variant": str, "layer": int}


def _typed(table: dict[str, type], source, **given) -> dict:
    """Every attribute of ``table`` in its order and type: ``given`` where there, else the
    ``source`` field of its name (None is the type's zero)."""
    out = {}
    for name, kind in table.items():
        value = given[name] if name in given else getattr(source, name)
        out[name] = kind() if value is None else kind(value)
    return out


def cache_write_attrs(c: KVCacheSpec) -> dict:
    """Static parameters of a CacheWrite into a cache of spec ``c``."""
    return _typed(CACHE_ATTRS, c, quant_mode=c.mode.name)


def paged_attention_attrs(layer: LayerSpec, num_heads: int) -> dict:
    """Static parameters of a layer's PagedAttention; ``recent_window`` (and ``sink_tokens``)
    only when it has one, so other layers keep exactly their earlier attributes and variants."""
    segments = {n: kind for n, kind in SEGMENT_ATTRS.items() if getattr(layer, n)}
    return {
        **cache_write_attrs(layer.cache),
        **_typed(ATTENTION_ATTRS, layer, num_heads=num_heads),
        **_typed(segments, layer),
    }


def variant(op: str, attrs: dict) -> str:
    """Readable, stable id of an op's static parameters: ``<dtype>_<8 hex digits>``."""
    digest = hashlib.sha256(json.dumps([op, attrs], sort_keys=True).encode()).hexdigest()[:8]
    return f"{attrs['kv_cache_dtype']}_{digest}"


def node_attrs(op: str, layer: LayerSpec, num_heads: int, binding: int = 0) -> dict:
    """Everything a node carries: static params, variant, layer index, TensorRT namespace
    (a CacheWrite writes into ``layer.bindings[binding]``)."""
    attrs = (
        cache_write_attrs(layer.bindings[binding].cache)
        if op == CACHE_WRITE
        else paged_attention_attrs(layer, num_heads)
    )
    node = _typed(NODE_ATTRS, None, variant=variant(op, attrs), layer=layer.index)
    return {**attrs, **node, "plugin_namespace": DOMAIN}


def attention_segments(layer: LayerSpec, caches: list, block_tables: list) -> dict:
    """PagedAttention's operands beyond the layer's first binding, by keyword: the written
    cache and block table of its recent-window binding, the window and the sink tokens it
    also holds (none: empty, 0, 0)."""
    if len(layer.bindings) == 1:
        return {
            "recent_cache": [],
            "recent_block_tables": None,
            "recent_window": 0,
            "sink_tokens": 0,
        }
    return {
        "recent_cache": caches[1],
        "recent_block_tables": block_tables[1],
        "recent_window": layer.recent_window,
        "sink_tokens": layer.sink_tokens,
    }
