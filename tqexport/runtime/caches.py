"""Allocate one set of cache tensors per layer, exactly as the layer's own spec says."""

from __future__ import annotations

import torch

from tqexport.kvquant.codecs import torch_dtype
from tqexport.spec import ModelSpec


def allocate_caches(spec: ModelSpec, num_blocks: int) -> dict[str, torch.Tensor]:
    """Zeroed cache tensors keyed by graph input name (``cache.{layer}.{role}``).

    Block 0 is the null block; zeros keep recycled-but-masked bytes finite.
    """
    if num_blocks < 2:
        raise ValueError("need at least 2 blocks (block 0 is the reserved null block)")
    out = {}
    for layer in spec.layers:
        shapes = layer.cache.tensor_shapes(num_blocks)
        for t in layer.cache.tensors:
            out[layer.onnx_input(t.role)] = torch.zeros(shapes[t.role], dtype=torch_dtype(t.dtype))
    return out
