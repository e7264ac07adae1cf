"""Reference encode/decode for every kv-cache dtype (pure torch, CPU, vectorized).

A codec turns K and V of shape ``[..., heads, D]`` into the named cache tensors a layer stores
(``[..., heads, X]`` data, ``[..., heads]`` per-token-head scales) and back. Every tensor a codec
writes is described by a :class:`TensorFormat`; cache specs derive shapes and byte counts from
those, so a codec and the cache it is sized for cannot disagree.

Quantized data is always stored as uint8 bytes: ONNX Runtime and TensorRT cannot take fp8 or
int4 tensors at graph boundaries, and this keeps one byte view for every consumer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import lru_cache

import torch

from tqexport.errors import TQExportError
from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codec_base import (
    _EVERY_BYTE,
    _FP8_E4M3_TABLE,
)
from tqexport.kvquant.codec_base import (  # re-exported: every codec's consumers import here
    MODEL_DTYPES as MODEL_DTYPES,
)
from tqexport.kvquant.codec_base import (
    TENSOR_DTYPES as TENSOR_DTYPES,
)
from tqexport.kvquant.codec_base import (
    AttentionOperands as AttentionOperands,
)
from tqexport.kvquant.codec_base import (
    CacheTensors as CacheTensors,
)
from tqexport.kvquant.codec_base import (
    Codec as Codec,
)
from tqexport.kvquant.codec_base import (
    TensorFormat as TensorFormat,
)
from tqexport.kvquant.codec_base import (
    fp16_field_weights as fp16_field_weights,
)
from tqexport.kvquant.codec_base import (
    fp16_fields as fp16_fields,
)
from tqexport.kvquant.codec_base import (
    nibbles as nibbles,
)
from tqexport.kvquant.codec_base import (
    torch_dtype as torch_dtype,
)
from tqexport.kvquant.codec_base import (
    triplet_codes as triplet_codes,
)
from tqexport.kvquant.float_bytes import (
    E4M3,
    FP8_FORMATS,
    fp8_decode,
    fp8_encode,
    int8_from_bytes,
    int8_to_bytes,
    lookup,
)
from tqexport.kvquant.modes import KVCacheDType, KVQuantMode, parse_kv_cache_dtype
from tqexport.kvquant.packing import pack_codes, unpack_codes
from tqexport.kvquant.turboquant_codec import (
    NC_EPS as NC_EPS,
)
from tqexport.kvquant.turboquant_codec import (
    NORM_EPS as NORM_EPS,
)
from tqexport.kvquant.turboquant_codec import (
    TurboQuantCodec as TurboQuantCodec,
)


class UnquantizedCodec(Codec):
    def __init__(self, head_size: int, storage: str):
        self.head_size = head_size
        self.storage = storage

    @property
    def tensors(self):
        return (
            TensorFormat("k", self.storage, self.head_size),
            TensorFormat("v", self.storage, self.head_size),
        )

    def encode(self, k, v):
        dt = torch_dtype(self.storage)
        return {"k": k.to(dt), "v": v.to(dt)}

    def decode(self, cache):
        return cache["k"].float(), cache["v"].float()


class Fp8PerTensorCodec(Codec):
    """fp8 with one fp32 scale per layer for K and one for V: stored fp8(x / scale)."""

    def __init__(self, head_size: int, fmt: str, k_scale: float = 1.0, v_scale: float = 1.0):
        self.head_size = head_size
        self.fmt = FP8_FORMATS[fmt]
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        # decode tables with the scale applied: entry b is exactly fp8_decode(b) * scale
        self.k_table = fp8_decode(_EVERY_BYTE, self.fmt) * self.k_scale
        self.v_table = fp8_decode(_EVERY_BYTE, self.fmt) * self.v_scale

    @property
    def tensors(self):
        return (
            TensorFormat("k", "uint8", self.head_size),
            TensorFormat("v", "uint8", self.head_size),
        )

    def encode(self, k, v):
        return {
            "k": fp8_encode(k.float() / self.k_scale, self.fmt),
            "v": fp8_encode(v.float() / self.v_scale, self.fmt),
        }

    def decode(self, cache):
        return (
            fp8_decode(cache["k"], self.fmt) * self.k_scale,
            fp8_decode(cache["v"], self.fmt) * self.v_scale,
        )

    def attention_operands(self, cache):
        # the same values as decode(): one table lookup per byte instead of lookup + multiply
        return AttentionOperands(
            (lookup(self.k_table, cache["k"]),), (lookup(self.v_table, cache["v"]),)
        )


PER_TOKEN_HEAD_MIN_SCALE = 1e-6
#: largest int8 code of int8_per_token_head, and the top code of int4_per_token_head
INT8_QMAX, INT4_LEVELS = 127.0, 15


class SymmetricPerTokenHeadCodec(Codec):
    """int8 or fp8 e4m3 with an fp32 scale per (token, head): scale = max(absmax/QMAX, 1e-6).

    int8 rounds half to even; int8 bytes are two's complement.
    """

    def __init__(self, head_size: int, mode: KVQuantMode):
        self.head_size = head_size
        self.mode = mode
        self.qmax = INT8_QMAX if mode is KVQuantMode.INT8_PER_TOKEN_HEAD else E4M3.max_value

    @property
    def tensors(self):
        d = self.head_size
        return (
            TensorFormat("k", "uint8", d),
            TensorFormat("v", "uint8", d),
            TensorFormat("k_scale", "float32", None),
            TensorFormat("v_scale", "float32", None),
        )

    def _quant(self, x):
        x = x.float()
        scale = (x.abs().amax(-1) / self.qmax).clamp_min(PER_TOKEN_HEAD_MIN_SCALE)
        y = x / scale.unsqueeze(-1)
        if self.mode is KVQuantMode.INT8_PER_TOKEN_HEAD:
            data = int8_to_bytes(y.round().clamp(-128, 127))
        else:
            data = fp8_encode(y, E4M3)
        return data, scale

    def _dequant(self, data, scale):
        if self.mode is KVQuantMode.INT8_PER_TOKEN_HEAD:
            vals = int8_from_bytes(data)
        else:
            vals = fp8_decode(data, E4M3)
        return vals * scale.unsqueeze(-1)

    def encode(self, k, v):
        kd, ks = self._quant(k)
        vd, vs = self._quant(v)
        return {"k": kd, "v": vd, "k_scale": ks, "v_scale": vs}

    def decode(self, cache):
        return (
            self._dequant(cache["k"], cache["k_scale"]),
            self._dequant(cache["v"], cache["v_scale"]),
        )

    def _codes(self, data):
        if self.mode is KVQuantMode.INT8_PER_TOKEN_HEAD:
            return (int8_from_bytes(data),)
        return (lookup(_FP8_E4M3_TABLE, data),)

    def attention_operands(self, cache):
        return AttentionOperands(
            self._codes(cache["k"]),
            self._codes(cache["v"]),
            key_scale=cache["k_scale"],
            value_scale=cache["v_scale"].unsqueeze(-1),
            values_finite=self.mode is KVQuantMode.INT8_PER_TOKEN_HEAD,  # fp8 bytes may be NaN
        )


class Int4PerTokenHeadCodec(Codec):
    """Asymmetric int4 per (token, head): scale = max((max-min)/15, 1e-6),
    zp = clamp(round(-min/scale), 0, 15), q = clamp(round(x/scale + zp), 0, 15).

    Two codes per byte, even element in the low nibble. The zero point is stored as one uint8
    per (token, head) next to the fp32 scale (a dequantization cannot do without it).
    """

    def __init__(self, head_size: int):
        if head_size % 2:
            raise TQExportError(f"int4_per_token_head needs an even head size, got {head_size}")
        self.head_size = head_size

    @property
    def tensors(self):
        half = self.head_size // 2
        return (
            TensorFormat("k", "uint8", half),
            TensorFormat("v", "uint8", half),
            TensorFormat("k_scale", "float32", None),
            TensorFormat("v_scale", "float32", None),
            TensorFormat("k_zero", "uint8", None),
            TensorFormat("v_zero", "uint8", None),
        )

    @staticmethod
    def _quant(x):
        x = x.float()
        lo, hi = x.amin(-1), x.amax(-1)
        scale = ((hi - lo) / INT4_LEVELS).clamp_min(PER_TOKEN_HEAD_MIN_SCALE)
        zp = (-lo / scale).round().clamp(0, INT4_LEVELS)
        q = (x / scale.unsqueeze(-1) + zp.unsqueeze(-1)).round().clamp(0, INT4_LEVELS)
        return pack_codes(q, 4), scale, zp.to(torch.uint8)

    def _dequant(self, data, scale, zp):
        q = unpack_codes(data, 4, self.head_size).float()
        return (q - zp.float().unsqueeze(-1)) * scale.unsqueeze(-1)

    def encode(self, k, v):
        kd, ks, kz = self._quant(k)
        vd, vs, vz = self._quant(v)
        return {"k": kd, "v": vd, "k_scale": ks, "v_scale": vs, "k_zero": kz, "v_zero": vz}

    def decode(self, cache):
        return (
            self._dequant(cache["k"], cache["k_scale"], cache["k_zero"]),
            self._dequant(cache["v"], cache["v_scale"], cache["v_zero"]),
        )


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4_BLOCK = 16


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code, like the hardware cvt).

    Returns int32 4-bit codes: sign in bit 3, magnitude index 0..7 in bits 0..2. On each
    binade the grid is uniform, so torch.round (half to even) yields the code directly.
    """
    a = x.abs().clamp(max=6.0)
    mag = torch.where(
        a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a / 2) + 4)
    ).to(torch.int32)
    return torch.where((x < 0) & (mag > 0), mag + 8, mag)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1_VALUES[torch.remainder(codes, 8).to(torch.int64)]
    return torch.where(codes >= 8, -mag, mag)


class NvFp4Codec(Codec):
    """NVFP4: per head D/2 bytes of e2m1 pairs (even element low nibble), then D/16 fp8 e4m3
    block scales (one per 16 elements), in one uint8 tensor per K and V.

    Value = e2m1 * block_scale * global_scale. The per-layer fp32 global scales (``k_scale``,
    ``v_scale``, default 1.0) live in the spec; vLLM's own global-scale handling is unverified.
    """

    def __init__(self, head_size: int, k_scale: float = 1.0, v_scale: float = 1.0):
        if head_size % NVFP4_BLOCK:
            raise TQExportError(f"nvfp4 needs head_size % 16 == 0, got {head_size}")
        self.head_size = head_size
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    @property
    def width(self) -> int:
        return self.head_size // 2 + self.head_size // NVFP4_BLOCK

    @property
    def tensors(self):
        return (TensorFormat("k", "uint8", self.width), TensorFormat("v", "uint8", self.width))

    def _quant(self, x, global_scale):
        blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK))
        amax = blocks.abs().amax(-1)
        scale_bytes = fp8_encode(amax / 6.0 / global_scale, E4M3)
        eff = fp8_decode(scale_bytes, E4M3) * global_scale
        safe = torch.where(eff > 0, eff, torch.ones_like(eff))
        codes = e2m1_encode((blocks / safe.unsqueeze(-1)).clamp(-6.0, 6.0))
        codes = torch.where(eff.unsqueeze(-1) > 0, codes, torch.zeros_like(codes))
        return torch.cat([pack_codes(codes.flatten(-2), 4), scale_bytes], dim=-1)

    def _dequant(self, data, global_scale):
        half = self.head_size // 2
        codes = unpack_codes(data[..., :half], 4, self.head_size)
        scales = fp8_decode(data[..., half:], E4M3) * global_scale
        vals = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK)) * scales.unsqueeze(-1)
        return vals.flatten(-2)

    def encode(self, k, v):
        return {"k": self._quant(k, self.k_scale), "v": self._quant(v, self.v_scale)}

    def decode(self, cache):
        return self._dequant(cache["k"], self.k_scale), self._dequant(cache["v"], self.v_scale)


#: Largest head size any codec takes. Real models use at most 256 (Gemma 3); the bound keeps
#: every table a codec builds small (a TurboQuant rotation is D x D fp32: 4 MiB at 1024), and
#: it is checked before any of them is built.
MAX_HEAD_SIZE = 1024


def check_head_size(head_size: int) -> int:
    """``head_size`` if it is an integer in 1..MAX_HEAD_SIZE, else a one-line TQExportError."""
    try:
        ok = not isinstance(head_size, bool) and 1 <= operator.index(head_size) <= MAX_HEAD_SIZE
    except TypeError:
        ok = False
    if not ok:
        raise TQExportError(
            f"head size must be an integer from 1 to {MAX_HEAD_SIZE} (no real model has larger "
            f"heads), got {head_size!r:.40}"
        )
    return head_size


def make_codec(
    kv_cache_dtype: str,
    head_size: int,
    *,
    model_dtype: str = "bfloat16",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Codec:
    """The codec for one layer's cache, from the vLLM dtype name (the registry decides the mode).

    ``k_scale``/``v_scale`` are the per-layer scales of fp8 per-tensor caches and the global
    scales of nvfp4; other modes ignore them.
    """
    check_head_size(head_size)
    entry = parse_kv_cache_dtype(kv_cache_dtype)
    return CODECS[entry.mode](entry, head_size, model_dtype, k_scale, v_scale)


def _unquantized(entry: KVCacheDType, head_size: int, model_dtype: str, *_) -> Codec:
    storage = model_dtype if entry.element == "model" else entry.element
    torch_dtype(storage)  # an unknown model dtype: one line naming the valid ones
    return UnquantizedCodec(head_size, storage)


#: The codec of each quant mode, from (registry entry, head size, model dtype, k_scale, v_scale):
#: a dtype name over an existing mode needs nothing here, a new mode one entry.
CODECS: dict[KVQuantMode, Callable[..., Codec]] = {
    KVQuantMode.NONE: _unquantized,
    KVQuantMode.FP8_PER_TENSOR: lambda e, d, _, ks, vs: Fp8PerTensorCodec(d, e.element, ks, vs),
    KVQuantMode.INT8_PER_TOKEN_HEAD: lambda e, d, *_: SymmetricPerTokenHeadCodec(d, e.mode),
    KVQuantMode.FP8_PER_TOKEN_HEAD: lambda e, d, *_: SymmetricPerTokenHeadCodec(d, e.mode),
    KVQuantMode.INT4_PER_TOKEN_HEAD: lambda e, d, *_: Int4PerTokenHeadCodec(d),
    KVQuantMode.NVFP4: lambda e, d, _, ks, vs: NvFp4Codec(d, ks, vs),
    KVQuantMode.TURBOQUANT: lambda e, d, *_: TurboQuantCodec(e.name, d),
}


def cache_tensors(
    kv_cache_dtype: str, head_size: int, model_dtype: str = "bfloat16"
) -> tuple[TensorFormat, ...]:
    """The tensors of :func:`make_codec`'s codec, without building a TurboQuant codec's
    rotation and codebook tables (the native header asks this of every head size)."""
    check_head_size(head_size)
    if parse_kv_cache_dtype(kv_cache_dtype).mode is KVQuantMode.TURBOQUANT:
        preset = tq.preset(kv_cache_dtype)
        tq.check_head_size(preset, head_size)
        return TurboQuantCodec.slot_tensors(tq.SlotLayout(preset, head_size))
    return make_codec(kv_cache_dtype, head_size, model_dtype=model_dtype).tensors


def compression_vs_bf16(codec: Codec) -> float:
    """How many times smaller than a bf16 K+V cache this codec's cache is."""
    return (2 * 2 * codec.head_size) / codec.bytes_per_token_head


@lru_cache(maxsize=256)
def codec_for(
    kv_cache_dtype: str, head_size: int, model_dtype: str, k_scale: float, v_scale: float
) -> Codec:
    """:func:`make_codec`, shared by every cache with the same parameters (a TurboQuant codec
    holds a D x D rotation: a spec of many identical layers must not hold one per layer)."""
    return make_codec(
        kv_cache_dtype, head_size, model_dtype=model_dtype, k_scale=k_scale, v_scale=v_scale
    )
