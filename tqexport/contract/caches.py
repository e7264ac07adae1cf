"""Allocate one set of cache tensors per layer, exactly as the layer's own spec says."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tqexport.kvquant.codecs import torch_dtype
from tqexport.spec import ModelSpec


def cache_output_name(cache_input: str) -> str:
    """The graph output that carries a cache input's updated tensor (``cache.L.role`` ->
    ``cache_out.L.role``, as ``LayerSpec.onnx_input``/``onnx_output`` name them)."""
    return cache_input.replace("cache.", "cache_out.", 1)


def per_group(spec: ModelSpec, num_blocks: int | Sequence[int]) -> list[int]:
    """Blocks per cache group (by group id); one int gives every group that many."""
    if isinstance(num_blocks, int):
        return [num_blocks] * len(spec.groups)
    if len(num_blocks) != len(spec.groups):
        raise ValueError(f"need one block count per cache group ({len(spec.groups)})")
    return list(num_blocks)


def allocate_caches(spec: ModelSpec, num_blocks: int | Sequence[int]) -> dict[str, torch.Tensor]:
    """Zeroed cache tensors keyed by graph input name (``cache.{layer}.{role}``).

    Each of a layer's cache bindings has its group's block count. Block 0 is the null block;
    zeros keep recycled-but-masked bytes finite.
    """
    blocks = per_group(spec, num_blocks)
    if min(blocks) < 2:
        raise ValueError("need at least 2 blocks (block 0 is the reserved null block)")
    out = {}
    for layer in spec.layers:
        for b in layer.bindings:
            shapes = b.tensor_shapes(blocks[b.group])
            for role, t in b.tensors:
                out[layer.onnx_input(role)] = torch.zeros(shapes[role], dtype=torch_dtype(t.dtype))
    return out
