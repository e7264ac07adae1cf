import pytest
from helpers import dense, describe, gemma_like

from tqexport.kvplan.resolve import ResolveError, parse_skip_patterns, resolve, turboquant_boundary
from tqexport.kvquant.modes import KVQuantMode, kv_cache_dtype_names
from tqexport.spec import BuildRequest

TQ = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def dtypes_of(spec):
    return [la.kv_cache_dtype for la in spec.layers]


def quantized(spec):
    return [la.index for la in spec.layers if la.mode.is_quantized]


def test_gemma_style_skip_sw_keeps_sliding_layers_unquantized():
    spec = resolve(gemma_like(6), BuildRequest("fp8", ["sw"])).spec
    assert dtypes_of(spec) == ["auto", "fp8"] * 3
    assert [g.window for g in spec.groups] == [None, 8]
    assert spec.groups[0].layers == (1, 3, 5) and spec.groups[1].layers == (0, 2, 4)
    assert [la.group for la in spec.layers] == [1, 0] * 3
    for la in spec.layers:
        assert la.attention_type.value == ("sliding_window" if la.index % 2 == 0 else "full")
        if la.index % 2 == 0:
            assert la.window == 8 and la.skipped_by == "--skip-layers sw"


def test_skip_full_and_sliding_window_alias():
    spec = resolve(gemma_like(6), BuildRequest("int8_per_token_head", ["full"])).spec
    assert quantized(spec) == [0, 2, 4]
    spec = resolve(gemma_like(6), BuildRequest("int8_per_token_head", ["sliding_window"])).spec
    assert quantized(spec) == [1, 3, 5]


def test_boundary_3_on_30_layer_dense_model():
    spec = resolve(
        dense(30), BuildRequest("turboquant_k3v4_nc", ["boundary:3"], boundary=False)
    ).spec
    assert quantized(spec) == list(range(3, 27))
    assert spec.layers[0].skipped_by == "--skip-layers boundary:3"


def test_default_turboquant_boundary_protects_first_and_last_two():
    spec = resolve(dense(30), BuildRequest("turboquant_4bit_nc")).spec
    assert quantized(spec) == list(range(2, 28))
    assert spec.layers[29].skipped_by == "turboquant boundary"
    assert quantized(
        resolve(dense(30), BuildRequest("turboquant_4bit_nc", boundary=False)).spec
    ) == list(range(30))


def test_vllm_boundary_caps_each_side_at_half_the_layers():
    """vLLM's rule (TurboQuantConfig.get_boundary_skip_layers): min(2, L // 2) per side."""
    assert turboquant_boundary(4) == {0, 1, 2, 3}
    assert turboquant_boundary(8) == {0, 1, 6, 7}
    assert turboquant_boundary(3) == {0, 2}
    assert turboquant_boundary(1) == set()
    res = resolve(dense(4), BuildRequest("turboquant_k8v4"))
    assert quantized(res.spec) == []
    assert len(res.warnings) == 1 and "keeps all 4 attention layers unquantized" in res.warnings[0]


def test_native_boundary_protects_at_most_half_the_layers_in_total():
    assert turboquant_boundary(4, vllm=False) == {0, 3}
    assert turboquant_boundary(8, vllm=False) == {0, 1, 6, 7}
    assert turboquant_boundary(3, vllm=False) == set()
    res = resolve(dense(4), BuildRequest("tqx_k4v4_g32"))
    assert quantized(res.spec) == [1, 2] and res.warnings == ()


# Quantized layers of an L-layer dense model with the default boundary: vLLM presets
# (min(2, L // 2) per side) and tqexport-native ones (min(2, L // 4) per side).
SMALL_MODELS = {
    1: ([0], [0]),
    2: ([], [0, 1]),
    3: ([1], [0, 1, 2]),
    4: ([], [1, 2]),
    5: ([2], [1, 2, 3]),
    6: ([2, 3], [1, 2, 3, 4]),
    7: ([2, 3, 4], [1, 2, 3, 4, 5]),
    8: ([2, 3, 4, 5], [2, 3, 4, 5]),
}


@pytest.mark.parametrize("n", sorted(SMALL_MODELS))
def test_boundary_on_small_models(n):
    vllm_q, native_q = SMALL_MODELS[n]
    for name in TQ:
        res = resolve(dense(n), BuildRequest(name))
        assert quantized(res.spec) == vllm_q, name
        assert len(res.warnings) == (1 if not vllm_q else 0)
    for name in ("tqx_k4v4_g32", "tqx_k4v3_g32"):
        res = resolve(dense(n), BuildRequest(name))
        assert quantized(res.spec) == native_q and res.warnings == ()
    assert quantized(resolve(dense(n), BuildRequest(TQ[1], boundary=False)).spec) == list(range(n))
    assert resolve(dense(n), BuildRequest(TQ[1], boundary=False)).warnings == ()


def test_boundary_is_turboquant_only():
    assert quantized(resolve(dense(6), BuildRequest("fp8")).spec) == list(range(6))


def test_indices_ranges_negatives_and_commas():
    spec = resolve(dense(10), BuildRequest("fp8", ["0", "-1,-2", "4-5"])).spec
    assert quantized(spec) == [1, 2, 3, 6, 7]
    assert spec.layers[9].skipped_by == "--skip-layers -1"
    assert spec.layers[5].skipped_by == "--skip-layers 4-5"


@pytest.mark.parametrize("dtype", kv_cache_dtype_names())
def test_skipped_layer_is_unquantized_whatever_the_global_dtype(dtype):
    """vLLM seed bug 2: a backend read the global kv dtype, so skipped layers were treated
    as fp8. Here a skipped layer's own spec says NONE with the model dtype."""
    spec = resolve(dense(6, dtype="float16"), BuildRequest(dtype, ["2"], boundary=False)).spec
    skipped = spec.layers[2]
    assert skipped.mode is KVQuantMode.NONE
    assert skipped.cache.storage_dtype == "float16"
    assert skipped.cache.tensor_shapes(1) == {"k": (1, 16, 2, 64), "v": (1, 16, 2, 64)}
    other = spec.layers[3]
    assert other.kv_cache_dtype == dtype


@pytest.mark.parametrize("name", TQ)
def test_every_turboquant_preset_resolves_to_a_turboquant_slot_cache(name):
    spec = resolve(dense(8), BuildRequest(name)).spec
    for la in spec.layers[2:6]:
        assert la.mode is KVQuantMode.TURBOQUANT
        assert la.kv_cache_dtype == name
        assert la.cache.storage_dtype == "uint8"
        assert list(la.cache.tensor_shapes(1)) == ["kv"]


@pytest.mark.parametrize(
    "patterns,message",
    [
        (["10"], "layer 10 is outside the model"),
        (["-11"], "layer -11 is outside the model"),
        (["8-12"], "range ends past the last layer"),
        (["5-2"], "write 2-5"),
        (["boundary:11"], "only 10 attention layers"),
        (["boundary:0"], "at least 1"),
        (["layer3"], "malformed pattern 'layer3'"),
        (["1,,2"], "empty pattern"),
        (["sw:2"], "malformed"),
        (["1.5"], "malformed"),
    ],
)
def test_bad_patterns_are_errors(patterns, message):
    with pytest.raises(ResolveError, match=message):
        resolve(dense(10), BuildRequest("fp8", patterns))


def test_class_pattern_matching_nothing_is_a_warning():
    res = resolve(dense(4), BuildRequest("fp8", ["sw"]))
    assert quantized(res.spec) == [0, 1, 2, 3]
    assert len(res.warnings) == 1 and "no sliding_window layers" in res.warnings[0]
    res = resolve(describe([8, 8]), BuildRequest("fp8", ["full"]))
    assert "no full layers" in res.warnings[0]


def test_mse_preset_on_non_power_of_two_head_suggests_k8v4():
    desc = dense(4, head_size=80)
    with pytest.raises(ResolveError, match="layer 0 .*power-of-two.*turboquant_k8v4"):
        resolve(desc, BuildRequest("turboquant_4bit_nc", boundary=False))
    assert quantized(resolve(desc, BuildRequest("turboquant_k8v4", boundary=False)).spec) == [
        0,
        1,
        2,
        3,
    ]
    # Only layers that keep the preset must fit it.
    assert quantized(resolve(desc, BuildRequest("turboquant_3bit_nc", ["0-3"])).spec) == []


def test_unknown_dtype_is_an_error():
    with pytest.raises(Exception, match="valid names"):
        resolve(dense(2), BuildRequest("int3"))


def test_requested_dtype_is_provenance_only():
    spec = resolve(dense(6), BuildRequest("fp8_e5m2", ["1"])).spec
    assert spec.request == BuildRequest("fp8_e5m2", ("1",))
    recorded = {"kv_cache_dtype": "fp8_e5m2", "skip_layers": ["1"], "boundary": True}
    assert spec.request.to_dict() == recorded | {"kv_scales": "1.0", "opset": 21, "weights": "auto"}
    assert dtypes_of(spec) == ["fp8_e5m2", "auto", "fp8_e5m2", "fp8_e5m2", "fp8_e5m2", "fp8_e5m2"]


def test_kv_scales_apply_per_layer():
    spec = resolve(dense(3), BuildRequest("fp8"), kv_scales={1: (0.5, 2.0)}).spec
    assert spec.layers[1].cache.constants == {"k_scale": 0.5, "v_scale": 2.0}
    assert spec.layers[0].cache.constants == {"k_scale": 1.0, "v_scale": 1.0}


def test_parse_skip_patterns_splits_commas():
    kinds = [p.kind for p in parse_skip_patterns(["0,sw", "1-2", "boundary:2", "-3", "FULL"])]
    assert kinds == ["index", "class", "range", "boundary", "index", "class"]
