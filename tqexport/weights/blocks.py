"""Block-quantized matrices: one form for every source (a GGUF's own blocks, ORT's quantizer),
``W[n, k] = scale[n, k // block] * codes[n, k] + offset[n, k // block]``, with signed integer
codes of 4 or 8 bits in blocks along the input dimension K (the form ONNX's blocked
``DequantizeLinear`` and ORT's ``MatMulNBits`` take; the offset, a block's min, is added by a
separate product of the input's block sums).

Every GGUF block type with a mapping lives in :data:`GGUF_DECODERS`: the codes are the file's
own (re-centred to signed), the scales its scales, so the dequantized matrix equals gguf's own
dequantization up to float32 rounding. Decoders are vectorized over all rows of a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tqexport.errors import TQExportError


@dataclass(frozen=True)
class BlockWeight:
    """A matrix ``[N, K]`` as signed codes, a scale per block and an optional per-block offset."""

    codes: np.ndarray  # int8 [N, K], within the signed range of ``bits``
    scale: np.ndarray  # float32 [N, K // block]
    bits: int  # 4 or 8
    block: int  # 16 or 32
    offset: np.ndarray | None  # float32 [N, K // block] (a block's min, re-centred), or None
    source: str  # what the codes came from: a GGUF block type, or ORT's RTN quantizer

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """The float32 matrix these blocks hold (what every consumer must compute with)."""
        n, k = self.codes.shape
        w = self.codes.reshape(n, k // self.block, self.block).astype(np.float32)
        w *= self.scale[..., None]
        if self.offset is not None:
            w += self.offset[..., None]
        return w.reshape(n, k)

    def widened(self, bits: int) -> BlockWeight:
        """The same codes in a wider container (4 -> 8 bits: exact, as ``--weights int8`` asks)."""
        if bits < self.bits:
            raise ValueError("narrowing needs re-quantization")
        return BlockWeight(self.codes, self.scale, bits, self.block, self.offset, self.source)

    def storage_bytes(self) -> int:
        """Bytes the artifact stores: packed codes, float32 scales and offsets."""
        n, k = self.codes.shape
        blocks = n * (k // self.block)
        return n * k * self.bits // 8 + 4 * blocks * (1 if self.offset is None else 2)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ``[..., 2]`` (uint8) as float32 ``[...]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-element block's 16 bytes as its 32 4-bit codes: elements 0..15 in the low nibbles,
    16..31 in the high ones (ggml's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _rows(raw: np.ndarray, n: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(n, -1, block_bytes)


def _q4_0(raw, n, k):
    b = _rows(raw, n, 18)
    codes = _nibbles(b[..., 2:]).astype(np.int8) - 8
    return BlockWeight(codes.reshape(n, k), _f16(b[..., 0:2]), 4, 32, None, "Q4_0")


def _q4_1(raw, n, k):
    b = _rows(raw, n, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles(b[..., 4:]).astype(np.int8) - 8
    return BlockWeight(codes.reshape(n, k), d, 4, 32, m + 8 * d, "Q4_1")


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """The fifth bit of each of a block's 32 codes, from its 4-byte little-endian bit field."""
    bits = np.ascontiguousarray(qh).view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(raw, n, k):
    b = _rows(raw, n, 22)
    q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
    codes = q.astype(np.int8) - 16
    return BlockWeight(codes.reshape(n, k), _f16(b[..., 0:2]), 8, 32, None, "Q5_0")


def _q5_1(raw, n, k):
    b = _rows(raw, n, 24)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
    codes = q.astype(np.int8) - 16
    return BlockWeight(codes.reshape(n, k), d, 8, 32, m + 16 * d, "Q5_1")


def _q8_0(raw, n, k):
    b = _rows(raw, n, 34)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8)
    return BlockWeight(codes.reshape(n, k), _f16(b[..., 0:2]), 8, 32, None, "Q8_0")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a K-quant superblock, from its 12 bytes."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(packed).reshape(-1, 12))
    shape = packed.shape[:-1] + (8,)
    return sc.reshape(shape).astype(np.float32), mn.reshape(shape).astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """A K-quant superblock's 128 code bytes as 256 4-bit codes: byte chunk j holds sub-block
    2j in its low nibbles and 2j + 1 in its high ones."""
    lead = qs.shape[:-1]
    parts = qs.reshape(*lead, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (parts & 15).reshape(*lead, 256)


def _k_with_min(b, n, k, q, code_bits, container_bits, name):
    """A Q4_K/Q5_K block: unsigned `q` re-centred, scale `d * sc`, offset from the min."""
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    center = 1 << (code_bits - 1)
    scale = d * sc
    offset = center * scale - dmin * mn
    codes = q.astype(np.int8) - center
    return BlockWeight(codes.reshape(n, k), scale.reshape(n, -1), container_bits, 32,
                       offset.reshape(n, -1), name)  # fmt: skip


def _q4_k(raw, n, k):
    b = _rows(raw, n, 144)
    return _k_with_min(b, n, k, _k_low_nibbles(b[..., 16:]), 4, 4, "Q4_K")


def _q5_k(raw, n, k):
    b = _rows(raw, n, 176)
    high = b[..., 16:48]  # bit i of byte l: the fifth bit of element l of sub-block i
    hb = (high[..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = _k_low_nibbles(b[..., 48:]) | (hb.reshape(*hb.shape[:-2], 256) << 4)
    return _k_with_min(b, n, k, q, 5, 8, "Q5_K")


def _q6_k(raw, n, k):
    b = _rows(raw, n, 210)
    ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    lead = ql.shape[:-1]
    low = (ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
    high = (qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q = low.reshape(*lead, 256) | (high.reshape(*lead, 256) << 4)
    codes = q.astype(np.int8) - 32
    scale = d[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
    return BlockWeight(codes.reshape(n, k), scale.reshape(n, -1), 8, 16, None, "Q6_K")


#: GGUF block types kept as blocks: name -> (decoder, elements per GGUF block, code bits). The
#: others (Q2_K, Q3_K, the IQ types, ...) are dequantized, with one line saying so.
GGUF_DECODERS: dict[str, tuple[Callable[[np.ndarray, int, int], BlockWeight], int, int]] = {
    "Q4_0": (_q4_0, 32, 4),
    "Q4_1": (_q4_1, 32, 4),
    "Q5_0": (_q5_0, 32, 8),
    "Q5_1": (_q5_1, 32, 8),
    "Q8_0": (_q8_0, 32, 8),
    "Q4_K": (_q4_k, 256, 4),
    "Q5_K": (_q5_k, 256, 8),
    "Q6_K": (_q6_k, 256, 8),
}


#: rows decoded at once (bounds a large table's temporaries to a few times this many rows)
DECODE_ROWS = 8192


def decode_gguf(raw: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """A GGUF tensor's raw blocks (``[N, bytes per row]``, ``n`` rows of ``k`` elements) as a
    :class:`BlockWeight`, decoded :data:`DECODE_ROWS` rows at a time into the result; the
    caller checked the type has a decoder and the byte count."""
    decoder, per_block, bits = GGUF_DECODERS[type_name]
    if k % per_block:
        raise TQExportError(
            f"a {type_name} tensor's rows of {k} elements are not whole {per_block}-element blocks"
        )
    raw = raw.reshape(n, -1)
    first = decoder(raw[:DECODE_ROWS], min(n, DECODE_ROWS), k)
    if n <= DECODE_ROWS:
        return first
    codes = np.empty((n, k), np.int8)
    scale = np.empty((n, first.scale.shape[1]), np.float32)
    offset = None if first.offset is None else np.empty_like(scale)
    for r in range(0, n, DECODE_ROWS):
        part = first if r == 0 else decoder(raw[r : r + DECODE_ROWS], min(DECODE_ROWS, n - r), k)
        codes[r : r + DECODE_ROWS] = part.codes
        scale[r : r + DECODE_ROWS] = part.scale
        if offset is not None:
            offset[r : r + DECODE_ROWS] = part.offset
    return BlockWeight(codes, scale, bits, first.block, offset, type_name)


#: ORT's quantizer: symmetric round-to-nearest in blocks of this many inputs
RTN_BLOCK = 32


def quantize_rtn(weight: np.ndarray, bits: int) -> BlockWeight:
    """``weight`` ``[N, K]`` quantized by ONNX Runtime's own round-to-nearest kernel (symmetric,
    blocks of :data:`RTN_BLOCK` along K), unpacked into signed codes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    n, k = weight.shape
    if k % RTN_BLOCK:
        raise TQExportError(
            f"a matrix with {k} inputs is not whole blocks of {RTN_BLOCK}; keep it in float "
            "(--weights fp32)"
        )
    config = DefaultWeightOnlyQuantConfig(block_size=RTN_BLOCK, is_symmetric=True, bits=bits)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(weight.T, dtype=np.float32)
    )
    packed = packed.reshape(n, -1)
    if bits == 4:
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k).astype(np.int8) - 8
    else:
        codes = (packed.astype(np.int16) - 128).astype(np.int8)
    return BlockWeight(codes, scales.astype(np.float32).reshape(n, -1), bits, RTN_BLOCK, None,
                       f"rtn{bits}")  # fmt: skip


def pack_int4(codes: np.ndarray) -> bytes:
    """Signed 4-bit codes as ONNX INT4 raw data: row-major, two per byte, the first in the low
    nibble (an odd count ends in a half-filled byte)."""
    flat = np.ascontiguousarray(codes).reshape(-1).astype(np.uint8) & 15
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()
