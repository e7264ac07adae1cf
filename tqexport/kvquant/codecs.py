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
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

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
    lookup,
)
from tqexport.kvquant.modes import KVCacheDType, KVQuantMode, parse_kv_cache_dtype
from tqexport.kvquant.packing import pack_codes, unpack_codes

MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: every element type a cache tensor or a model input has (quantized data is uint8 bytes)
TENSOR_DTYPES = {**MODEL_DTYPES, "uint8": torch.uint8}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name used in specs to torch (model dtypes, uint8, fp32)."""
    try:
        return TENSOR_DTYPES[name]
    except KeyError:
        raise TQExportError(f"unknown dtype {name!r}; valid: {', '.join(TENSOR_DTYPES)}") from None


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


def nibbles(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[..., B]`` -> (low, high) 4-bit codes as float32 ``[..., B]`` each: the even and
    the odd elements of :func:`~tqexport.kvquant.packing.unpack_codes` (exact arithmetic)."""
    x = data.to(torch.float32)
    high = torch.floor(x * 0.0625)
    return x - high * 16, high


def triplet_codes(data: torch.Tensor) -> list[torch.Tensor]:
    """uint8 ``[..., 3n]`` 3-bit stream -> 8 float32 ``[..., n]`` tensors, tensor k holding
    codes ``k, k + 8, k + 16, ...`` of :func:`~tqexport.kvquant.packing.unpack_codes` (each
    24-bit word is exact in float32, and so are the power-of-two divisions)."""
    t = data.to(torch.float32).unflatten(-1, (-1, 3))
    word = t[..., 0] + t[..., 1] * 256 + t[..., 2] * 65536
    out = []
    for k in range(8):
        shifted = torch.floor(word * 8.0**-k)
        out.append(shifted - torch.floor(shifted * 0.125) * 8)
    return out


#: the 256 byte values, in order (lookup tables are a function applied to it)
_EVERY_BYTE = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_FP8_E4M3_TABLE = fp8_decode(_EVERY_BYTE, E4M3)
#: fp16_from_bytes of every 16-bit pattern, indexed by ``low byte + 256 * high byte``
_FP16_TABLE = fp16_from_bytes(
    torch.stack([torch.arange(65536) % 256, torch.arange(65536) // 256], dim=-1).to(torch.uint8)
)


def fp16_fields(b: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Little-endian fp16 fields of bytes ``[..., B]`` -> float32 ``[..., n]``, as
    :func:`fp16_from_bytes` gives them but with one table lookup (the table is that function of
    every pattern: identical values). ``weights`` ``[B, n]`` (:func:`fp16_field_weights`) say
    where field j lies (1 at its low byte, 256 at its high byte); default: B = 2n fields in
    order. The pattern is ``bytes @ weights``: exact, small integers in float32.
    """
    if weights is None:
        weights = fp16_field_weights(b.shape[-1], range(0, b.shape[-1], 2))
    pattern = b.to(torch.float32) @ weights
    return lookup(_FP16_TABLE, pattern)


def fp16_field_weights(width: int, offsets) -> torch.Tensor:
    """``[width, n]`` weights for :func:`fp16_fields`: field j's bytes at ``offsets[j]``."""
    offsets = list(offsets)
    w = torch.zeros(width, len(offsets))
    for j, at in enumerate(offsets):
        w[at, j], w[at + 1, j] = 1.0, 256.0
    return w


@dataclass
class AttentionOperands:
    """Cached keys and values in the factored form attention consumes (decode side only).

    Keys and values come as ``parts``: with n parts, part i holds the head's elements
    ``i, i + n, i + 2n, ...`` (packed codes unpack into parts without interleaving them).
    Scores are ``sum_i (q @ query_rotation)[..., i::n] @ keys[i]^T * key_scale`` (rotation and
    scale optional), and the value of a key is ``values * value_scale + value_zero`` per group
    of ``D / groups`` elements, so ``sum_t p_t v_t = (p * s) @ values + p @ z`` needs no
    dequantized V. With ``value_rotation`` the values are in a rotated basis and the weighted
    sum is rotated back once (``sum_t p_t v_t = ((p * s) @ values) @ value_rotation``). With
    ``values_finite`` the values are finite whatever the bytes (codes): a masked key then
    contributes nothing once its scale and zero are zeroed. Shapes: ``keys[i]``/``values[i]``
    ``[..., D / n]``, ``key_scale`` ``[...]``, ``value_scale``/``value_zero`` ``[..., groups]``.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_scale: torch.Tensor | None = None
    query_rotation: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    value_zero: torch.Tensor | None = None
    values_finite: bool = False
    value_rotation: torch.Tensor | None = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) ``[..., D]`` these operands stand for (for tests; attention never builds
        them)."""
        keys = torch.stack(self.keys, dim=-1).flatten(-2)
        if self.query_rotation is not None:
            keys = keys @ self.query_rotation
        if self.key_scale is not None:
            keys = keys * self.key_scale.unsqueeze(-1)
        values = torch.stack(self.values, dim=-1).flatten(-2)
        if self.value_scale is not None:
            values = values.unflatten(-1, (self.value_scale.shape[-1], -1))
            values = values * self.value_scale.unsqueeze(-1)
            if self.value_zero is not None:
                values = values + self.value_zero.unsqueeze(-1)
            values = values.flatten(-2)
        if self.value_rotation is not None:
            values = values @ self.value_rotation
        return keys, values


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

    def attention_operands(self, cache: CacheTensors) -> AttentionOperands:
        """Cache tensors -> the :class:`AttentionOperands` attention reads (default: the
        decoded K and V)."""
        keys, values = self.decode(cache)
        return AttentionOperands((keys,), (values,))

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
        if not self.preset.key_fp8 or self.preset.value_mse:
            self.rotation = tq.hadamard(head_size)
        if not self.preset.key_fp8:
            self.key_book = _Codebook(head_size, self.preset.key_bits)
        if self.preset.value_mse:
            self.value_book = _Codebook(head_size, self.preset.value_bits)
        # where the fp16 fields lie: a norm (key, MSE value) in its 2 bytes; uniform values'
        # scales and zeros in their parameters (group g's pair at 4g)
        lay = self.layout
        self.norm_weights = fp16_field_weights(2, [0])
        if not self.preset.value_mse:
            params = lay.slot_size - lay.value_params_offset
            self.scale_weights = fp16_field_weights(params, range(0, params, 4))
            self.zero_weights = fp16_field_weights(params, range(2, params, 4))

    @staticmethod
    def slot_tensors(layout: tq.SlotLayout) -> tuple[TensorFormat, ...]:
        """The one uint8 tensor of slots, known from the layout alone."""
        return (TensorFormat("kv", "uint8", layout.slot_size_aligned),)

    @property
    def tensors(self):
        return self.slot_tensors(self.layout)

    # -- MSE vectors (keys; values of the _mse presets) ---------------------------------------
    def _mse_codes(self, x: torch.Tensor, book: _Codebook):
        """(centroid indices [..., D], fp32 norms [...]) of vectors x: the unit vector rotated,
        then its coordinates against the codebook's thresholds."""
        x = x.float()
        norm = torch.linalg.vector_norm(x, dim=-1)
        y = (x / (norm.unsqueeze(-1) + NORM_EPS)) @ self.rotation
        return tq.centroid_index(y, book.thresholds), norm

    def _mse_fields(self, x: torch.Tensor, book: _Codebook):
        """(packed code bytes, fp32 norm ``[..., 1]`` stored as an fp16 field)."""
        idx, norm = self._mse_codes(x, book)
        return pack_codes(idx, book.bits), norm.unsqueeze(-1)

    def _mse_parts(self, code_bytes: torch.Tensor, norm_bytes: torch.Tensor, book: _Codebook):
        """Decode-side (centroid parts, scale) of packed MSE codes: part i holds elements
        ``i::n`` in the rotated basis; scale = norm, divided by ``|c|`` (from the codes) when
        the preset corrects norms."""
        if book.byte_parts is not None:
            index = code_bytes.to(torch.int64)
            parts = tuple(lookup(t, index) for t in book.byte_parts)
        else:
            parts = tuple(lookup(book.centroids, c) for c in triplet_codes(code_bytes))
        scale = fp16_fields(norm_bytes, self.norm_weights).squeeze(-1)
        if self.preset.norm_correction:
            if book.byte_norm2 is not None:  # <c, c> summed over bytes
                sumsq = lookup(book.byte_norm2, index).sum(-1)
            else:
                sumsq = sum((c * c).sum(-1) for c in parts)
            scale = scale / torch.sqrt(sumsq + NC_EPS)
        return parts, scale

    def _mse_decode(self, code_bytes: torch.Tensor, norm_bytes: torch.Tensor, book: _Codebook):
        """(unit centroid vectors in the rotated basis, fp16 norms) (norm-corrected if the
        preset says so)."""
        idx = unpack_codes(code_bytes, book.bits, self.head_size)
        c = book.centroids[idx.to(torch.int64)]
        if self.preset.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + NC_EPS)
        return c, fp16_from_bytes(norm_bytes)

    # -- keys ------------------------------------------------------------------------------
    def key_codes(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MSE keys: (centroid indices [..., D], fp32 norms [...]) before packing."""
        return self._mse_codes(k, self.key_book)

    def _key_fields(self, k):
        """(key code bytes, what follows them as fp16 fields ``[..., 0 or 1]``: the norm)."""
        if self.preset.key_fp8:
            return tq.fp8_key_bytes(k), k.new_zeros((*k.shape[:-1], 0), dtype=torch.float32)
        return self._mse_fields(k, self.key_book)

    def _norm_bytes(self, slots: torch.Tensor, at: int) -> torch.Tensor:
        return slots[..., at : at + 2]

    def key_parts(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode-side key state: (unit centroid vectors in the rotated basis, fp16 norms) for
        MSE keys (norm-corrected if the preset says so), or (fp8 keys, None)."""
        lay = self.layout
        if self.preset.key_fp8:
            return fp8_decode(slots[..., : lay.key_code_bytes], E4M3), None
        norm = self._norm_bytes(slots, lay.key_norm_offset)
        return self._mse_decode(slots[..., : lay.key_code_bytes], norm, self.key_book)

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
    def _value_fields(self, v):
        """(value code bytes, what follows them as fp16 fields: the norm of MSE values, else
        each group's (scale, zero) in slot order ``[..., 2 * groups]``)."""
        if self.preset.value_mse:
            return self._mse_fields(v, self.value_book)
        groups = self.layout.value_groups
        v = v.float().unflatten(-1, (groups, self.head_size // groups))
        codes, scale, lo = tq.quantize_values(v, self.preset.value_bits)  # NaN/inf as vLLM
        packed = pack_codes(codes.flatten(-2), self.preset.value_bits)
        return packed, torch.stack([scale, lo], dim=-1).flatten(-2)

    def decode_values(self, slots: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        code_bytes = slots[..., lay.value_offset : lay.value_params_offset]
        if self.preset.value_mse:
            norm = self._norm_bytes(slots, lay.value_norm_offset)
            c, norm = self._mse_decode(code_bytes, norm, self.value_book)
            return norm.unsqueeze(-1) * (c @ self.rotation)
        codes = unpack_codes(code_bytes, self.preset.value_bits, self.head_size)
        params = slots[..., lay.value_params_offset : lay.slot_size].unflatten(-1, (-1, 4))
        scale, zero = fp16_from_bytes(params[..., 0:2]), fp16_from_bytes(params[..., 2:4])
        codes = codes.float().unflatten(-1, (lay.value_groups, -1))
        return (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)

    # -- slots -----------------------------------------------------------------------------
    def encode(self, k, v, out: torch.Tensor | None = None):
        """Slots ``[..., heads, slot_size_aligned]``. With ``out``, write bytes
        ``[0, slot_size)`` into it and leave the padding bytes as they were."""
        key_codes, key_halves = self._key_fields(k)
        value_codes, value_halves = self._value_fields(v)
        # every fp16 field of the slot in one conversion (a graph's CacheWrite is small tensors
        # through many nodes: one conversion instead of three is a third of its nodes)
        halves = tq.fp16_field(torch.cat([key_halves, value_halves], dim=-1))  # [..., n, 2]
        split = key_halves.shape[-1]
        body = torch.cat(
            [key_codes, halves[..., :split, :].flatten(-2),
             value_codes, halves[..., split:, :].flatten(-2)], dim=-1,
        )  # fmt: skip
        size = self.layout.slot_size
        if out is None:
            out = torch.zeros(*body.shape[:-1], self.layout.slot_size_aligned, dtype=torch.uint8)
        out[..., :size] = body
        return {"kv": out}

    def decode(self, cache):
        slots = cache["kv"]
        return self.decode_keys(slots), self.decode_values(slots)

    def attention_operands(self, cache):
        """MSE keys stay in the rotated basis: the centroid vectors ``c`` (not normalized) with
        ``key_scale = norm / sqrt(<c, c> + eps)`` (norm correction, from the codes) or
        ``norm``, scored against ``q @ H``: ``<q, norm * c_nc @ H> = (q @ H) . c * key_scale``
        (H is orthogonal and symmetric). fp8 keys are decoded. Uniform values stay codes, with
        their per-group fp16 scale and zero; MSE values stay centroids in the rotated basis
        with their scale, the weighted sum rotated back once. Packed codes unpack into parts
        (4 for 2-bit, 2 for 4-bit: the codes of each byte position; 8 for 3-bit), never
        interleaved."""
        slots, lay = cache["kv"], self.layout
        code_bytes = slots[..., : lay.key_code_bytes]
        rotation = key_scale = None
        if self.preset.key_fp8:
            keys = (lookup(_FP8_E4M3_TABLE, code_bytes),)
        else:
            norm_bytes = self._norm_bytes(slots, lay.key_norm_offset)
            keys, key_scale = self._mse_parts(code_bytes, norm_bytes, self.key_book)
            rotation = self.rotation
        value_bytes = slots[..., lay.value_offset : lay.value_params_offset]
        if self.preset.value_mse:
            norm_bytes = self._norm_bytes(slots, lay.value_norm_offset)
            values, value_scale = self._mse_parts(value_bytes, norm_bytes, self.value_book)
            return AttentionOperands(
                keys,
                values,
                key_scale=key_scale,
                query_rotation=rotation,
                value_scale=value_scale.unsqueeze(-1),
                values_finite=True,
                value_rotation=self.rotation,
            )
        if self.preset.value_bits == 4:
            values = nibbles(value_bytes)
        else:
            values = tuple(triplet_codes(value_bytes))
        params = slots[..., lay.value_params_offset : lay.slot_size]
        return AttentionOperands(
            keys,
            values,
            key_scale=key_scale,
            query_rotation=rotation,
            value_scale=fp16_fields(params, self.scale_weights),
            value_zero=fp16_fields(params, self.zero_weights),
            values_finite=True,
        )


class _Codebook:
    """One Lloyd-Max codebook of a TurboQuant codec (keys, or the values of ``_mse`` presets):
    centroids, store thresholds, and for 2- and 4-bit codes the decode-side byte tables (byte
    -> the centroid of each code it packs, bit for bit, and -> their sum of squares)."""

    def __init__(self, head_size: int, bits: int):
        self.bits = bits
        self.centroids = tq.centroids(head_size, bits)
        self.thresholds = tq.thresholds(self.centroids)
        self.byte_parts = self.byte_norm2 = None
        if bits in (2, 4):
            per = 8 // bits
            values = self.centroids[unpack_codes(_EVERY_BYTE[:, None], bits, per).long()]
            self.byte_parts = tuple(values[:, i] for i in range(per))
            self.byte_norm2 = (values * values).sum(-1)


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
