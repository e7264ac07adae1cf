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
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tqexport.errors import TQExportError
from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.bits import (
    E4M3,
    FP8_FORMATS,
    fp8_decode,
    fp8_encode,
    fp16_from_bytes,
    int8_from_bytes,
    int8_to_bytes,
)
from tqexport.kvquant.modes import KVQuantMode, parse_kv_cache_dtype
from tqexport.kvquant.packing import pack_codes, unpack_codes

MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name used in specs to torch (model dtypes, uint8, fp32)."""
    table = {**MODEL_DTYPES, "uint8": torch.uint8}
    try:
        return table[name]
    except KeyError:
        raise TQExportError(f"unknown dtype {name!r}; valid: {', '.join(table)}") from None


@dataclass(frozen=True)
class TensorFormat:
    """One cache tensor a codec writes: ``width`` values per (token, head), or one if None."""

    role: str
    dtype: str
    width: int | None

    @property
    def bytes_per_token_head(self) -> int:
        return (self.width or 1) * torch_dtype(self.dtype).itemsize

    def shape(self, *leading: int) -> tuple[int, ...]:
        return (*leading,) if self.width is None else (*leading, self.width)


CacheTensors = dict[str, torch.Tensor]


class Codec(ABC):
    """Encode/decode of one kv-cache dtype for heads of size ``head_size``."""

    head_size: int

    @property
    @abstractmethod
    def tensors(self) -> tuple[TensorFormat, ...]: ...

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> CacheTensors:
        """K, V ``[..., heads, D]`` -> cache tensors keyed by role."""

    @abstractmethod
    def decode(self, cache: CacheTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache tensors -> (K, V) as float32 ``[..., heads, D]``."""

    @property
    def bytes_per_token_head(self) -> int:
        """K and V bytes, metadata included, for one token of one kv head."""
        return sum(t.bytes_per_token_head for t in self.tensors)


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


PER_TOKEN_HEAD_MIN_SCALE = 1e-6


class SymmetricPerTokenHeadCodec(Codec):
    """int8 or fp8 e4m3 with an fp32 scale per (token, head): scale = max(absmax/QMAX, 1e-6).

    int8 rounds half to even; int8 bytes are two's complement.
    """

    def __init__(self, head_size: int, mode: KVQuantMode):
        self.head_size = head_size
        self.mode = mode
        self.qmax = 127.0 if mode is KVQuantMode.INT8_PER_TOKEN_HEAD else E4M3.max_value

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
        scale = ((hi - lo) / 15).clamp_min(PER_TOKEN_HEAD_MIN_SCALE)
        zp = (-lo / scale).round().clamp(0, 15)
        q = (x / scale.unsqueeze(-1) + zp.unsqueeze(-1)).round().clamp(0, 15)
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


NORM_EPS = 1e-8
NC_EPS = 1e-16


class TurboQuantCodec(Codec):
    """TurboQuant slots, byte-compatible with vLLM (layout: :class:`tq.SlotLayout`)."""

    def __init__(self, name: str, head_size: int):
        self.preset = tq.preset(name)
        tq.check_head_size(self.preset, head_size)
        self.head_size = head_size
        self.layout = tq.SlotLayout(self.preset, head_size)
        # Constants are built here, eagerly: built lazily inside an export trace they would be
        # captured as trace-time tensors.
        if not self.preset.key_fp8:
            self.rotation = tq.hadamard(head_size)
            self.centroids = tq.centroids(head_size, self.preset.key_bits)
            self.thresholds = tq.thresholds(self.centroids)

    @property
    def tensors(self):
        return (TensorFormat("kv", "uint8", self.layout.slot_size_aligned),)

    # -- keys ------------------------------------------------------------------------------
    def key_codes(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MSE keys: (centroid indices [..., D], fp32 norms [...]) before packing."""
        k = k.float()
        norm = torch.linalg.vector_norm(k, dim=-1)
        y = (k / (norm.unsqueeze(-1) + NORM_EPS)) @ self.rotation
        return tq.centroid_index(y, self.thresholds), norm

    def _encode_keys(self, k):
        if self.preset.key_fp8:
            return tq.fp8_key_bytes(k)
        idx, norm = self.key_codes(k)
        return torch.cat([pack_codes(idx, self.preset.key_bits), tq.fp16_field(norm)], dim=-1)

    def key_parts(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode-side key state: (unit centroid vectors in the rotated basis, fp16 norms) for
        MSE keys (norm-corrected if the preset says so), or (fp8 keys, None)."""
        lay = self.layout
        if self.preset.key_fp8:
            return fp8_decode(slots[..., : lay.key_code_bytes], E4M3), None
        idx = unpack_codes(slots[..., : lay.key_code_bytes], self.preset.key_bits, self.head_size)
        c = self.centroids[idx.to(torch.int64)]
        if self.preset.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + NC_EPS)
        norm_at = lay.key_norm_offset
        return c, fp16_from_bytes(slots[..., norm_at : norm_at + 2])

    def decode_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """Reconstructed keys, k = norm * c @ H (MSE) or the fp8 key."""
        c, norm = self.key_parts(slots)
        if norm is None:
            return c
        return norm.unsqueeze(-1) * (c @ self.rotation)

    def scores(self, q: torch.Tensor, slots: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        """Decode-time scores of queries ``[..., Tq, D]`` against cached slots ``[..., Tk, S]``.

        MSE keys: rotated query against centroids, ``norm * <q @ H, c> * scale``; fp8 keys:
        ``<q, fp8(k)> * scale``. Returns ``[..., Tq, Tk]`` in float32.
        """
        c, norm = self.key_parts(slots)
        q = q.float()
        if norm is None:
            return (q @ c.transpose(-1, -2)) * softmax_scale
        q_rot = q @ self.rotation
        return (q_rot @ c.transpose(-1, -2)) * norm.unsqueeze(-2) * softmax_scale

    # -- values ----------------------------------------------------------------------------
    def _encode_values(self, v):
        groups = self.layout.value_groups
        v = v.float().unflatten(-1, (groups, self.head_size // groups))
        codes, scale, lo = tq.quantize_values(v, self.preset.value_bits)  # NaN/inf as vLLM
        params = torch.cat([tq.fp16_field(scale), tq.fp16_field(lo)], dim=-1)  # [..., groups, 4]
        return torch.cat(
            [pack_codes(codes.flatten(-2), self.preset.value_bits), params.flatten(-2)], dim=-1
        )

    def decode_values(self, slots: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        codes = unpack_codes(
            slots[..., lay.value_offset : lay.value_scale_offset],
            self.preset.value_bits,
            self.head_size,
        )
        params = slots[..., lay.value_scale_offset : lay.slot_size].unflatten(-1, (-1, 4))
        scale, zero = fp16_from_bytes(params[..., 0:2]), fp16_from_bytes(params[..., 2:4])
        codes = codes.float().unflatten(-1, (lay.value_groups, -1))
        return (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)

    # -- slots -----------------------------------------------------------------------------
    def encode(self, k, v, out: torch.Tensor | None = None):
        """Slots ``[..., heads, slot_size_aligned]``. With ``out``, write bytes
        ``[0, slot_size)`` into it and leave the padding bytes as they were."""
        body = torch.cat([self._encode_keys(k), self._encode_values(v)], dim=-1)
        size = self.layout.slot_size
        if out is None:
            out = torch.zeros(*body.shape[:-1], self.layout.slot_size_aligned, dtype=torch.uint8)
        out[..., :size] = body
        return {"kv": out}

    def decode(self, cache):
        slots = cache["kv"]
        return self.decode_keys(slots), self.decode_values(slots)


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
    mode = entry.mode
    if mode is KVQuantMode.NONE:
        storage = model_dtype if entry.element == "model" else entry.element
        torch_dtype(storage)
        return UnquantizedCodec(head_size, storage)
    if mode is KVQuantMode.FP8_PER_TENSOR:
        return Fp8PerTensorCodec(head_size, entry.element, k_scale, v_scale)
    if mode in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        return SymmetricPerTokenHeadCodec(head_size, mode)
    if mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
        return Int4PerTokenHeadCodec(head_size)
    if mode is KVQuantMode.NVFP4:
        return NvFp4Codec(head_size, k_scale, v_scale)
    if mode is KVQuantMode.TURBOQUANT:
        return TurboQuantCodec(kv_cache_dtype, head_size)
    raise AssertionError(f"no codec for mode {mode}")  # every registry mode is handled above


def compression_vs_bf16(codec: Codec) -> float:
    """How many times smaller than a bf16 K+V cache this codec's cache is."""
    return (2 * 2 * codec.head_size) / codec.bytes_per_token_head
