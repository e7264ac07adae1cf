import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqexport.kvquant.packing import pack_codes, packed_bytes, unpack_codes


def reference_pack(codes, bits):
    """LSB-first bit stream, one Python integer: independent of the vectorized packer."""
    acc = 0
    for i, c in enumerate(codes):
        acc |= int(c) << (bits * i)
    return list(acc.to_bytes(math.ceil(len(codes) * bits / 8), "little"))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([3, 4, 8]), st.integers(1, 12), st.data())
def test_pack_roundtrip_and_matches_bit_stream(bits, groups, data):
    n = groups * 8
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=n, max_size=n))
    t = torch.tensor(codes)
    packed = pack_codes(t, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (packed_bytes(n, bits),)
    assert packed.tolist() == reference_pack(codes, bits)
    assert unpack_codes(packed, bits, n).tolist() == codes


def test_four_bit_low_nibble_first():
    assert pack_codes(torch.tensor([0x1, 0xF, 0x0, 0x7]), 4).tolist() == [0xF1, 0x70]
    assert pack_codes(torch.tensor([5, 9, 3]), 4).tolist() == [0x95, 0x03]


def test_three_bit_every_code_in_every_position():
    # Each of the 8 positions of a 24-bit word holds each of the 8 codes once.
    codes = torch.tensor([(pos + shift) % 8 for shift in range(8) for pos in range(8)])
    packed = pack_codes(codes, 3)
    assert packed.tolist() == reference_pack(codes.tolist(), 3)
    assert torch.equal(unpack_codes(packed, 3, 64), codes)
    # 0..7 in order: 0b111_110_101_100_011_010_001_000 = 0xFAC688 -> bytes 88 C6 FA.
    assert pack_codes(torch.arange(8), 3).tolist() == [0x88, 0xC6, 0xFA]


def test_batched_leading_dims():
    codes = torch.randint(0, 8, (3, 5, 16))
    assert torch.equal(unpack_codes(pack_codes(codes, 3), 3, 16), codes)


def test_three_bit_needs_multiple_of_eight():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(12, dtype=torch.int64), 3)
