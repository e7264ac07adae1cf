"""Little-endian bit packing of small integer codes into bytes (2, 3, 4 and 8 bits).

2-bit: byte i = code[4i] | code[4i+1] << 2 | code[4i+2] << 4 | code[4i+3] << 6.
4-bit: byte i = code[2i] | code[2i+1] << 4 (even element in the low nibble).
3-bit: an LSB-first bit stream, code i in bits [3i, 3i+3): every 8 codes are one 24-bit
little-endian word in 3 bytes, so the code count must be a multiple of 8.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)
# Shifts and masks are written as integer arithmetic: ONNX BitShift takes unsigned types only
# and tensor-valued shifts do not export, while Mul/Div/Mod on int32 run everywhere.
_POW8 = torch.tensor([8**i for i in range(8)], dtype=torch.int32)


def _digit(words: torch.Tensor, base: int, i: int) -> torch.Tensor:
    """Digit i of non-negative integers in the given base."""
    return torch.remainder(torch.div(words, base**i, rounding_mode="floor"), base)


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits occupy."""
    return math.ceil(count * bits / 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [..., N] (values < 2**bits) into uint8 [..., ceil(N*bits/8)]."""
    codes = codes.to(torch.int32)
    n = codes.shape[-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if bits in (2, 4):
        per = 8 // bits
        if n % per:
            codes = torch.nn.functional.pad(codes, (0, per - n % per))
        groups = codes.unflatten(-1, (-1, per))
        return sum(groups[..., i] * 2 ** (bits * i) for i in range(per)).to(torch.uint8)
    if bits == 3:
        if n % 8:
            raise ValueError(f"3-bit packing needs a multiple of 8 codes, got {n}")
        groups = codes.unflatten(-1, (-1, 8))
        words = (groups * _POW8).sum(-1, dtype=torch.int32)
        out = torch.stack([_digit(words, 256, i) for i in range(3)], dim=-1)
        return out.flatten(-2).to(torch.uint8)
    raise ValueError(f"unsupported code width {bits}; supported: {SUPPORTED_BITS}")


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., B] -> int32 codes [..., count]."""
    data = packed.to(torch.int32)
    if bits == 8:
        return data[..., :count]
    if bits in (2, 4):
        base = 2**bits
        parts = [_digit(data, base, i) for i in range(8 // bits)]
        return torch.stack(parts, dim=-1).flatten(-2)[..., :count]
    if bits == 3:
        triples = data.unflatten(-1, (-1, 3))
        words = triples[..., 0] + triples[..., 1] * 256 + triples[..., 2] * 65536
        codes = torch.stack([_digit(words, 8, i) for i in range(8)], dim=-1)
        return codes.flatten(-2)[..., :count]
    raise ValueError(f"unsupported code width {bits}; supported: {SUPPORTED_BITS}")
