import math
import struct

import pytest
import torch

from tqexport.errors import TQExportError
from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codecs import TurboQuantCodec, make_codec

PRESET_NAMES = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]

# REFERENCE.md section 2: slot_size_aligned per (token, kv head), and bf16 K+V for comparison.
SLOT_TABLE = {
    64: [100, 70, 62, 54, 256],
    128: [196, 134, 118, 102, 512],
    256: [388, 262, 230, 198, 1024],
}


@pytest.mark.parametrize("d", sorted(SLOT_TABLE))
def test_slot_sizes_match_reference_table(d):
    got = [tq.slot_layout(name, d).slot_size_aligned for name in PRESET_NAMES]
    assert got == SLOT_TABLE[d][:4]
    assert make_codec("bfloat16", d).bytes_per_token_head == SLOT_TABLE[d][4]
    assert [make_codec(n, d).bytes_per_token_head for n in PRESET_NAMES] == SLOT_TABLE[d][:4]


def test_layout_offsets_d128():
    lay = tq.slot_layout("turboquant_k3v4_nc", 128)
    assert (lay.key_code_bytes, lay.key_norm_offset) == (48, 48)
    assert (lay.value_offset, lay.value_code_bytes) == (50, 64)
    assert (lay.value_scale_offset, lay.value_zero_offset, lay.slot_size) == (114, 116, 118)
    k8 = tq.slot_layout("turboquant_k8v4", 128)
    assert (k8.key_norm_offset, k8.value_offset, k8.value_scale_offset) == (None, 128, 192)


def test_presets():
    got = {
        n: (p.key_bits, p.value_bits, p.norm_correction, p.value_group, p.native, p.value_mse)
        for n, p in tq.PRESETS.items()
    }
    assert got == {
        "turboquant_k8v4": (8, 4, False, 0, False, False),
        "turboquant_4bit_nc": (4, 4, True, 0, False, False),
        "turboquant_k3v4_nc": (3, 4, True, 0, False, False),
        "turboquant_3bit_nc": (3, 3, True, 0, False, False),
        "tqx_k4v4_g32": (4, 4, True, 32, True, False),
        "tqx_k4v3_g32": (4, 3, True, 32, True, False),
        "tqx_k4v4": (4, 4, True, 0, True, False),
        "tqx_k3v3": (3, 3, True, 0, True, False),
        "tqx_k4v3_mse": (4, 3, True, 0, True, True),
        "tqx_k4v2_mse": (4, 2, True, 0, True, True),
        "tqx_k3v2_mse": (3, 2, True, 0, True, True),
    }


@pytest.mark.parametrize(
    "name,d,offsets",
    [  # key codes, norm, value offset, value codes, scale 0, zero 0, groups, slot
        ("tqx_k4v4_g32", 64, (32, 32, 34, 32, 66, 68, 2, 74)),
        ("tqx_k4v4_g32", 128, (64, 64, 66, 64, 130, 132, 4, 146)),
        ("tqx_k4v3_g32", 64, (32, 32, 34, 24, 58, 60, 2, 66)),
        ("tqx_k4v3_g32", 128, (64, 64, 66, 48, 114, 116, 4, 130)),
    ],
)
def test_native_layouts(name, d, offsets):
    lay = tq.slot_layout(name, d)
    got = (lay.key_code_bytes, lay.key_norm_offset, lay.value_offset, lay.value_code_bytes,
           lay.value_scale_offset, lay.value_zero_offset, lay.value_groups,
           lay.slot_size)  # fmt: skip
    assert got == offsets and lay.slot_size_aligned == lay.slot_size
    assert make_codec(name, d).bytes_per_token_head == lay.slot_size
    assert lay.describe()["value_group"] == 32
    assert "value_group" not in tq.slot_layout("turboquant_4bit_nc", d).describe()
    with pytest.raises(TQExportError, match="groups of 32"):
        tq.check_head_size(tq.preset(name), 16)


@pytest.mark.parametrize(
    "name,d,offsets",
    [  # key codes, key norm, value offset, value codes, value norm, slot
        ("tqx_k4v3_mse", 64, (32, 32, 34, 24, 58, 60)),
        ("tqx_k4v3_mse", 128, (64, 64, 66, 48, 114, 116)),
        ("tqx_k4v2_mse", 64, (32, 32, 34, 16, 50, 52)),
        ("tqx_k4v2_mse", 128, (64, 64, 66, 32, 98, 100)),
        ("tqx_k3v2_mse", 64, (24, 24, 26, 16, 42, 44)),
        ("tqx_k3v2_mse", 128, (48, 48, 50, 32, 82, 84)),
    ],
)
def test_mse_value_layouts(name, d, offsets):
    lay = tq.slot_layout(name, d)
    got = (lay.key_code_bytes, lay.key_norm_offset, lay.value_offset, lay.value_code_bytes,
           lay.value_norm_offset, lay.slot_size)  # fmt: skip
    assert got == offsets and lay.slot_size_aligned == lay.slot_size
    assert (lay.value_scale_offset, lay.value_zero_offset) == (None, None)
    assert make_codec(name, d).bytes_per_token_head == lay.slot_size
    described = lay.describe()
    assert (described["value_quantizer"], described["value_norm_offset"]) == ("mse", offsets[4])
    assert "value_quantizer" not in tq.slot_layout("tqx_k4v4_g32", d).describe()
    assert tq.preset(name).vllm_twin is None
    with pytest.raises(TQExportError, match="power-of-two"):
        tq.check_head_size(tq.preset(name), 96)


def test_hadamard_is_symmetric_orthonormal_sylvester():
    h = tq.hadamard(8)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(8), atol=1e-6, rtol=0)
    assert torch.equal(h[0], torch.full((8,), 1 / math.sqrt(8)))
    assert h[1].tolist() == pytest.approx([(-1) ** i / math.sqrt(8) for i in range(8)])
    with pytest.raises(TQExportError, match="power-of-two"):
        tq.hadamard(96)


GAUSSIAN_LEVELS = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1519],
    4: [0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_vllm_codebook_is_gaussian_lloyd_max(bits, d):
    c = tq.centroids(d, bits).double() * math.sqrt(d)
    assert torch.equal(c, -c.flip(0))  # symmetric and sorted
    assert bool((c[1:] > c[:-1]).all())
    # vLLM's 200-point trapezoid rule puts the outer levels up to 7.5e-4 (relative) inside
    # the exact Gaussian Lloyd-Max levels (2.1503 vs 2.1519 at 3 bits); inner ones agree.
    assert c[2 ** (bits - 1) :].tolist() == pytest.approx(GAUSSIAN_LEVELS[bits], rel=1e-3)


def test_thresholds_are_fp32_midpoints_of_fp32_centroids():
    c = tq.centroids(128, 4)
    th = tq.thresholds(c)
    assert th.dtype == torch.float32
    assert torch.equal(th, (c[:-1] + c[1:]) / 2)


# Unit-vector MSE targets, exact Beta marginal, REFERENCE.md section 2.
BETA_MSE = {
    64: [0.3584, 0.1145, 0.0334, 0.0091],
    128: [0.3609, 0.1160, 0.0340, 0.0093],
    256: [0.3621, 0.1167, 0.0343, 0.0094],  # the same integral at Gemma 3's head size
}
LOWER_BOUND = [0.25, 0.0625, 0.0156, 0.0039]
PAPER_UPPER = [0.36, 0.117, 0.03, 0.009]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_key_quantizer_mse_on_random_unit_vectors(d):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(10_000, d, generator=g)
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    h = tq.hadamard(d)
    y = x @ h
    for bits in (1, 2, 3, 4):
        c = tq.centroids(d, bits)
        x_hat = c[tq.centroid_index(y, tq.thresholds(c))] @ h  # raw centroids, no NC
        mse = ((x - x_hat) ** 2).sum(-1).mean().item()
        assert mse == pytest.approx(BETA_MSE[d][bits - 1], rel=0.02), bits
        assert LOWER_BOUND[bits - 1] < mse < 4.0**-bits * math.sqrt(3) * math.pi / 2


@pytest.mark.parametrize("d", [64, 128, 256])
def test_exact_beta_codebook_reproduces_reference_mse(d):
    g = torch.Generator().manual_seed(99)
    x = torch.randn(10_000, d, generator=g)
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    h = tq.hadamard(d)
    for bits in (2, 4):
        c = tq.centroids(d, bits, "beta")
        x_hat = c[tq.centroid_index(x @ h, tq.thresholds(c))] @ h
        mse = ((x - x_hat) ** 2).sum(-1).mean().item()
        assert mse == pytest.approx(BETA_MSE[d][bits - 1], rel=0.015)


# ---------------------------------------------------------------------------------------------
# Golden bytes. Inputs are chosen so every expected byte follows from REFERENCE.md by hand:
# key = 3 * e0 rotates to y_j = +1/sqrt(D) (= +1 sigma) for every j, which lands on the
# 4-bit centroid +0.9423 sigma (index 11) and the 3-bit centroid +0.7560 sigma (index 5);
# its norm is 3.0 (fp16 0x4200). Values v_i = i (D=64): min 0, max 63.


def stream(codes, bits):
    acc = 0
    for i, c in enumerate(codes):
        acc |= c << (bits * i)
    return list(acc.to_bytes(math.ceil(len(codes) * bits / 8), "little"))


def fp16(x):
    return list(struct.pack("<e", x))


def value_codes(d, bits):
    # floor(i / ((D-1)/levels) + 1/2) computed exactly with integers (no ties occur here).
    levels = 2**bits - 1
    return [min((2 * i * levels + (d - 1)) // (2 * (d - 1)), levels) for i in range(d)]


def golden_inputs(d):
    k = torch.zeros(1, 1, d)
    k[..., 0] = 3.0
    v = torch.arange(d, dtype=torch.float32).reshape(1, 1, d)
    return k, v


@pytest.mark.parametrize(
    "name,key_code,kbits,vbits",
    [
        ("turboquant_4bit_nc", 11, 4, 4),
        ("turboquant_k3v4_nc", 5, 3, 4),
        ("turboquant_3bit_nc", 5, 3, 3),
    ],
)
def test_golden_slot_bytes_mse_presets(name, key_code, kbits, vbits):
    d = 64
    k, v = golden_inputs(d)
    slot = TurboQuantCodec(name, d).encode(k, v)["kv"][0, 0].tolist()
    levels = 2**vbits - 1
    expected = (
        stream([key_code] * d, kbits)
        + fp16(3.0)
        + stream(value_codes(d, vbits), vbits)
        + fp16((d - 1) / levels)
        + fp16(0.0)
    )
    assert slot == expected
    lay = tq.slot_layout(name, d)
    assert slot[lay.key_norm_offset : lay.key_norm_offset + 2] == [0x00, 0x42]
    assert slot[lay.value_zero_offset : lay.value_zero_offset + 2] == [0, 0]
    assert len(slot) == lay.slot_size_aligned == lay.slot_size


@pytest.mark.parametrize("name,vbits", [("tqx_k4v4_g32", 4), ("tqx_k4v3_g32", 3)])
def test_golden_slot_bytes_native_value_groups(name, vbits):
    """v_i = i in two groups of 32: each group has its own min (0, 32) and scale 31/levels,
    stored as (scale, zero) pairs in group order after the packed codes."""
    d = 64
    k, v = golden_inputs(d)
    slot = TurboQuantCodec(name, d).encode(k, v)["kv"][0, 0].tolist()
    levels = 2**vbits - 1
    codes = value_codes(32, vbits) * 2  # the same group-local codes in both groups
    expected = (
        stream([11] * d, 4) + fp16(3.0) + stream(codes, vbits)
        + fp16(31 / levels) + fp16(0.0) + fp16(31 / levels) + fp16(32.0)
    )  # fmt: skip
    assert slot == expected
    decoded = TurboQuantCodec(name, d).decode({"kv": torch.tensor([[slot]], dtype=torch.uint8)})
    step = 31 / levels
    assert (decoded[1] - v).abs().max() <= step / 2 + 1e-2  # fp16 scale rounding


@pytest.mark.parametrize(
    "name,kbits,key_code,vbits,value_code",
    [("tqx_k4v3_mse", 4, 11, 3, 5), ("tqx_k4v2_mse", 4, 11, 2, 3), ("tqx_k3v2_mse", 3, 5, 2, 3)],
)
def test_golden_slot_bytes_mse_values(name, kbits, key_code, vbits, value_code):
    """v = 2 * e0 rotates like the golden key to y_j = +1 sigma: the 3-bit centroid +0.7560
    sigma (index 5), the 2-bit one +1.5104 sigma (index 3; thresholds 0, +-0.9816 sigma); its
    norm 2.0 (fp16 0x4000) follows the packed codes. Norm-corrected, it decodes to 2 * e0."""
    d = 64
    k, _ = golden_inputs(d)
    v = torch.zeros(1, 1, d)
    v[..., 0] = 2.0
    codec = TurboQuantCodec(name, d)
    slot = codec.encode(k, v)["kv"][0, 0].tolist()
    expected = (
        stream([key_code] * d, kbits) + fp16(3.0) + stream([value_code] * d, vbits) + fp16(2.0)
    )
    assert slot == expected
    decoded = codec.decode({"kv": torch.tensor([[slot]], dtype=torch.uint8)})[1]
    torch.testing.assert_close(decoded, v, atol=1e-6, rtol=0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_mse_values_are_quantized_exactly_like_keys(d):
    """tqx_k4v3_mse values: the bytes and the decode of turboquant_3bit_nc keys for the same
    vectors (one codebook, one rotation, one norm correction)."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(40, 2, d, generator=g) * 3 + 0.5
    mse = TurboQuantCodec("tqx_k4v3_mse", d)
    keys3 = TurboQuantCodec("turboquant_3bit_nc", d)
    lay, klay = mse.layout, keys3.layout
    as_values = mse.encode(torch.ones_like(x), x)["kv"]
    as_keys = keys3.encode(x, torch.ones_like(x))["kv"]
    assert torch.equal(as_values[..., lay.value_offset : lay.slot_size],
                       as_keys[..., : klay.key_packed_bytes])  # fmt: skip
    assert torch.equal(mse.decode_values(as_values), keys3.decode_keys(as_keys))


def test_golden_slot_bytes_k8v4_with_padding_untouched():
    d = 66  # k8v4 takes any head size; 66 makes an odd slot (103) padded to 104
    k = torch.zeros(1, 1, d)
    k[0, 0, :8] = torch.tensor([1.0, -2.0, 0.5, 448.0, 1000.0, -1000.0, 2.0**-9, -0.0])
    v = torch.arange(d, dtype=torch.float32).reshape(1, 1, d)
    codec = TurboQuantCodec("turboquant_k8v4", d)
    lay = codec.layout
    assert (lay.slot_size, lay.slot_size_aligned) == (103, 104)
    buf = torch.full((1, 1, 104), 0xAA, dtype=torch.uint8)
    slot = codec.encode(k, v, out=buf)["kv"][0, 0].tolist()
    fp8_key = [0x38, 0xC0, 0x30, 0x7E, 0x7E, 0xFE, 0x01, 0x80] + [0] * (d - 8)
    expected = fp8_key + stream(value_codes(d, 4), 4) + fp16((d - 1) / 15) + fp16(0.0)
    assert slot[:103] == expected
    assert slot[103] == 0xAA  # padding never written
    assert codec.encode(k, v)["kv"][0, 0, 103].item() == 0  # fresh slots pad with zero


def test_ties_go_up_and_negative_side():
    d = 64
    codec = TurboQuantCodec("turboquant_4bit_nc", d)
    k = torch.zeros(2, d)
    k[0, 0] = k[0, 1] = 1.0  # rotates to exact zeros and +-sqrt(2) sigma
    k[1, 0] = -3.0  # every coordinate -1 sigma
    idx, norm = codec.key_codes(k)
    h = tq.hadamard(d)
    zero = h[0] == -h[1]
    assert bool(zero.any()) and bool((idx[0][zero] == 8).all())  # y == 0 == a threshold -> up
    assert bool((idx[1] == 4).all())  # -0.9423 sigma is the 4th negative centroid
    assert norm.tolist() == pytest.approx([math.sqrt(2), 3.0])


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_scores_equal_dot_with_reconstructed_keys(name, d):
    g = torch.Generator().manual_seed(7)
    codec = TurboQuantCodec(name, d)
    k = torch.randn(2, 9, d, generator=g)
    v = torch.randn(2, 9, d, generator=g)
    slots = codec.encode(k, v)["kv"]
    q = torch.randn(2, 3, d, generator=g)
    scale = d**-0.5
    got = codec.scores(q, slots, scale)
    ref = q @ codec.decode_keys(slots).transpose(-1, -2) * scale
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert got.shape == (2, 3, 9)


def test_norm_correction_reconstructs_unit_centroid_vectors():
    d = 128
    codec = TurboQuantCodec("turboquant_4bit_nc", d)
    k = torch.randn(50, d)
    keys = codec.decode_keys(codec.encode(k, k)["kv"])
    norms = torch.linalg.vector_norm(keys, dim=-1)
    stored = torch.linalg.vector_norm(k, dim=-1).half().float()
    torch.testing.assert_close(norms, stored, atol=1e-4, rtol=1e-4)


def test_value_dequant_formula():
    d = 64
    codec = TurboQuantCodec("turboquant_4bit_nc", d)
    v = torch.randn(100, d) * 3 + 1
    slots = codec.encode(torch.randn(100, d), v)["kv"]
    v_hat = codec.decode_values(slots)
    scale = ((v.amax(-1) - v.amin(-1)) / 15).half().float()
    # code*fp16(scale) + fp16(min): error within half a step plus fp16 rounding of min/scale.
    bound = scale * 0.5 + v.abs().amax(-1) * 2e-3 + scale * 15 * 1e-3
    assert bool(((v_hat - v).abs() <= bound.unsqueeze(-1)).all())


@pytest.mark.parametrize("name", PRESET_NAMES[1:])
def test_mse_presets_reject_non_power_of_two_heads(name):
    with pytest.raises(TQExportError, match="turboquant_k8v4"):
        make_codec(name, 96)
    make_codec("turboquant_k8v4", 96)


# ---------------------------------------------------------------------------------------------
# NaN and inf: vLLM's store rules (checked against vLLM 0.33.0's kernel by `make vllm-parity`).
# A NaN key coordinate or norm sends every rotated coordinate to NaN, which passes no threshold
# of vLLM's binary search (code 0); +-inf keys make the norm inf and the rotated key NaN.
# Value min/max skip NaN elements; a NaN scale is stored as 1e-8 (fp16 0), a NaN code as 0.
# fp16 fields store NaN as 0x7E00; fp8 keys store NaN as 0x7F and saturate +-inf to +-448.
NAN, INF = float("nan"), float("inf")
FP16_NAN, FP16_INF, FP16_NEG_INF = [0x00, 0x7E], [0x00, 0x7C], [0x00, 0xFC]


def one_slot(name, k, v):
    d = len(k)
    kt, vt = torch.tensor(k).reshape(1, 1, d), torch.tensor(v).reshape(1, 1, d)
    return TurboQuantCodec(name, d).encode(kt, vt)["kv"][0, 0].tolist()


@pytest.mark.parametrize(
    "k,v,expected",
    [
        (  # NaN key coordinate: codes 0, norm NaN; a NaN value is skipped by min/max, code 0
            [NAN, 1.0, 0, 0, 0, 0, 0, 0],
            [0.0, 15.0, 3.0, 7.0, NAN, 1.0, 2.0, 4.0],
            [0] * 4 + FP16_NAN + stream([0, 15, 3, 7, 0, 1, 2, 4], 4) + fp16(1.0) + fp16(0.0),
        ),
        (  # +inf key: norm inf, codes 0; all-NaN values: scale 1e-8 (fp16 0), zero NaN
            [INF, 1.0, 0, 0, 0, 0, 0, 0],
            [NAN] * 8,
            [0] * 4 + FP16_INF + [0] * 4 + fp16(0.0) + FP16_NAN,
        ),
        (  # -inf key; values +inf and -inf: scale inf, zero -inf, every code (NaN) 0
            [-INF, 0, 0, 0, 0, 0, 0, 2.0],
            [INF, -INF, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            [0] * 4 + FP16_INF + [0] * 4 + FP16_INF + FP16_NEG_INF,
        ),
        (  # a +inf value: min 0, scale inf; finite codes round 0.5 down to 0, inf's is NaN: 0
            [0, 0, 0, 0, 0, 0, 0, 0],
            [INF, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            # zero key: rotated zeros reach threshold 0 (index 8), norm 0
            stream([8] * 8, 4) + fp16(0.0) + [0] * 4 + FP16_INF + fp16(0.0),
        ),
    ],
)
def test_nan_and_inf_slot_bytes_4bit(k, v, expected):
    slot = one_slot("turboquant_4bit_nc", k, v)
    assert slot == expected


def test_nan_and_inf_slot_bytes_3bit():
    k = [1.0, 2.0, NAN, 0, 0, 0, 0, 0]
    v = [0.0, 7.0, NAN, 3.0, 1.0, 2.0, 5.0, 6.0]  # min 0, max 7: scale 1
    expected = [0] * 3 + FP16_NAN + stream([0, 7, 0, 3, 1, 2, 5, 6], 3) + fp16(1.0) + fp16(0.0)
    assert one_slot("turboquant_3bit_nc", k, v) == expected


def test_nan_and_inf_fp8_keys():
    k = [NAN, INF, -INF, 1.0, -NAN, 500.0, -0.0, 2.0**-9]
    expected_key = [0x7F, 0x7E, 0xFE, 0x38, 0x7F, 0x7E, 0x80, 0x01]
    assert one_slot("turboquant_k8v4", k, [NAN] * 8) == expected_key + [0] * 4 + [0, 0] + FP16_NAN


def test_nan_value_group_of_a_native_preset():
    """Each group has its own NaN rule: an all-NaN group beside a finite one."""
    d = 64
    k, _ = golden_inputs(d)
    v = torch.cat([torch.full((32,), NAN), torch.arange(32, 64, dtype=torch.float32)])
    slot = TurboQuantCodec("tqx_k4v4_g32", d).encode(k, v.reshape(1, 1, d))["kv"][0, 0].tolist()
    expected = (
        stream([11] * d, 4) + fp16(3.0) + stream([0] * 32 + value_codes(32, 4), 4)
        + fp16(0.0) + FP16_NAN + fp16(31 / 15) + fp16(32.0)
    )  # fmt: skip
    assert slot == expected


def test_centroid_index_of_nan_is_zero_and_inf_is_an_end():
    th = tq.thresholds(tq.centroids(64, 4))
    idx = tq.centroid_index(torch.tensor([NAN, INF, -INF, 0.0]), th)
    assert idx.tolist() == [0, 15, 0, 8]


@pytest.mark.parametrize("twin,vllm", [("tqx_k4v4", "turboquant_4bit_nc"),
                                       ("tqx_k3v3", "turboquant_3bit_nc")])  # fmt: skip
def test_native_twins_store_their_vllm_layout_byte_for_byte(twin, vllm):
    """A twin is the vLLM layout under a native name (so its keys may be transformed): same
    slot offsets, same bytes for the same K/V, same decode; the per-dtype matrices skip twins."""
    from tqexport.kvquant.codecs import codec_for

    assert tq.vllm_twin(twin) == vllm and tq.vllm_twin(vllm) is None
    assert tq.vllm_twin("tqx_k4v4_g32") is None
    for d in (64, 128):
        a, b = tq.slot_layout(twin, d), tq.slot_layout(vllm, d)
        fields = ("key_code_bytes", "key_norm_offset", "value_offset", "value_code_bytes",
                  "value_scale_offset", "value_zero_offset", "slot_size")  # fmt: skip
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        g = torch.Generator().manual_seed(d)
        k, v = torch.randn(9, 2, d, generator=g), torch.randn(9, 2, d, generator=g)
        ours, theirs = (
            codec_for(twin, d, "float32", 1.0, 1.0),
            codec_for(vllm, d, "float32", 1.0, 1.0),
        )
        enc, ref = ours.encode(k, v), theirs.encode(k, v)
        assert enc.keys() == ref.keys()
        assert all(torch.equal(enc[n], ref[n]) for n in enc)
        assert torch.equal(ours.decode_keys(enc["kv"]), theirs.decode_keys(ref["kv"]))
