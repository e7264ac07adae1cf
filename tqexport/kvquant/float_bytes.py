"""Exact float <-> byte conversions written with arithmetic and table lookups only.

Every codec stores fp8 and fp16 fields as raw bytes. Bit reinterpretation (``Tensor.view(dtype)``)
has no ONNX equivalent and a Cast converts values, not bits, so these routines compute the bit
patterns arithmetically: the same torch code then runs eagerly, exports to standard ONNX ops for
the graph's function bodies, and is byte-identical to a bitcast (tests check every fp8 value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A little float format: exponent bias, mantissa bits, saturation limit."""

    name: str
    torch_dtype: torch.dtype
    bias: int
    mantissa_bits: int
    max_value: float

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def subnormal_step(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)


E4M3 = FloatFormat("float8_e4m3fn", torch.float8_e4m3fn, 7, 3, 448.0)
E5M2 = FloatFormat("float8_e5m2", torch.float8_e5m2, 15, 2, 57344.0)
FP16 = FloatFormat("float16", torch.float16, 15, 10, 65504.0)
FP8_FORMATS = {f.name: f for f in (E4M3, E5M2)}


def _exact_bits(value: torch.Tensor, negative: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Bit pattern (int32) of ``value``, which must already be exactly representable in ``fmt``."""
    a = value.abs()
    normal = a >= fmt.min_normal
    safe = torch.where(normal, a, torch.ones_like(a))
    e = torch.floor(torch.log2(safe))
    # log2 may round across an integer near exact powers of two: fix e so 2^e <= a < 2^(e+1).
    e = e - (safe < torch.pow(2.0, e)).float() + (safe >= torch.pow(2.0, e + 1)).float()
    mant = (safe / torch.pow(2.0, e) - 1.0) * 2**fmt.mantissa_bits
    normal_bits = (e + fmt.bias) * 2**fmt.mantissa_bits + mant
    sub_bits = a / fmt.subnormal_step
    bits = torch.where(normal, normal_bits, sub_bits)
    if fmt is FP16:
        bits = torch.where(torch.isinf(a), torch.full_like(a, 31 * 1024), bits)
    sign = 2 ** (7 if fmt is not FP16 else 15)
    return (bits + torch.where(negative, sign, 0.0)).round().to(torch.int32)


def _is_negative(x: torch.Tensor) -> torch.Tensor:
    """x < 0, counting -0.0 as negative (1/-0 = -inf), like the sign bit."""
    return (x < 0) | ((x == 0) & (1.0 / x < 0))


def fp8_encode(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Saturating round-to-nearest-even cast to fp8, returned as uint8 bit patterns."""
    x = x.float()
    value = x.clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).float()
    return _exact_bits(value, _is_negative(x), fmt).to(torch.uint8)


# Lookup tables are built at import, outside any export trace (a bitcast cannot be exported).
_FP8_TABLES = {
    f.name: torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f.torch_dtype).float()
    for f in (E4M3, E5M2)
}


def fp8_decode(b: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """uint8 fp8 bit patterns -> float32 values (a 256-entry table lookup)."""
    return _FP8_TABLES[fmt.name][b.to(torch.int64)]


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] float -> [..., 2] little-endian fp16 bytes (round to nearest even, inf on overflow)."""
    x = x.float()
    bits = _exact_bits(x.to(torch.float16).float(), _is_negative(x), FP16)
    hi = torch.div(bits, 256, rounding_mode="floor")
    return torch.stack([bits - hi * 256, hi], dim=-1).to(torch.uint8)


# value of one mantissa unit at each fp16 exponent field: 2^(E-25); E=0 is subnormal (2^-24)
_FP16_UNIT = torch.tensor([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)])


def fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> [...] float32 (exact; inf for exponent 31)."""
    bits = b[..., 0].to(torch.int32) + b[..., 1].to(torch.int32) * 256
    negative = bits >= 32768
    bits = bits - torch.where(negative, 32768, 0)
    exp = torch.div(bits, 1024, rounding_mode="floor")
    mant = bits - exp * 1024
    unit = _FP16_UNIT[exp.to(torch.int64)]
    value = torch.where(exp == 0, mant.float(), (mant + 1024).float()) * unit
    value = torch.where(exp == 31, torch.full_like(value, float("inf")), value)
    return torch.where(negative, -value, value)


def int8_to_bytes(q: torch.Tensor) -> torch.Tensor:
    """Signed integers in [-128, 127] -> two's complement uint8."""
    q = q.to(torch.int32)
    return torch.where(q < 0, q + 256, q).to(torch.uint8)


def int8_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Two's complement uint8 -> float32 values in [-128, 127]."""
    v = b.to(torch.int32)
    return torch.where(v >= 128, v - 256, v).float()


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table`` and integer (or uint8) ``index`` of any shape.

    Written as an element-wise gather (ONNX GatherElements), which ONNX Runtime runs an order
    of magnitude faster than a Gather or GatherND of single elements.
    """
    flat = index.to(torch.int64).reshape(1, -1)
    return torch.gather(table.reshape(1, -1), 1, flat).reshape(index.shape)
