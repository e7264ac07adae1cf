import json

import pytest
import torch
from helpers import describe, gemma_like
from hypothesis import given, settings
from hypothesis import strategies as st

from tqexport.errors import TQExportError
from tqexport.kvplan.resolve import resolve
from tqexport.kvquant.codecs import make_codec
from tqexport.kvquant.modes import KVQuantMode, kv_cache_dtype_names, quant_mode_of
from tqexport.spec import (
    SCHEMA_VERSION,
    BuildRequest,
    FullAttentionSpec,
    ModelSpec,
    SlidingWindowSpec,
    SpecError,
    cache_spec,
    spec_from_dict,
    spec_from_json,
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
    spec = resolve(describe([None] * 4), BuildRequest("turboquant_4bit_nc", boundary=False)).spec
    data = spec.to_dict()
    assert {la["quant_mode"] for la in data["layers"]} == {"TURBOQUANT"}
    bad = json.loads(json.dumps(data))
    bad["layers"][1]["kv_cache_dtype"] = "auto"
    with pytest.raises(SpecError, match="inconsistent"):
        spec_from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["layers"][2]["quant_mode"] = "NONE"
    with pytest.raises(SpecError, match="'quant_mode'"):
        spec_from_dict(bad)


def test_unknown_schema_version_is_refused():
    data = resolve(describe([None] * 2), BuildRequest("fp8")).spec.to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(SpecError, match=f"schema version {SCHEMA_VERSION + 1}"):
        spec_from_dict(data)
    del data["schema_version"]
    with pytest.raises(SpecError, match="schema version None"):
        spec_from_dict(data)
    with pytest.raises(SpecError, match="not valid JSON"):
        spec_from_json("{nope")


def test_spec_json_fields():
    spec = resolve(gemma_like(), BuildRequest("turboquant_k3v4_nc", ["sw"], boundary=False)).spec
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
    # a recent window only for a quantized dtype (resolve refuses one that has no effect)
    recent = draw(st.sampled_from([0, 0, 8, 32])) if quant_mode_of(dtype).is_quantized else 0
    return resolve(
        desc,
        BuildRequest(
            dtype,
            skips,
            boundary=draw(st.booleans()),
            block_size=draw(st.sampled_from([1, 16, 32])),
            recent_window=recent,
            sink_tokens=draw(st.sampled_from([0, 4])) if recent else 0,
        ),
        kv_scales=scales,
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
    back = spec_from_json(text)
    assert back == spec
    assert back.to_json() == text
    for a, b in zip(spec.layers, back.layers, strict=True):
        assert a.cache.page_size_bytes == b.cache.page_size_bytes
        assert a.cache.tensor_shapes(2) == b.cache.tensor_shapes(2)


def test_cache_tensors_allocate_with_spec_dtypes():
    spec = resolve(gemma_like(), BuildRequest("int4_per_token_head")).spec
    for layer in spec.layers:
        for t in layer.cache.tensors:
            shape = layer.cache.tensor_shapes(4)[t.role]
            tensor = torch.empty(shape, dtype=getattr(torch, t.dtype))
            assert tensor.numel() * tensor.element_size() == 4 * 16 * 2 * t.bytes_per_token_head


# -- loading is total: every stored field checked, every derived one re-derived ---------------


def _artifact_like(kv="fp8", windows=(None, 8, None, 8), **kw):
    """A spec dict as a build writes it (path, kv_scales, opset, io) without building one."""
    spec = resolve(describe(list(windows)), BuildRequest(kv, boundary=False, **kw)).spec
    spec = ModelSpec(
        model={**spec.model, "path": "tiny"},
        dtype=spec.dtype,
        block_size=spec.block_size,
        layers=spec.layers,
        groups=spec.groups,
        request=spec.request,
        io=spec.graph_io(),
    )
    return json.loads(spec.to_json())


def _set(path, value):
    def edit(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        d[last] = value

    return edit


def _delete(path):
    def edit(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        del d[last]

    return edit


BAD_FIELDS = [
    # the top-level block size must be the layers' (it sizes every block table)
    (
        _set(["block_size"], 32),
        "layer 0: cache block_size 16 differs from the spec's block_size 32",
    ),
    (_set(["block_size"], 0), r"'block_size' must be an integer in 1\.\.256, got 0"),
    (_set(["block_size"], 24), "power of two"),
    (_set(["groups", 1, "block_size"], 32), "group 1: block_size 32 differs"),
    # types: null, bool, float, string, list, object where an int is expected
    (
        _set(["layers", 1, "num_kv_heads"], None),
        r"^layer 1: field 'num_kv_heads' must be an integer in 1\.\.1024, got null; rebuild",
    ),
    (_set(["layers", 1, "num_kv_heads"], True), "'num_kv_heads' must be an integer .* got true"),
    (_set(["layers", 1, "num_kv_heads"], 2.0), "'num_kv_heads' must be an integer .* got 2.0"),
    (_set(["layers", 1, "num_kv_heads"], "2"), "'num_kv_heads' must be an integer .* got \"2\""),
    (_set(["layers", 1, "num_kv_heads"], [2]), "'num_kv_heads' .* got a list of 1 item;"),
    (_set(["layers", 1, "num_kv_heads"], {}), "'num_kv_heads' .* got an object of 0 items"),
    (_set(["layers", 1, "num_kv_heads"], 4096), r"'num_kv_heads' must be an integer in 1\.\.1024"),
    (_set(["layers", 0, "head_size"], 65536), r"'head_size' must be an integer in 1\.\.1024"),
    (_set(["layers", 0, "head_size"], 0), r"'head_size' must be an integer in 1\.\.1024"),
    (_set(["layers", 1, "window"], 0), r"layer 1: field 'window' must be an integer in 1\.\.\d+"),
    (_set(["layers", 1, "window"], 2**40), "'window' must be an integer"),
    # scale, softcap, constants
    (_set(["layers", 2, "scale"], float("nan")), "'scale' must be a finite positive number"),
    (_set(["layers", 2, "scale"], 0), "'scale' must be a finite positive number, got 0"),
    (_set(["layers", 2, "scale"], -0.125), "'scale' must be a finite positive number"),
    (_set(["layers", 2, "scale"], "0.125"), "'scale' must be a finite positive number"),
    (_set(["layers", 2, "softcap"], 0.0), "'softcap' must be a finite positive number or null"),
    (_set(["layers", 2, "softcap"], float("inf")), "'softcap' must be a finite positive"),
    (_set(["layers", 0, "constants"], []), "layer 0: field 'constants' must be a JSON object"),
    (_set(["layers", 0, "constants", "k_scale"], -1.0), "layer 0 constants: field 'k_scale'"),
    (_set(["layers", 0, "constants", "k_scale"], None), "layer 0 constants: field 'k_scale'"),
    (_set(["layers", 0, "constants", "min_scale"], 1.0), "'constants' is .* means"),
    # skipped_by, module, index, dtypes
    (_set(["layers", 0, "skipped_by"], "because"), "field 'skipped_by' must be null"),
    (_set(["layers", 0, "skipped_by"], "--skip-layers 3-x"), "field 'skipped_by' must be null"),
    (_set(["layers", 0, "skipped_by"], "turboquant boundary"), "'skipped_by' says the layer is"),
    (_set(["layers", 0, "module"], 5), "field 'module' must be a non-empty string"),
    (_set(["layers", 0, "module"], "a\x1b[2Jb"), "field 'module' must be text without control"),
    (_set(["layers", 0, "module"], "\ud800"), "field 'module' must be text without control"),
    (_set(["layers", 1, "index"], 0), "layer 1: field 'index' must be 1"),
    (_set(["layers", 1, "index"], 99), "layer 1: field 'index' must be 1"),
    (_set(["layers", 1, "model_dtype"], "float16"), "layer 1: model_dtype float16 differs"),
    (_set(["layers", 1, "model_dtype"], "int8"), "'model_dtype' must be one of float32, float16"),
    (_set(["layers", 1, "kv_cache_dtype"], "fp9"), "layer 1: unknown kv-cache dtype 'fp9'"),
    (_set(["layers", 1, "kv_cache_dtype"], "auto"), "inconsistent"),
    (_set(["dtype"], "float64"), "field 'dtype' must be one of float32, float16, bfloat16"),
    # groups name existing layers, in id order, each layer in exactly one of its kind
    (_set(["groups", 0, "layers"], [0, 2, 7]), "must list layer indices|names layer 7"),
    (_set(["groups", 0, "layers"], [2, 0]), "must list layer indices in increasing order"),
    (_set(["groups", 0, "layers"], [0, 1, 2]), r"group 0 lists layers \[0, 1, 2\] but the"),
    (_set(["groups", 1, "id"], 0), "group 1: field 'id' must be 1"),
    (_set(["groups", 0, "window"], 8), "is not in a cache group with its window"),
    (_set(["groups", 0, "recent"], "yes"), "field 'recent' must be true or false"),
    (_set(["groups"], []), r"field 'groups' must be a list of 1\.\.2048 items"),
    # io must be the graph I/O the spec gives
    (_set(["io", "inputs", 0, "name"], "ids"), "field 'io' does not match .*inputs item 0"),
    (_set(["io", "outputs"], []), "field 'io' does not match .*outputs item 0"),
    (_set(["io"], []), "field 'io' must be a JSON object"),
    # model identity: what the CLI prints and the backends read back
    (_set(["model", "vocab_size"], "big"), r"model: field 'vocab_size' must be an integer in 0"),
    (_set(["model", "vocab_size"], 2**30), r"model: field 'vocab_size' must be an integer in 0"),
    (_set(["model", "name"], None), "model: field 'name' must be a non-empty string"),
    (_set(["model", "path"], 5), "model: field 'path' must be a non-empty string"),
    (_set(["model", "num_layers"], 5), "model: field 'num_layers' is 5 but the spec lists 4"),
    (_set(["model", "num_heads"], 3), "2 kv heads do not divide the model's 3 query heads"),
    (_set(["model", "config_digest"], "md5:x"), "model: field 'config_digest' must be"),
    (_set(["model", "max_position_embeddings"], 0), r"'max_position_embeddings' .*\.\d+, got 0;"),
    (_set(["model", "max_position_embeddings"], 2**41), r"'max_position_embeddings' .* got 2\d+;"),
    (_set(["model"], "tiny"), "field 'model' must be a JSON object"),
    # request (provenance, read back by bench) and version
    (_set(["request", "kv_cache_dtype"], "fp9"), "request: unknown kv-cache dtype 'fp9'"),
    (_set(["request", "kv_cache_dtype"], "int8_per_token_head"), "do not fit the requested"),
    (_set(["request", "boundary"], "yes"), "request: field 'boundary' must be true or false"),
    (_set(["request", "opset"], 0), r"request: field 'opset' must be an integer in 1\.\.99"),
    (_set(["request", "kv_scales"], "big"), "request: field 'kv_scales' must be"),
    (_set(["request", "skip_layers"], ["3-x"]), "request: field 'skip_layers': .*malformed"),
    (_set(["request", "recent_window"], 8), "recent window 0 but the request"),
    (_set(["tqexport_version"], 1), "field 'tqexport_version' must be a non-empty string"),
    # unknown keys are refused (a typo must not be ignored), missing ones named
    (_set(["blocksize"], 16), "spec: unknown field 'blocksize'"),
    (_set(["layers", 0, "num_kv_head"], 2), "layer 0: unknown field 'num_kv_head'"),
    (_set(["model", "vocab"], 1), "model: unknown field 'vocab'"),
    (_set(["request", "kv_cache_dtpye"], "fp8"), "request: unknown field 'kv_cache_dtpye'"),
    (_set(["groups", 0, "recnet"], True), "group 0: unknown field 'recnet'"),
    (_delete(["layers", 0, "tensors"]), "layer 0: missing field 'tensors'"),
    (_delete(["io"]), "spec: missing field 'io'"),
    (_delete(["model", "num_heads"]), "model: missing field 'num_heads'"),
    (_set(["layers"], [None]), "layer 0 must be a JSON object, got null"),
]


@pytest.mark.parametrize("edit,message", BAD_FIELDS)
def test_loader_checks_every_field(edit, message):
    data = _artifact_like()
    assert spec_from_dict(json.loads(json.dumps(data))).to_dict() == data
    edit(data)
    with pytest.raises(SpecError, match=message) as e:
        spec_from_dict(data)
    assert len(str(e.value).splitlines()) == 1


BAD_RECENT = [
    (_set(["layers", 1, "recent", "window"], 0), r"layer 1 recent: field 'window' must be"),
    (_set(["layers", 1, "recent", "window"], 16), "recent window 16 exceeds the layer's sliding"),
    (_set(["layers", 1, "recent", "group"], 99), "not in a recent-window group"),
    (_set(["layers", 1, "recent", "extra"], 1), "layer 1 recent: unknown field 'extra'"),
    (_delete(["layers", 1, "recent"]), "layer 1: field 'tensors' .* inconsistent"),
    (_set(["groups", 2, "window"], None), r"group 2: field 'window' must be an integer in 1\.\."),
    (_set(["request", "recent_window"], 4), "layer 0: recent window 32 but the request"),
]


@pytest.mark.parametrize("edit,message", BAD_RECENT)
def test_loader_checks_recent_windows(edit, message):
    data = _artifact_like("turboquant_4bit_nc", (None, 8, None, 8), recent_window=32)
    assert [g.get("recent", False) for g in data["groups"]] == [False, False, True, True]
    edit(data)
    with pytest.raises(SpecError, match=message) as e:
        spec_from_dict(data)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(
    "raw,message",
    [
        (b'{"schema_version": 1, "x": NaN}', "NaN is not a JSON number"),
        (b'{"schema_version": 1, "x": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"schema_version": 1, "x": 1e999}', "number 1e999 is out of range"),
        (b'{"schema_version": 1, "x": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"),
        (b'{"schema_version": 1, "x": "\xff"}', "not UTF-8 text .*0xff at offset 28"),
        (b"\xef\xbb\xbf{}", "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        (b'{"schema_version": 1, "schema_version": 1}', "key 'schema_version' twice"),
        (b" " * (17 << 20), "larger than 16 MiB"),
        (b"[]", "spec must be a JSON object, got a list of 0 items"),
        (b'{"schema_version": true}', "schema version true is not supported"),
        (b"", "not valid JSON"),
    ],
)
def test_spec_text_is_parsed_strictly(raw, message):
    with pytest.raises(SpecError, match=message) as e:
        spec_from_json(raw)
    assert len(str(e.value).splitlines()) == 1


def test_deeply_nested_values_are_refused_not_recursed():
    data = _artifact_like()
    deep = []
    for _ in range(100000):  # built in Python: deeper than any JSON parser would allow
        deep = [deep]
    data["layers"][0]["tensors"] = deep
    with pytest.raises(SpecError, match="'tensors' is a list of 1 item but"):
        spec_from_dict(data)


def test_head_size_bound_is_checked_before_any_table_is_built():
    from tqexport.kvquant.codecs import MAX_HEAD_SIZE

    for name in ("turboquant_4bit_nc", "auto", "fp8", "nvfp4"):
        for bad in (MAX_HEAD_SIZE * 2, 65536, 2**40, 0, -64, True, 64.0, "64"):
            with pytest.raises(TQExportError, match="head size must be an integer from 1 to"):
                make_codec(name, bad)
    assert make_codec("turboquant_4bit_nc", MAX_HEAD_SIZE).head_size == MAX_HEAD_SIZE
    with pytest.raises(SpecError, match=r"head_size must be an integer in 1\.\.1024"):
        FullAttentionSpec(
            kv_cache_dtype="auto", num_kv_heads=1, head_size=65536, block_size=16,
            model_dtype="float32",
        )  # fmt: skip


def test_layers_with_the_same_cache_share_one_codec():
    """A TurboQuant codec holds a D x D rotation: 1024 identical layers must not hold 1024."""
    spec = resolve(
        describe([None] * 6, head_size=128), BuildRequest("turboquant_4bit_nc", boundary=False)
    ).spec
    assert len({id(la.cache.codec) for la in spec.layers}) == 1


def test_build_time_bounds_match_the_loader():
    """resolve refuses what the loader would refuse, so a build never writes an unloadable
    spec (kv heads, windows: each bound lives once, in tqexport.spec / the codecs)."""
    with pytest.raises(TQExportError, match=r"num_kv_heads must be an integer in 1\.\.1024"):
        resolve(describe([None], kv_heads=2048), BuildRequest("fp8"))
    with pytest.raises(TQExportError, match=r"sliding_window must be an integer in 1\.\."):
        resolve(describe([2**30]), BuildRequest("fp8"))
