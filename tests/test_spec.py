import json

import pytest
import torch
from helpers import describe, gemma_like
from hypothesis import given, settings
from hypothesis import strategies as st

from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import make_codec
from tqexport.kvquant.modes import KVQuantMode, kv_cache_dtype_names
from tqexport.resolve import resolve
from tqexport.spec import (
    SCHEMA_VERSION,
    FullAttentionSpec,
    ModelSpec,
    SlidingWindowSpec,
    SpecError,
    cache_spec,
)

TQ = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
SLOT_TABLE = {64: [100, 70, 62, 54], 128: [196, 134, 118, 102], 256: [388, 262, 230, 198]}


@pytest.mark.parametrize("d", [64, 128, 256])
def test_turboquant_page_sizes(d):
    for name, slot in zip(TQ, SLOT_TABLE[d], strict=True):
        s = FullAttentionSpec(
            kv_cache_dtype=name, num_kv_heads=8, head_size=d, block_size=16, model_dtype="bfloat16"
        )
        assert s.mode is KVQuantMode.TURBOQUANT
        assert s.turboquant.slot_size_aligned == slot
        assert s.page_size_bytes == 16 * 8 * slot
        assert s.tensor_shapes(10) == {"kv": (10, 16, 8, slot)}
        assert s.storage_dtype == "uint8"


def test_cache_tensor_shapes_per_mode():
    kw = dict(num_kv_heads=2, head_size=64, block_size=16, model_dtype="float16")
    assert cache_spec(None, kv_cache_dtype="auto", **kw).tensor_shapes(3) == {
        "k": (3, 16, 2, 64),
        "v": (3, 16, 2, 64),
    }
    assert cache_spec(None, kv_cache_dtype="auto", **kw).storage_dtype == "float16"
    assert cache_spec(None, kv_cache_dtype="bfloat16", **kw).storage_dtype == "bfloat16"
    fp8 = cache_spec(None, kv_cache_dtype="fp8", **kw)
    assert fp8.storage_dtype == "uint8" and fp8.page_size_bytes == 2 * 16 * 2 * 64
    pth = cache_spec(4, kv_cache_dtype="int8_per_token_head", **kw)
    assert pth.tensor_shapes(3) == {
        "k": (3, 16, 2, 64),
        "v": (3, 16, 2, 64),
        "k_scale": (3, 16, 2),
        "v_scale": (3, 16, 2),
    }
    assert pth.page_size_bytes == 2 * 16 * 2 * 64 + 2 * 16 * 2 * 4
    assert isinstance(pth, SlidingWindowSpec) and pth.window == 4
    nv = cache_spec(None, kv_cache_dtype="nvfp4", **kw)
    assert nv.tensor_shapes(1)["k"] == (1, 16, 2, 32 + 4)


def test_turboquant_spec_always_has_its_mode():
    """vLLM seed bug 1: a TurboQuant cache spec built without its quant mode (shaped as
    unquantized). Here the mode is derived from the dtype, and a spec file claiming otherwise
    is refused."""
    spec = resolve(describe([None] * 4), "turboquant_4bit_nc", boundary=False).spec
    data = spec.to_dict()
    assert {la["quant_mode"] for la in data["layers"]} == {"TURBOQUANT"}
    bad = json.loads(json.dumps(data))
    bad["layers"][1]["kv_cache_dtype"] = "auto"
    with pytest.raises(SpecError, match="inconsistent"):
        ModelSpec.from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["layers"][2]["quant_mode"] = "NONE"
    with pytest.raises(SpecError, match="'quant_mode'"):
        ModelSpec.from_dict(bad)


def test_unknown_schema_version_is_refused():
    data = resolve(describe([None] * 2), "fp8").spec.to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(SpecError, match=f"schema version {SCHEMA_VERSION + 1}"):
        ModelSpec.from_dict(data)
    del data["schema_version"]
    with pytest.raises(SpecError, match="schema version None"):
        ModelSpec.from_dict(data)
    with pytest.raises(SpecError, match="not valid JSON"):
        ModelSpec.from_json("{nope")


def test_spec_json_fields():
    spec = resolve(gemma_like(), "turboquant_k3v4_nc", ["sw"], boundary=False).spec
    d = json.loads(spec.to_json())
    assert d["schema_version"] == SCHEMA_VERSION
    assert [g["window"] for g in d["groups"]] == [None, 8]
    layer1 = d["layers"][1]
    assert layer1["tensors"] == [
        {
            "role": "kv",
            "dtype": "uint8",
            "shape": ["num_blocks", 16, 2, 62],
            "input": "cache.1.kv",
            "output": "cache_out.1.kv",
        }
    ]
    c = layer1["constants"]
    assert (c["preset"], c["layout_version"], c["slot_size_aligned"]) == (
        "turboquant_k3v4_nc",
        1,
        62,
    )
    assert "pure Hadamard" in c["layout"] and "fp16 norm" in c["layout"]
    assert (
        d["layers"][0]["quant_mode"] == "NONE"
        and d["layers"][0]["skipped_by"] == "--skip-layers sw"
    )


_HEADS = st.sampled_from([64, 128, 80])


@st.composite
def model_specs(draw):
    n = draw(st.integers(1, 8))
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 4096)), min_size=n, max_size=n))
    head = draw(_HEADS)
    names = [x for x in kv_cache_dtype_names() if _stores(x, head)]
    dtype = draw(st.sampled_from(names))
    skips = draw(
        st.lists(st.sampled_from(["0", "-1", "sw", "full", f"0-{n - 1}", "boundary:1"]), max_size=2)
    )
    scales = {
        i: (draw(st.floats(1e-3, 1e3)), draw(st.floats(1e-3, 1e3)))
        for i in range(n)
        if draw(st.booleans())
    }
    desc = describe(
        windows,
        head_size=head,
        kv_heads=draw(st.integers(1, 8)),
        dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
    )
    return resolve(
        desc,
        dtype,
        skips,
        boundary=draw(st.booleans()),
        block_size=draw(st.sampled_from([1, 16, 32])),
        kv_scales=scales,
        recent_window=draw(st.sampled_from([0, 0, 8, 32])),
    ).spec


def _stores(name: str, head: int) -> bool:
    """Whether this kv dtype can store heads of this size (e.g. Hadamard needs a power of 2)."""
    try:
        make_codec(name, head)
    except TQExportError:
        return False
    return True


@settings(max_examples=80, deadline=None)
@given(model_specs())
def test_spec_json_round_trip(spec):
    text = spec.to_json()
    back = ModelSpec.from_json(text)
    assert back == spec
    assert back.to_json() == text
    for a, b in zip(spec.layers, back.layers, strict=True):
        assert a.cache.page_size_bytes == b.cache.page_size_bytes
        assert a.cache.tensor_shapes(2) == b.cache.tensor_shapes(2)


def test_cache_tensors_allocate_with_spec_dtypes():
    spec = resolve(gemma_like(), "int4_per_token_head").spec
    for layer in spec.layers:
        for t in layer.cache.tensors:
            shape = layer.cache.tensor_shapes(4)[t.role]
            tensor = torch.empty(shape, dtype=getattr(torch, t.dtype))
            assert tensor.numel() * tensor.element_size() == 4 * 16 * 2 * t.bytes_per_token_head
