"""``--weights``: how an artifact stores its matrices, and what each choice means per source.

``auto`` keeps the source's precision: a GGUF's block-quantized matrices in their own blocks
(4-bit types in 4 bits, 5-, 6- and 8-bit types in 8), float checkpoints in float32. ``fp32``
and ``fp16`` store every matrix as float; ``int8`` and ``int4`` store every matrix in blocks of
that width (a GGUF's own blocks where they fit exactly, else an error; a float checkpoint
through ONNX Runtime's quantizer). Norms, biases and other vectors stay in the model dtype.
"""

from __future__ import annotations

from tqexport.errors import TQExportError
from tqexport.weights.blocks import GGUF_DECODERS

#: the accuracy level ONNX Runtime runs block-quantized matrices at (``MatMulNBits``): 4 takes
#: the input in 8 bits per block (2-4x faster than float at batch 1; about 0.5% relative
#: noise per product), 0 in float32 (what parity checks with: exact up to float rounding)
ACCURACY_LEVEL = 4
#: embedding tables are gathered row by row, which ONNX's Gather does not do on 4-bit data:
#: a table stored in blocks is stored in 8 bits (4-bit codes widened exactly)
EMBEDDING_BITS = 8


#: a model dtype by the name ``--weights`` gives float precisions
FLOAT_PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def stored_label(spec) -> str:
    """What most of an artifact's matrices are (``int4 (Q4_1)``, ``fp32``): its spec's weights
    section, or the model dtype for a spec without one."""
    w = spec.weights
    if w is None or w.default is None:
        return FLOAT_PRECISION[spec.dtype]
    return f"{w.default.precision} ({w.default.source})"


def stores_blocks(weights: str, gguf: bool) -> bool:
    """Whether a build with ``--weights weights`` stores matrices in blocks (GGUF or not)."""
    return weights in ("int8", "int4") or (weights == "auto" and gguf)


def gguf_type_refusal(type_name: str, weights: str) -> str | None:
    """None when a GGUF matrix of block type ``type_name`` stays in blocks under ``weights``
    (auto, int8, int4), else why it is stored as float (``auto``: no mapping for the type);
    under int8/int4 a type that cannot be stored at that width exactly is an error."""
    entry = GGUF_DECODERS.get(type_name)
    if entry is None:
        if weights == "auto":
            return f"{type_name} has no block mapping in tqexport; dequantized"
        raise TQExportError(
            f"--weights {weights}: GGUF block type {type_name} has no mapping in tqexport; use "
            "--weights auto (it is stored as float) or fp16"
        )
    if weights == "int4" and entry[2] > 4:
        raise TQExportError(
            f"--weights int4: GGUF {type_name} codes are wider than 4 bits, so storing them in 4 "
            "would re-quantize them; use --weights auto (keeps them in 8 bits) or int8"
        )
    return None
