import pytest
import torch

from tqexport.kvquant.float_bytes import (
    E4M3,
    E5M2,
    fp8_decode,
    fp8_encode,
    fp16_bytes,
    fp16_from_bytes,
    int8_from_bytes,
    int8_to_bytes,
)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_every_fp8_pattern_round_trips(fmt):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = fp8_decode(b, fmt)
    assert torch.equal(values.isnan(), b.view(fmt.torch_dtype).float().isnan())
    finite = values.isfinite()
    assert torch.equal(fp8_encode(values[finite], fmt), b[finite])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_encode_equals_a_saturating_bitcast(fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.cat(
        [
            torch.randn(200_000, generator=g) * 10 ** torch.randint(-6, 6, (200_000,), generator=g),
            torch.tensor([0.0, -0.0, 1e9, -1e9, fmt.max_value, fmt.min_normal, fmt.subnormal_step]),
        ]
    )
    expected = x.clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).view(torch.uint8)
    assert torch.equal(fp8_encode(x, fmt), expected)


def test_fp16_bytes_equal_bitcast_on_two_million_values():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2_000_000, generator=g) * 2.0 ** torch.randint(
        -30, 20, (2_000_000,), generator=g
    )
    x = torch.cat([x, torch.tensor([0.0, -0.0, 65504.0, 70000.0, -1e6, 6e-8, 2.0**-24, 2.0**-14])])
    expected = x.to(torch.float16).unsqueeze(-1).view(torch.uint8)
    got = fp16_bytes(x)
    assert torch.equal(got, expected)
    assert torch.equal(fp16_from_bytes(got), x.to(torch.float16).float())


def test_every_fp16_pattern_decodes_like_torch():
    b = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).reshape(-1, 2)
    ref = b.contiguous().view(torch.float16).squeeze(-1).float()
    got = fp16_from_bytes(b)
    ok = ~ref.isnan()
    assert torch.equal(got[ok], ref[ok])


def test_int8_twos_complement():
    q = torch.arange(-128, 128)
    b = int8_to_bytes(q)
    assert torch.equal(b, q.to(torch.int8).view(torch.uint8))
    assert torch.equal(int8_from_bytes(b), q.float())
