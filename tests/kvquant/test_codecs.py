import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqexport.kvquant.codecs import (
    CODECS,
    E2M1_VALUES,
    Fp8PerTensorCodec,
    cache_tensors,
    e2m1_decode,
    e2m1_encode,
    make_codec,
)
from tqexport.kvquant.float_bytes import E4M3, E5M2, fp8_decode
from tqexport.kvquant.modes import KVQuantMode, kv_cache_dtype_names


def kv(n=64, heads=3, d=64, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, d, generator=g) * spread
    v = torch.randn(n, heads, d, generator=g) * spread
    return k, v


def test_fp8_saturates_instead_of_inf():
    x = torch.tensor([[[1000.0, -1000.0, 448.0, 1.0]]])
    enc = Fp8PerTensorCodec(4, "float8_e4m3fn").encode(x, x)
    assert enc["k"].dtype == torch.uint8
    assert fp8_decode(enc["k"], E4M3).tolist() == [[[448.0, -448.0, 448.0, 1.0]]]
    y = torch.tensor([[[70000.0, -70000.0, 57344.0, 1.0]]])
    assert torch.tensor([70000.0]).to(torch.float8_e5m2).float().isinf().all()  # torch alone
    enc = Fp8PerTensorCodec(4, "float8_e5m2").encode(y, y)
    assert fp8_decode(enc["v"], E5M2).tolist() == [[[57344.0, -57344.0, 57344.0, 1.0]]]


def test_fp8_per_tensor_scales_round_trip():
    codec = make_codec("fp8", 4, k_scale=2.0, v_scale=0.25)
    k = torch.tensor([[[3.0, -1.0, 0.5, 896.0]]])  # 896 / 2 = 448: the e4m3 maximum
    v = torch.tensor([[[0.375, -0.125, 112.0, 0.0]]])  # / 0.25 -> 1.5, -0.5, 448, 0
    enc = codec.encode(k, v)
    assert enc["k"][0, 0].tolist() == [0x3C, 0xB0, 0x28, 0x7E]  # 1.5, -0.5, 0.25, 448
    k_hat, v_hat = codec.decode(enc)
    assert torch.equal(k_hat, k) and torch.equal(v_hat, v)
    k2, _ = kv(spread=5.0)
    k2_hat, _ = make_codec("fp8_e4m3", 64, k_scale=0.1).decode(
        make_codec("fp8_e4m3", 64, k_scale=0.1).encode(k2, k2)
    )
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus a subnormal step.
    assert bool(((k2_hat - k2).abs() <= k2.abs() * 2**-4 + 0.1 * 2**-10).all())


def test_int8_per_token_head_error_bound():
    k, v = kv(spread=3.0)
    codec = make_codec("int8_per_token_head", 64)
    enc = codec.encode(k, v)
    assert enc["k_scale"].shape == (64, 3) and enc["k_scale"].dtype == torch.float32
    scale = (k.abs().amax(-1) / 127).clamp_min(1e-6)
    torch.testing.assert_close(enc["k_scale"], scale)
    k_hat, _ = codec.decode(enc)
    assert bool(((k_hat - k).abs() <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all())
    assert enc["k"].view(torch.int8).abs().amax().item() == 127


def test_fp8_per_token_head_error_bound():
    k, v = kv(spread=0.01)
    codec = make_codec("fp8_per_token_head", 64)
    enc = codec.encode(k, v)
    scale = (v.abs().amax(-1) / 448).clamp_min(1e-6)
    _, v_hat = codec.decode(enc)
    bound = v.abs() * 2**-4 + scale.unsqueeze(-1) * 2**-10
    assert bool(((v_hat - v).abs() <= bound).all())


def test_int4_per_token_head_error_bound_and_layout():
    k, v = kv(d=64)
    codec = make_codec("int4_per_token_head", 64)
    enc = codec.encode(k, v)
    assert enc["k"].shape == (64, 3, 32) and enc["k_zero"].dtype == torch.uint8
    scale = ((k.amax(-1) - k.amin(-1)) / 15).clamp_min(1e-6)
    k_hat, _ = codec.decode(enc)
    assert bool(((k_hat - k).abs() <= scale.unsqueeze(-1) * (0.5 + 1e-4)).all())
    # even element in the low nibble
    x = torch.zeros(1, 1, 4)
    x[0, 0] = torch.tensor([0.0, 15.0, 3.0, 1.0])  # scale 1, zp 0 -> codes 0, 15, 3, 1
    enc4 = make_codec("int4_per_token_head", 4).encode(x, x)
    assert enc4["k"][0, 0].tolist() == [0xF0, 0x13]
    assert enc4["k_zero"].item() == 0 and enc4["k_scale"].item() == 1.0


def test_e2m1_rounds_to_nearest_ties_to_even():
    x = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.5, -5.5, 0.3])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [
        0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.5,
    ]  # fmt: skip
    for code, value in enumerate(E2M1_VALUES.tolist()):
        assert e2m1_encode(torch.tensor([value])).item() == code
        assert e2m1_encode(torch.tensor([-value])).item() == (code | 8 if code else 0)


def _nvfp4_half_gap(y):
    return torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))


def test_nvfp4_error_bound_and_layout():
    k, v = kv(d=64, spread=2.0)
    codec = make_codec("nvfp4", 64, k_scale=0.5)
    enc = codec.encode(k, v)
    assert enc["k"].shape == (64, 3, 32 + 4)
    k_hat, _ = codec.decode(enc)
    blocks = k.unflatten(-1, (-1, 16))
    s_eff = (fp8_decode(enc["k"][..., 32:], E4M3) * 0.5).unsqueeze(-1)  # scale actually stored
    amax = blocks.abs().amax(-1, keepdim=True)
    assert bool(((s_eff * 6 - amax).abs() <= amax * 2**-4).all())  # e4m3 rounding of amax/6
    y = blocks.abs() / s_eff
    bound = (torch.where(y > 6, y - 6, _nvfp4_half_gap(y)) + 1e-5) * s_eff
    assert bool(((k_hat.unflatten(-1, (-1, 16)) - blocks).abs() <= bound).all())


def test_nvfp4_zero_block():
    z = torch.zeros(1, 1, 16)
    codec = make_codec("nvfp4", 16)
    enc = codec.encode(z, z)
    assert enc["k"].tolist() == [[[0] * 9]]
    assert torch.equal(codec.decode(enc)[0], z)


@pytest.mark.parametrize("name", kv_cache_dtype_names())
def test_every_codec_writes_the_tensors_it_declares(name):
    k, v = kv(n=5, heads=2, d=64)
    codec = make_codec(name, 64, model_dtype="float16")
    enc = codec.encode(k, v)
    assert set(enc) == {t.role for t in codec.tensors}
    for t in codec.tensors:
        assert tuple(enc[t.role].shape) == t.shape(5, 2)
        assert str(enc[t.role].dtype) == f"torch.{t.dtype}"
    k_hat, v_hat = codec.decode(enc)
    assert k_hat.shape == k.shape and v_hat.shape == v.shape
    assert k_hat.dtype == torch.float32


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(kv_cache_dtype_names()), st.integers(1, 4), st.integers(0, 2**31))
def test_decode_is_idempotent_after_one_round_trip(name, heads, seed):
    """Re-encoding decoded values reproduces the same decoded values (a quantizer fixpoint),
    for every mode: the codes are stable under round trips."""
    k, v = kv(n=3, heads=heads, d=64, seed=seed)
    codec = make_codec(name, 64, model_dtype="float32")
    k1, v1 = codec.decode(codec.encode(k, v))
    k2, v2 = codec.decode(codec.encode(k1, v1))
    torch.testing.assert_close(v2, v1, atol=2e-2 * v1.abs().max().item() + 1e-6, rtol=0)
    torch.testing.assert_close(k2, k1, atol=2e-2 * k1.abs().max().item() + 1e-6, rtol=0)


def test_every_quant_mode_names_its_codec():
    assert set(CODECS) == set(KVQuantMode)


def test_cache_tensors_are_the_codecs_tensors():
    """cache_tensors answers without building a codec, and answers what the codec has."""
    for name in kv_cache_dtype_names():
        for d in (64, 128):
            assert (
                cache_tensors(name, d, "float16")
                == make_codec(name, d, model_dtype="float16").tensors
            )
