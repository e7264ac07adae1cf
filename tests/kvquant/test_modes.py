import pytest

from tqexport.errors import TQExportError
from tqexport.kvquant.modes import (
    KV_CACHE_DTYPES,
    KVDtypeError,
    KVQuantMode,
    parse_kv_cache_dtype,
    quant_mode_of,
)

VLLM_NAMES = [
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head",
    "fp8_per_token_head", "int4_per_token_head", "nvfp4", "turboquant_k8v4",
    "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
]  # fmt: skip


NATIVE_NAMES = [
    "tqx_k4v4_g32",
    "tqx_k4v3_g32",
    "tqx_k4v4",
    "tqx_k3v3",
    "tqx_k4v3_mse",
    "tqx_k4v2_mse",
    "tqx_k3v2_mse",
]


def test_registry_holds_the_vllm_names_then_the_native_ones():
    assert list(KV_CACHE_DTYPES) == VLLM_NAMES + NATIVE_NAMES
    assert not set(NATIVE_NAMES) & set(VLLM_NAMES)
    assert all(quant_mode_of(n) is KVQuantMode.TURBOQUANT for n in NATIVE_NAMES)


@pytest.mark.parametrize("name", VLLM_NAMES)
def test_mode_follows_vllm_naming_rule(name):
    exact = {
        "int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
        "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,
        "int4_per_token_head": KVQuantMode.INT4_PER_TOKEN_HEAD,
        "nvfp4": KVQuantMode.NVFP4,
    }
    if name in exact:
        expected = exact[name]
    elif name.startswith("turboquant_"):
        expected = KVQuantMode.TURBOQUANT
    elif name.startswith("fp8"):
        expected = KVQuantMode.FP8_PER_TENSOR
    else:
        expected = KVQuantMode.NONE
    assert quant_mode_of(name) is expected


def test_modes_serialize_by_name():
    for mode in KVQuantMode:
        assert mode.value == mode.name
        assert KVQuantMode.from_name(mode.name) is mode
    with pytest.raises(KVDtypeError, match="valid modes"):
        KVQuantMode.from_name("3")


def test_mode_predicates():
    assert [m.name for m in KVQuantMode if m.is_per_token_head] == [
        "INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "INT4_PER_TOKEN_HEAD",
    ]  # fmt: skip
    assert [m.name for m in KVQuantMode if not m.is_quantized] == ["NONE"]
    assert [m.name for m in KVQuantMode if m.is_turboquant] == ["TURBOQUANT"]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KVDtypeError) as e:
        parse_kv_cache_dtype("fp9")
    msg = str(e.value)
    assert "'fp9'" in msg
    for name in VLLM_NAMES:
        assert name in msg
    assert isinstance(e.value, TQExportError)


@pytest.mark.parametrize(
    "name,why",
    [
        ("fp8_inc", "Gaudi"),
        ("fp8_ds_mla", "MLA"),
        ("nvfp4_ds_mla", "MLA"),
        ("nvfp4_4over6", "Blackwell"),
    ],
)
def test_hardware_specific_vllm_names_are_refused_with_reason(name, why):
    with pytest.raises(KVDtypeError) as e:
        parse_kv_cache_dtype(name)
    assert "not supported" in str(e.value) and why in str(e.value)
    assert "turboquant_4bit_nc" in str(e.value)


def test_native_names_are_exactly_the_tqx_presets():
    from tqexport.kvquant.modes import KV_CACHE_DTYPES

    native = {n for n, e in KV_CACHE_DTYPES.items() if e.native}
    assert native == set(NATIVE_NAMES)
