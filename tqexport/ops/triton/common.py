"""What the CacheWrite and PagedAttention kernels share: which codecs they cover, the one
translation of a codec (and its TurboQuant slot layout) into kernel constexprs, the tables
they read, and the jit helpers both call."""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codecs import (
    MODEL_DTYPES,
    Codec,
    Fp8PerTensorCodec,
    TurboQuantCodec,
    UnquantizedCodec,
)

#: the codec class as the kernels' MODE constexpr (kernels branch on ints, not classes)
MODE_PLAIN, MODE_FP8, MODE_TQ = 0, 1, 2
#: the layout constexprs the CacheWrite kernels take (PagedAttention takes them all)
WRITE_LAYOUT_KEYS = ("SLOT", "KEY_BITS", "VAL_BITS", "KEY_FP8", "NORM_OFF", "VAL_OFF",
                     "SCALE_OFF", "ZERO_OFF", "NG", "VAL_MSE", "VNORM_OFF", "VTH")  # fmt: skip
#: each model dtype's Triton type name (its pointer signatures: "*fp16"); the registry's names
#: are also triton.language's
TRITON_TYPES = {name: getattr(tl, name).name for name in MODEL_DTYPES}


def supports(codec: Codec) -> bool:
    """Whether the Triton kernels cover this codec (others run the reference op)."""
    d = codec.head_size
    ok = isinstance(codec, TurboQuantCodec | Fp8PerTensorCodec | UnquantizedCodec)
    return ok and d & (d - 1) == 0


def layout_constants(codec: Codec) -> dict:
    """MODE and the TurboQuant slot layout as kernel constexprs (fixed fillers for the fields a
    mode does not read, so every layer of one mode compiles to one kernel)."""
    kw = dict(MODE=MODE_PLAIN, SLOT=1, KEY_BITS=4, VAL_BITS=4, KEY_FP8=False, NC=False,
              NORM_OFF=0, VAL_OFF=0, SCALE_OFF=0, ZERO_OFF=0, NG=1, VAL_MSE=False,
              VNORM_OFF=0, VCENT=(), VTH=())  # fmt: skip
    if isinstance(codec, TurboQuantCodec):
        lay, p = codec.layout, codec.preset
        kw.update(MODE=MODE_TQ, SLOT=lay.slot_size_aligned,
                  KEY_BITS=p.key_bits if not p.key_fp8 else 4, VAL_BITS=p.value_bits,
                  KEY_FP8=p.key_fp8, NC=p.norm_correction, NORM_OFF=lay.key_norm_offset or 0,
                  VAL_OFF=lay.value_offset, SCALE_OFF=lay.value_scale_offset or 0,
                  ZERO_OFF=lay.value_zero_offset or 0, NG=lay.value_groups)  # fmt: skip
        if p.value_mse:  # the value codebook inline (a few entries): no table argument
            book = codec.value_book
            kw.update(VAL_MSE=True, VNORM_OFF=lay.value_norm_offset,
                      VCENT=tuple(book.centroids.tolist()),
                      VTH=tuple(book.thresholds.tolist()))  # fmt: skip
    elif isinstance(codec, Fp8PerTensorCodec):
        kw.update(MODE=MODE_FP8)
    return kw


@lru_cache(maxsize=32)
def turboquant_tables(head_size: int, key_bits: int, device: str):
    """(Hadamard, centroids, thresholds) on ``device``, built once per layout and device."""
    rot = tq.hadamard(head_size)
    cents = tq.centroids(head_size, key_bits)
    return rot.to(device), cents.to(device), tq.thresholds(cents).to(device)


def turboquant_inline_tables(codec: TurboQuantCodec) -> dict:
    """INV_SQRT and TH: the fp32 Hadamard entry and thresholds as exact Python floats."""
    th = () if codec.preset.key_fp8 else tuple(codec.key_book.thresholds.tolist())
    return dict(INV_SQRT=float(tq.hadamard(codec.head_size)[0, 0]), TH=th)


def as_fp32(x: float) -> float:
    """The fp32 value a runtime fp32 argument would carry, as a Python float (exact)."""
    return float(torch.tensor(x, dtype=torch.float32))


@triton.jit
def hadamard_tile(rot_ptr, D: tl.constexpr, INLINE: tl.constexpr, INV_SQRT: tl.constexpr):
    """The [D, D] normalized Sylvester Hadamard: loaded from ``rot_ptr``, or (INLINE) computed as
    (-1)^popcount(i & j) * INV_SQRT, INV_SQRT being the fp32 table entry (so the same bits)."""
    offs = tl.arange(0, D)
    if INLINE:
        ij = offs[:, None] & offs[None, :]
        parity = tl.zeros([D, D], dtype=tl.int32)
        for b in tl.static_range(16):
            if (1 << b) < D:
                parity = parity ^ ((ij >> b) & 1)
        rot = tl.where(parity == 1, -INV_SQRT, INV_SQRT)
    else:
        rot = tl.load(rot_ptr + offs[:, None] * D + offs[None, :])
    return rot
