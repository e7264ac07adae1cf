"""The static parameters of each op node, derived from a layer's spec (one place for both ops).

Node attributes carry them (TensorRT plugins read them); the ONNX function body of a node is
chosen by ``variant``, a readable id of exactly these parameters, so layers that store and
attend alike share one function body.
"""

from __future__ import annotations

import hashlib
import json

from tqexport.spec import LayerSpec

DOMAIN = "tqexport"
CACHE_WRITE = "CacheWrite"
PAGED_ATTENTION = "PagedAttention"


def cache_write_attrs(layer: LayerSpec, recent: bool = False) -> dict:
    """Static parameters of a layer's CacheWrite (``recent``: the write into its recent cache)."""
    c = layer.recent if recent else layer.cache
    return {
        "kv_cache_dtype": c.kv_cache_dtype,
        "quant_mode": c.mode.name,
        "model_dtype": c.model_dtype,
        "num_kv_heads": c.num_kv_heads,
        "head_size": c.head_size,
        "block_size": c.block_size,
        "k_scale": float(c.k_scale),
        "v_scale": float(c.v_scale),
    }


def paged_attention_attrs(layer: LayerSpec, num_heads: int) -> dict:
    """Static parameters of a layer's PagedAttention; ``recent_window`` only when it has one,
    so layers without a recent window keep exactly their earlier attributes and variants."""
    return {
        **cache_write_attrs(layer),
        "num_heads": num_heads,
        "scale": float(layer.scale),
        "softcap": float(layer.softcap or 0.0),
        "window": int(layer.window or 0),
    } | ({"recent_window": layer.recent_window} if layer.recent_window else {})


def variant(op: str, attrs: dict) -> str:
    """Readable, stable id of an op's static parameters: ``<dtype>_<8 hex digits>``."""
    digest = hashlib.sha256(json.dumps([op, attrs], sort_keys=True).encode()).hexdigest()[:8]
    return f"{attrs['kv_cache_dtype']}_{digest}"


def node_attrs(op: str, layer: LayerSpec, num_heads: int, recent: bool = False) -> dict:
    """Everything a node carries: static params, variant, layer index, TensorRT namespace."""
    attrs = (
        cache_write_attrs(layer, recent)
        if op == CACHE_WRITE
        else paged_attention_attrs(layer, num_heads)
    )
    return {
        **attrs,
        "variant": variant(op, attrs),
        "layer": layer.index,
        "plugin_namespace": DOMAIN,
    }
