"""CacheWrite kernels: TurboQuant slot encode + pack, fp8 per-tensor, unquantized.

One program per (token, kv head). Offsets and bit widths come from the layer's
:class:`~tqexport.kvquant.turboquant.SlotLayout` as constexprs; a write touches bytes
``[0, slot_size)`` of the slot only (padding is never written). TurboQuant slots are 2-byte
aligned at best (70/62/54 bytes), so every field is stored bytewise. Padding tokens (slot < 0)
are redirected to the null block's first slot, like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqexport.kvquant.codecs import Codec, Fp8PerTensorCodec, TurboQuantCodec, UnquantizedCodec
from tqexport.kvquant.float_bytes import FP8_FORMATS
from tqexport.ops.triton.common import (
    TRITON_TYPES,
    WRITE_LAYOUT_KEYS,
    as_fp32,
    hadamard_tile,
    layout_constants,
    turboquant_inline_tables,
    turboquant_tables,
)


@triton.jit
def _store_fp16_bytes(ptr, x):
    """fp16 bytes of x; a NaN as 0x7E00 (tq.FP16_NAN), whatever NaN the cast gives."""
    bits = x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    bits = tl.where(x != x, 0x7E00, bits)
    tl.store(ptr, (bits & 255).to(tl.uint8))
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8))


@triton.jit
def _fp8_bits(x, MBITS: tl.constexpr, BIAS: tl.constexpr, LIMIT: tl.constexpr):
    """Saturating round-to-nearest-even fp32 -> fp8 bit pattern, by integer arithmetic.

    Written out (instead of ``.to(tl.float8e4nv)``) so the interpreter and the GPU produce the
    same bytes: the interpreter's fp8 cast does not round like the hardware's cvt.rn.
    A NaN gives 0x7F (tq.E4M3_NAN for e4m3).
    """
    nan = x != x
    x = tl.minimum(tl.maximum(x, -LIMIT), LIMIT)
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    a = u & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MBITS
    lsb = (a >> shift) & 1
    normal = ((a + (1 << (shift - 1)) - 1 + lsb) >> shift) - ((127 - BIAS) << MBITS)
    scaled = tl.abs(x) * (2.0 ** (BIAS - 1 + MBITS))  # in subnormal steps
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)  # round half to even
    min_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    bits = tl.where(tl.abs(x) >= min_normal, normal, sub) + sign * 128
    return tl.where(nan, 127, bits).to(tl.uint8)


@triton.jit
def _store_packed(ptr, codes, BITS: tl.constexpr, D: tl.constexpr):
    """Pack int32 codes [D] little-endian (4-bit: low nibble first; 2-bit: lowest bits first;
    3-bit: LSB-first stream)."""
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (D // 2, 2)))
        tl.store(ptr + tl.arange(0, D // 2), (lo + hi * 16).to(tl.uint8))
    elif BITS == 2:
        shifts = tl.arange(0, 4) * 2
        byte = tl.sum(tl.reshape(codes, (D // 4, 4)) << shifts[None, :], axis=1)
        tl.store(ptr + tl.arange(0, D // 4), byte.to(tl.uint8))
    else:
        groups = tl.reshape(codes, (D // 8, 8))
        shifts = tl.arange(0, 8) * 3
        word = tl.sum(groups << shifts[None, :], axis=1)
        g = tl.arange(0, D // 8) * 3
        tl.store(ptr + g, (word & 255).to(tl.uint8))
        tl.store(ptr + g + 1, ((word >> 8) & 255).to(tl.uint8))
        tl.store(ptr + g + 2, ((word >> 16) & 255).to(tl.uint8))


@triton.jit
def _mse_codes(y, th_ptr, BITS: tl.constexpr, INLINE: tl.constexpr, TH: tl.constexpr):
    """Centroid index per coordinate: how many thresholds are <= y (from ``th_ptr`` or TH)."""
    idx = tl.zeros(y.shape, dtype=tl.int32)
    for j in tl.static_range(2**BITS - 1):
        if INLINE:
            idx += (y >= TH[j]).to(tl.int32)
        else:
            idx += (y >= tl.load(th_ptr + j)).to(tl.int32)
    return idx


@triton.jit
def _turboquant_write(
    pid, k_ptr, v_ptr, slot_ptr, cache_ptr, rot_ptr, th_ptr,
    H: tl.constexpr, D: tl.constexpr, SLOT: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr, INLINE: tl.constexpr, INV_SQRT: tl.constexpr, TH: tl.constexpr,
    NG: tl.constexpr, VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VTH: tl.constexpr,
):  # fmt: skip
    """Encode and pack one (token, kv head) into its slot: the body of both entry points.
    Values are quantized in NG groups (1 = vLLM), each with an fp16 (scale, zero) pair, or
    (VAL_MSE) like MSE keys against the value thresholds VTH, with their fp16 norm.
    NaN and inf follow the reference (tq.quantize_values): min/max skip NaN elements, a NaN
    scale is stored as 1e-8, a NaN code as 0; a NaN coordinate passes no threshold (code 0)."""
    t = pid // H
    h = pid % H
    offs = tl.arange(0, D)
    slot = tl.load(slot_ptr + t)
    slot = tl.where(slot < 0, 0, slot)
    base = cache_ptr + (slot * H + h) * SLOT
    k = tl.load(k_ptr + pid * D + offs).to(tl.float32)
    v = tl.load(v_ptr + pid * D + offs).to(tl.float32)
    if KEY_FP8:
        tl.store(base + offs, _fp8_bits(k, 3, 7, 448.0))
    else:
        norm = tl.sqrt(tl.sum(k * k, axis=0))
        x = k / (norm + 1e-8)
        rot = hadamard_tile(rot_ptr, D, INLINE, INV_SQRT)
        y = tl.sum(x[:, None] * rot, axis=0)
        idx = _mse_codes(y, th_ptr, KEY_BITS, INLINE, TH)
        _store_packed(base, idx, KEY_BITS, D)
        _store_fp16_bytes(base + NORM_OFF, norm)
    if VAL_MSE:  # keys are MSE too (the presets' rule): the rotation is loaded
        vnorm = tl.sqrt(tl.sum(v * v, axis=0))
        xv = v / (vnorm + 1e-8)
        yv = tl.sum(xv[:, None] * rot, axis=0)
        _store_packed(base + VAL_OFF, _mse_codes(yv, th_ptr, VAL_BITS, True, VTH), VAL_BITS, D)
        _store_fp16_bytes(base + VNORM_OFF, vnorm)
    else:
        levels: tl.constexpr = 2**VAL_BITS - 1
        GS: tl.constexpr = D // NG
        vg = tl.reshape(v, (NG, GS))
        lo = tl.min(vg, axis=1)
        hi = tl.max(vg, axis=1)
        scale = (hi - lo) / levels
        scale = tl.where(scale > 1e-8, scale, 1e-8)
        codes = tl.floor((vg - lo[:, None]) / scale[:, None] + 0.5)
        codes = tl.where(codes == codes, codes, 0.0)
        codes = tl.minimum(tl.maximum(codes, 0.0), levels).to(tl.int32)
        _store_packed(base + VAL_OFF, tl.reshape(codes, (D,)), VAL_BITS, D)
        pair = tl.arange(0, NG) * 4
        _store_fp16_bytes(base + SCALE_OFF + pair, scale)
        _store_fp16_bytes(base + ZERO_OFF + pair, lo)


@triton.jit
def turboquant_write_kernel(
    k_ptr, v_ptr, slot_ptr, cache_ptr, rot_ptr, th_ptr,
    H: tl.constexpr, D: tl.constexpr, SLOT: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr, NG: tl.constexpr, VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr,
    VTH: tl.constexpr,
):  # fmt: skip
    _turboquant_write(
        tl.program_id(0), k_ptr, v_ptr, slot_ptr, cache_ptr, rot_ptr, th_ptr, H, D, SLOT,
        KEY_BITS, VAL_BITS, KEY_FP8, NORM_OFF, VAL_OFF, SCALE_OFF, ZERO_OFF, False, 0.0, None,
        NG, VAL_MSE, VNORM_OFF, VTH,
    )  # fmt: skip


@triton.jit
def trt_turboquant_write_kernel(
    cache_in_ptr, k_ptr, v_ptr, slot_ptr, cache_ptr,
    H: tl.constexpr, D: tl.constexpr, SLOT: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr, INV_SQRT: tl.constexpr, TH: tl.constexpr, NG: tl.constexpr,
    VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VTH: tl.constexpr,
):  # fmt: skip
    """TensorRT order (node inputs, then the output): tables in-kernel; the output aliases
    ``cache_in_ptr``, which is only there to keep the argument positions."""
    _turboquant_write(
        tl.program_id(0), k_ptr, v_ptr, slot_ptr, cache_ptr, cache_in_ptr, cache_in_ptr, H, D,
        SLOT, KEY_BITS, VAL_BITS, KEY_FP8, NORM_OFF, VAL_OFF, SCALE_OFF, ZERO_OFF, True,
        INV_SQRT, TH, NG, VAL_MSE, VNORM_OFF, VTH,
    )  # fmt: skip


@triton.jit
def _fp8_write_row(pid, x_ptr, slot_ptr, cache_ptr, scale, H: tl.constexpr, D: tl.constexpr,
                   E5M2: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, D)
    slot = tl.load(slot_ptr + pid // H)
    slot = tl.where(slot < 0, 0, slot)
    x = tl.load(x_ptr + pid * D + offs).to(tl.float32) / scale
    if E5M2:
        b = _fp8_bits(x, 2, 15, 57344.0)
    else:
        b = _fp8_bits(x, 3, 7, 448.0)
    tl.store(cache_ptr + (slot * H + pid % H) * D + offs, b)


@triton.jit
def _copy_write_row(pid, x_ptr, slot_ptr, cache_ptr, H: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, D)
    slot = tl.load(slot_ptr + pid // H)
    slot = tl.where(slot < 0, 0, slot)
    x = tl.load(x_ptr + pid * D + offs)
    tl.store(cache_ptr + (slot * H + pid % H) * D + offs, x.to(cache_ptr.dtype.element_ty))


@triton.jit
def fp8_write_kernel(
    x_ptr, slot_ptr, cache_ptr, scale,
    H: tl.constexpr, D: tl.constexpr, E5M2: tl.constexpr,
):  # fmt: skip
    _fp8_write_row(tl.program_id(0), x_ptr, slot_ptr, cache_ptr, scale, H, D, E5M2)


@triton.jit
def copy_write_kernel(x_ptr, slot_ptr, cache_ptr, H: tl.constexpr, D: tl.constexpr):
    _copy_write_row(tl.program_id(0), x_ptr, slot_ptr, cache_ptr, H, D)


@triton.jit
def trt_fp8_write_kernel(
    k_cache_in_ptr, v_cache_in_ptr, k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    H: tl.constexpr, D: tl.constexpr, E5M2: tl.constexpr,
    K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
):  # fmt: skip
    """TensorRT order; K and V in one launch, the per-layer scales as constexprs."""
    pid = tl.program_id(0)
    _fp8_write_row(pid, k_ptr, slot_ptr, k_cache_ptr, K_SCALE, H, D, E5M2)
    _fp8_write_row(pid, v_ptr, slot_ptr, v_cache_ptr, V_SCALE, H, D, E5M2)


@triton.jit
def trt_copy_write_kernel(
    k_cache_in_ptr, v_cache_in_ptr, k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    H: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """TensorRT order; K and V in one launch."""
    pid = tl.program_id(0)
    _copy_write_row(pid, k_ptr, slot_ptr, k_cache_ptr, H, D)
    _copy_write_row(pid, v_ptr, slot_ptr, v_cache_ptr, H, D)


# FMA contraction would round differently from the reference (and from the interpreter).
LAUNCH = {"enable_fp_fusion": False}


def _turboquant_constants(codec: TurboQuantCodec, heads: int) -> dict:
    layout = layout_constants(codec)
    return dict(H=heads, D=codec.head_size, **{k: layout[k] for k in WRITE_LAYOUT_KEYS})


def kernel_variants(codec: Codec, heads: int):
    """(kernel, signature, constexprs) this codec launches: used for the ahead-of-time checks."""
    d = codec.head_size
    if isinstance(codec, TurboQuantCodec):
        sig = {n: t for n, t in zip(
            ("k_ptr", "v_ptr", "slot_ptr", "cache_ptr", "rot_ptr", "th_ptr"),
            ("*fp32", "*fp32", "*i64", "*u8", "*fp32", "*fp32"), strict=True)}  # fmt: skip
        consts = _turboquant_constants(codec, heads)
        return [(turboquant_write_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)]
    if isinstance(codec, Fp8PerTensorCodec):
        sig = {"x_ptr": "*fp32", "slot_ptr": "*i64", "cache_ptr": "*u8", "scale": "fp32"}
        consts = dict(H=heads, D=d, E5M2=codec.fmt is FP8_FORMATS["float8_e5m2"])
        return [(fp8_write_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)]
    sig = {"x_ptr": "*fp32", "slot_ptr": "*i64", "cache_ptr": "*fp32"}
    consts = dict(H=heads, D=d)
    return [(copy_write_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)]


def trt_kernel_variant(codec: Codec, heads: int, model_dtype: str):
    """(kernel, signature, constexprs) of the TensorRT-order entry point for this codec."""
    x = "*" + TRITON_TYPES[model_dtype]
    d = codec.head_size
    if isinstance(codec, TurboQuantCodec):
        sig = {
            "cache_in_ptr": "*u8",
            "k_ptr": x,
            "v_ptr": x,
            "slot_ptr": "*i64",
            "cache_ptr": "*u8",
        }
        consts = {**_turboquant_constants(codec, heads), **turboquant_inline_tables(codec)}
        return trt_turboquant_write_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts
    cache_t = "*u8" if isinstance(codec, Fp8PerTensorCodec) else x
    sig = {"k_cache_in_ptr": cache_t, "v_cache_in_ptr": cache_t, "k_ptr": x, "v_ptr": x,
           "slot_ptr": "*i64", "k_cache_ptr": cache_t, "v_cache_ptr": cache_t}  # fmt: skip
    if isinstance(codec, Fp8PerTensorCodec):
        consts = dict(H=heads, D=d, E5M2=codec.fmt is FP8_FORMATS["float8_e5m2"],
                      K_SCALE=as_fp32(codec.k_scale), V_SCALE=as_fp32(codec.v_scale))  # fmt: skip
        return trt_fp8_write_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts
    if isinstance(codec, UnquantizedCodec):
        consts = dict(H=heads, D=d)
        return trt_copy_write_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts
    raise ValueError(f"the Triton cache write does not cover {type(codec).__name__}")


def write_cache_(codec: Codec, cache: list[torch.Tensor], k, v, slot_mapping) -> None:
    """In-place cache write with the Triton kernels (same bytes as the reference op)."""
    tokens, heads, d = k.shape
    grid = (tokens * heads,)
    k, v, slots = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    if isinstance(codec, TurboQuantCodec):
        dummy = torch.zeros(1, device=k.device)
        if codec.preset.key_fp8:
            rot = th = dummy
        else:
            rot, _, th = turboquant_tables(d, codec.preset.key_bits, str(k.device))
        turboquant_write_kernel[grid](
            k, v, slots, cache[0], rot, th, **_turboquant_constants(codec, heads), **LAUNCH
        )
    elif isinstance(codec, Fp8PerTensorCodec):
        e5m2 = codec.fmt is FP8_FORMATS["float8_e5m2"]
        for x, c, s in ((k, cache[0], codec.k_scale), (v, cache[1], codec.v_scale)):
            fp8_write_kernel[grid](x, slots, c, s, H=heads, D=d, E5M2=e5m2, **LAUNCH)
    elif isinstance(codec, UnquantizedCodec):
        for x, c in ((k, cache[0]), (v, cache[1])):
            copy_write_kernel[grid](x, slots, c, H=heads, D=d, **LAUNCH)
    else:
        # per-token-head and nvfp4 caches are written by the reference op (see supports())
        raise ValueError(f"the Triton cache write does not cover {type(codec).__name__}")
