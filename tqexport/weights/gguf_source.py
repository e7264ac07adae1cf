"""A GGUF file's weights by transformers parameter name, read without dequantizing what stays
in blocks: the model is built with empty weights, every tensor that stays float (norms,
biases, F32/F16 tensors, block types without a mapping) is dequantized into it, and each
block-quantized matrix is kept as raw blocks, decoded one at a time when the graph takes it.

Names and per-architecture fix-ups come from transformers' GGUF loader (its name map and its
tensor processors). A processor that only reorders a matrix's rows (llama's q/k head
permutation) is applied to the blocks as a row order, found by running it on the row indices;
any other change to a quantized matrix makes that matrix stay float, said in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tqexport.errors import TQExportError
from tqexport.weights.blocks import BlockWeight, decode_gguf
from tqexport.weights.gguf_index import IndexedTensor, as_array, read_index


@dataclass
class BlockSource:
    """One GGUF matrix kept in blocks: its raw rows (memory-mapped) and how to read them."""

    tensor: IndexedTensor  # where its blocks are in the file
    type_name: str
    rows: int
    cols: int
    row_order: np.ndarray | None  # the processor's row permutation, or None

    def decode(self) -> BlockWeight:
        w = decode_gguf(self.tensor.data, self.type_name, self.rows, self.cols)
        if self.row_order is None:
            return w
        o = self.row_order
        offset = None if w.offset is None else w.offset[o]
        return BlockWeight(w.codes[o], w.scale[o], w.bits, w.block, offset, w.source)


@dataclass
class GGUFWeights:
    """What a GGUF holds, by transformers parameter name."""

    blocks: dict[str, BlockSource] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    #: one line per matrix that stays float although its file stores it quantized
    notes: list[str] = field(default_factory=list)
    #: those matrices by parameter name, with their GGUF block type
    floats: dict[str, str] = field(default_factory=dict)


def _row_order(processor, name: str, rows: int, mapping: dict) -> tuple[str, np.ndarray | None]:
    """What the processor does to a matrix of ``rows`` rows named ``name``: (its new name, a
    row permutation or None for none); ValueError if it does anything else."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    out = processor.process(weights=probe, name=name, tensor_key_mapping=mapping,
                            parsed_parameters={"tensors": {}, "config": {}})  # fmt: skip
    got = np.asarray(out.weights)
    if got.shape != probe.shape or not np.array_equal(np.sort(got[:, 0]), probe[:, 0]):
        raise ValueError(name)
    order = got[:, 0].astype(np.int64)
    return out.name, None if np.array_equal(order, probe[:, 0]) else order


def read_gguf(path: Path, model: torch.nn.Module, dtype: torch.dtype, stored: set[str],
              policy: Callable[[str], str | None]) -> GGUFWeights:  # fmt: skip
    """The weights of the GGUF file ``path`` for ``model`` (built with empty weights from the
    file's config). A block-quantized matrix named in ``stored`` (the Linear and Embedding
    weights) stays in blocks when ``policy(type_name)`` is None (else that is why it does
    not: said in a line); every other tensor is dequantized (to ``dtype``) into ``dense``."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    arch, tensors = read_index(path)
    config = model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    mapping = get_gguf_hf_weights_map(model, processor)
    out = GGUFWeights()
    for t in tensors:
        type_name = t.type_name
        quantized = type_name not in FLOAT_TYPES and len(t.shape) == 2
        why = policy(type_name) if quantized else None
        if quantized and why is None:
            cols, rows = int(t.shape[0]), int(t.shape[1])  # GGUF lists the inner dim first
            try:
                name, order = _row_order(processor, t.name, rows, mapping)
                hf = mapping.get(name)
                why = None if hf in stored else "not the weight of a linear or embedding layer"
            except ValueError:
                hf, why = None, "its tensor processor changes more than its row order"
            if why is None:
                _check_blocks(t, type_name, rows, cols)
                out.blocks[hf] = BlockSource(t, type_name, rows, cols, order)
                continue
        res = processor.process(weights=as_array(t), name=t.name, tensor_key_mapping=mapping,
                                parsed_parameters={"tensors": {}, "config": config})  # fmt: skip
        if res.name not in mapping:
            continue
        hf = mapping[res.name]
        out.dense[hf] = torch.from_numpy(np.array(res.weights)).to(dtype)
        if quantized and hf in stored:
            out.notes.append(f"{t.name} ({type_name}) is stored as float: {why}")
            out.floats[hf] = type_name
    return out


#: GGUF tensor types that are plain floats (never kept as blocks)
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _check_blocks(t, type_name: str, rows: int, cols: int) -> None:
    """A tensor whose block count disagrees with its shape is refused before it is read."""
    import gguf

    per_block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if cols % per_block:
        raise TQExportError(
            f"GGUF tensor {t.name} ({type_name}, {cols} x {rows}): its rows of {cols} elements "
            f"are not whole {per_block}-element blocks; the file is damaged"
        )
    want = rows * (cols // per_block) * block_bytes
    if t.nbytes != want:
        raise TQExportError(
            f"GGUF tensor {t.name} ({type_name}, {cols} x {rows}) holds {t.nbytes} bytes, but "
            f"{type_name} blocks of that shape take {want}; the file is damaged or not a GGUF "
            "this tqexport reads"
        )


def check_types(path: Path, policy: Callable[[str], str | None]) -> None:
    """Apply ``policy`` to every block-quantized matrix's type before anything loads (it raises
    the error of a type the build cannot store); reads only the file's tensor index."""
    for t in read_index(path)[1]:
        if t.type_name not in FLOAT_TYPES and len(t.shape) == 2:
            try:
                policy(t.type_name)
            except TQExportError as e:
                raise TQExportError(f"{e} (the first such tensor: {t.name})") from None
