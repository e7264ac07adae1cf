"""Little-endian bit packing of small integer codes into bytes (3, 4 and 8 bits).

4-bit: byte i = code[2i] | code[2i+1] << 4 (even element in the low nibble).
3-bit: an LSB-first bit stream, code i in bits [3i, 3i+3): every 8 codes are one 24-bit
little-endian word in 3 bytes, so the code count must be a multiple of 8.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (3, 4, 8)


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits occupy."""
    return math.ceil(count * bits / 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [..., N] (values < 2**bits) into uint8 [..., ceil(N*bits/8)]."""
    codes = codes.to(torch.int32)
    n = codes.shape[-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        if n % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        pairs = codes.unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    if bits == 3:
        if n % 8:
            raise ValueError(f"3-bit packing needs a multiple of 8 codes, got {n}")
        groups = codes.unflatten(-1, (-1, 8))
        shifts = torch.arange(0, 24, 3, dtype=torch.int32)
        words = (groups << shifts).sum(-1, dtype=torch.int32)
        out = torch.stack([(words >> s) & 0xFF for s in (0, 8, 16)], dim=-1)
        return out.flatten(-2).to(torch.uint8)
    raise ValueError(f"unsupported code width {bits}; supported: {SUPPORTED_BITS}")


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., B] -> int64 codes [..., count]."""
    data = packed.to(torch.int64)
    if bits == 8:
        return data[..., :count]
    if bits == 4:
        both = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2)
        return both[..., :count]
    if bits == 3:
        triples = data.unflatten(-1, (-1, 3))
        words = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
        shifts = torch.arange(0, 24, 3, dtype=torch.int64)
        codes = (words.unsqueeze(-1) >> shifts) & 0x7
        return codes.flatten(-2)[..., :count]
    raise ValueError(f"unsupported code width {bits}; supported: {SUPPORTED_BITS}")
