"""What ``--weights`` would store, by precision, before anything is built (``plan``): a GGUF's
tensor index (one row of each block-quantized matrix decoded for its layout) or a float model's
shapes (built on the meta device from its config). Block-quantized bytes are what the build
writes (codes, float32 scales and offsets); float bytes count the parameters kept as float."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tqexport.weights.blocks import GGUF_DECODERS, RTN_BLOCK, decode_gguf
from tqexport.weights.precision import EMBEDDING_BITS, FLOAT_PRECISION, gguf_type_refusal

#: GGUF's name of the token embedding table (gathered, so stored in 8-bit containers)
GGUF_EMBEDDING = "token_embd.weight"


def _add(sizes: dict[str, int], label: str, size: int) -> None:
    sizes[label] = sizes.get(label, 0) + size


def _block_bytes(rows: int, cols: int, bits: int, block: int, offset: bool) -> int:
    """Packed codes plus a float32 scale (and offset) per block, as the build stores them."""
    return rows * cols * bits // 8 + 4 * rows * (cols // block) * (2 if offset else 1)


def _float(sizes: dict[str, int], count: int, dtype: str) -> None:
    import torch

    _add(sizes, FLOAT_PRECISION[dtype], count * getattr(torch, dtype).itemsize)


def gguf_bytes(path: Path, weights: str, blocks: bool, dtype: str) -> dict[str, int]:
    """Bytes per precision of GGUF file ``path`` stored as ``--weights weights`` (``blocks``:
    whether its blocks are kept; a type that cannot be raises the build's own error), float
    tensors in model dtype ``dtype`` (matrices in float16 under ``fp16``)."""
    from tqexport.weights.gguf_index import read_index
    from tqexport.weights.gguf_source import FLOAT_TYPES

    _, tensors = read_index(path)
    sizes: dict[str, int] = {}
    for t in tensors:
        count = int(np.prod(t.shape, dtype=np.int64))
        quantized = t.type_name not in FLOAT_TYPES and len(t.shape) == 2
        if not (quantized and blocks and gguf_type_refusal(t.type_name, weights) is None):
            matrix = weights == "fp16" and len(t.shape) == 2
            _float(sizes, count, "float16" if matrix else dtype)
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        per_block, _ = GGUF_DECODERS[t.type_name][1:]
        with open(t.path, "rb") as f:  # one row: its layout (block, offset) is every row's
            f.seek(t.offset)
            row = np.fromfile(f, np.uint8, count=t.nbytes // rows).reshape(1, -1)
        first = decode_gguf(row, t.type_name, 1, cols)
        gathered = t.name == GGUF_EMBEDDING
        bits = 8 if weights == "int8" or (gathered and first.bits < EMBEDDING_BITS) else first.bits
        label = f"int{bits}"
        _add(sizes, label, _block_bytes(rows, cols, bits, first.block, first.offset is not None))
    return sizes


def model_bytes(config, weights: str, dtype: str) -> dict[str, int]:
    """Bytes per precision of a float model of ``config`` stored as ``--weights weights``
    (ONNX Runtime's quantizer for int8/int4: blocks of 32, embedding tables in 8 bits; a
    matrix of rows not whole blocks stays float), the other parameters in model dtype
    ``dtype``."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    matrices = {
        id(m.weight): isinstance(m, torch.nn.Embedding)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Embedding)
    }
    sizes: dict[str, int] = {}
    for p in model.parameters():  # a tied table once
        rows, cols = (p.shape[0], p.shape[1]) if p.dim() == 2 else (1, p.numel())
        if id(p) in matrices and weights in ("int8", "int4") and cols % RTN_BLOCK == 0:
            bits = EMBEDDING_BITS if matrices[id(p)] else int(weights[3:])
            _add(sizes, f"int{bits}", _block_bytes(rows, cols, bits, RTN_BLOCK, False))
        else:
            _float(
                sizes, p.numel(), "float16" if id(p) in matrices and weights == "fp16" else dtype
            )
    return sizes
