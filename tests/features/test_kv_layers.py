"""``--kv-layers``: per-layer dtypes, recent windows and sinks, and how they compose with the
global cache options (resolve, the spec's consistency check, plan/build/bench, vLLM flags)."""

import json

import pytest
from cli_helpers import NOWHERE
from helpers import dense, gemma_like, main_inproc

from tqexport.contract.artifact import open_artifact
from tqexport.errors import ResolveError
from tqexport.kvplan.resolve import resolve
from tqexport.spec import BuildRequest, SpecError, spec_from_dict, spec_from_json
from tqexport.spec.kv_layers import parse_kv_layers


def dtypes_of(spec):
    return [la.kv_cache_dtype for la in spec.layers]


def test_ranges_give_each_layer_its_dtype_window_and_sinks():
    res = resolve(dense(6), BuildRequest("auto", kv_layers="0:auto,1-3:tqx_k4v2_mse:w8:s2,4-5:fp8"))
    spec = res.spec
    assert dtypes_of(spec) == ["auto", *["tqx_k4v2_mse"] * 3, "fp8", "fp8"]
    assert [la.recent_window for la in spec.layers] == [0, 8, 8, 8, 0, 0]
    assert [la.sink_tokens for la in spec.layers] == [0, 2, 2, 2, 0, 0]
    assert [la.skipped_by for la in spec.layers] == [None] * 6
    assert spec.request.kv_layers == "0:auto,1-3:tqx_k4v2_mse:w8:s2,4-5:fp8"
    assert res.warnings == ()
    assert spec_from_json(spec.to_json()).to_dict() == spec.to_dict()


def test_left_out_layers_get_the_global_dtype_skips_boundary_and_window():
    res = resolve(
        dense(8), BuildRequest("turboquant_4bit_nc", ["3"], kv_layers="4-5:fp8:w0", recent_window=4)
    )
    spec = res.spec
    # boundary protection (0, 1, 6, 7) and --skip-layers 3 apply to the layers left out only
    assert dtypes_of(spec) == ["auto", "auto", "turboquant_4bit_nc", "auto", "fp8", "fp8",
                               "auto", "auto"]  # fmt: skip
    assert [la.recent_window for la in spec.layers] == [0, 0, 4, 0, 0, 0, 0, 0]
    assert [la.skipped_by for la in spec.layers] == [
        "turboquant boundary", "turboquant boundary", None, "--skip-layers 3", None, None,
        "turboquant boundary", "turboquant boundary",
    ]  # fmt: skip
    assert res.warnings == (
        "--kv-layers leaves layers 0-3, 6-7 out: they get --kv-cache-dtype turboquant_4bit_nc "
        "(give them an entry to choose otherwise)",
    )
    assert spec_from_json(spec.to_json()).to_dict() == spec.to_dict()


def test_global_window_and_sinks_reach_ranges_without_their_own_and_sliding_caps():
    spec = resolve(
        gemma_like(4, window=8),
        BuildRequest("auto", kv_layers="0-1:fp8,2-3:fp8:w64", recent_window=16, sink_tokens=2),
    ).spec
    # layer 0 slides over 8 tokens: its window caps the recent one, as without --kv-layers
    assert [la.recent_window for la in spec.layers] == [8, 16, 8, 64]
    assert [la.sink_tokens for la in spec.layers] == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "text,message",
    [
        ("0-3:fp8,2-5:nvfp4", "--kv-layers: 0-3:fp8 and 2-5:nvfp4 both cover layers 2-3; give each "
         "layer one entry"),
        ("0-3:fp8,3:nvfp4", "--kv-layers: 0-3:fp8 and 3:nvfp4 both cover layer 3; give each layer "
         "one entry"),
        ("0-3:fp9", "--kv-layers 0-3:fp9: unknown kv-cache dtype 'fp9'; valid names: auto,"),
        ("3-1:fp8", "--kv-layers 3-1:fp8: range start is after its end; write 1-3"),
        ("0-3", "--kv-layers: malformed entry '0-3'; write RANGE:DTYPE[:wN][:sN] entries joined "
         "by commas, e.g. 0-1:auto,2-27:fp8:w64"),
        ("-1:fp8", "--kv-layers: malformed entry '-1:fp8'"),
        ("0:fp8,", "--kv-layers '0:fp8,' has an empty entry"),
        ("0:fp8:w4:w8", "--kv-layers 0:fp8:w4:w8: wN is given twice; give it once"),
        ("0:auto:w4", "--kv-layers 0:auto:w4: auto is not quantized, so a recent window or sink "
         "tokens have no effect; drop them"),
        ("0:fp8:w0:s4", "--kv-layers 0:fp8:w0:s4: s4 needs a recent window"),
        ("0:fp8:w2000000", "--kv-layers 0:fp8:w2000000: the recent window wN must be from 0 to "
         "1048576, got 2000000"),
    ],
)  # fmt: skip
def test_bad_entries_are_one_error_naming_the_entry(text, message):
    with pytest.raises(ResolveError) as e:
        parse_kv_layers(text)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args,kw,message",
    [
        (("auto",), {"kv_layers": "4-6:fp8"},
         "--kv-layers 4-6:fp8: layer 6 is outside the model (attention layers 0..5); end the "
         "range at 5 at most"),
        (("fp8", ["2"]), {"kv_layers": "1-3:nvfp4"},
         "--skip-layers 2 and --kv-layers 1-3:nvfp4 both choose layer 2's cache; drop the layer "
         "from one of them"),
        (("fp8",), {"kv_layers": "0-5:nvfp4"},
         "--kv-cache-dtype fp8 has no effect: --kv-layers 0-5:nvfp4 covers every layer; drop it, "
         "or leave the layers it should cover out of --kv-layers"),
        (("auto",), {"kv_layers": "0:fp8:w4", "recent_window": 8},
         "--kv-recent-window 8 has no effect: every quantized layer has its own wN in "
         "--kv-layers or none is quantized; drop it"),
        (("auto",), {"kv_layers": "0:fp8:s4"},
         "--kv-layers 0:fp8:s4: s4 needs a recent window (the sink tokens are kept in it); add "
         "wN to the entry or give --kv-recent-window"),
        (("auto",), {"kv_layers": "0:fp8", "key_transform": ("center",)},
         "--kv-key-transform center has no effect: --kv-layers 0:fp8 and --kv-cache-dtype auto "
         "give no layer a tqexport-native TurboQuant dtype (tqx_*); drop it"),
    ],
)  # fmt: skip
def test_conflicts_with_the_global_options_name_both(args, kw, message):
    with pytest.raises(ResolveError) as e:
        resolve(dense(6), BuildRequest(*args, **kw))
    assert str(e.value).startswith(message)


def test_spec_refuses_layers_that_do_not_fit_its_kv_layers():
    spec = resolve(dense(4), BuildRequest("auto", kv_layers="0-1:fp8:w4,2:nvfp4")).spec
    d = spec.to_dict()
    d["request"]["kv_layers"] = "0-1:fp8:w4,2:fp8"
    with pytest.raises(SpecError, match="layer 2: kv_cache_dtype 'nvfp4' and skipped_by null do "
                       "not fit the request's kv_layers entry '2:fp8'; rebuild"):  # fmt: skip
        spec_from_dict(d)
    d["request"]["kv_layers"] = "0-1:fp8:w8,2:nvfp4"
    want = r"layer 0: recent window 4 but the request \(kv_layers entry '0-1:fp8:w8', "
    with pytest.raises(SpecError, match=want + r"recent_window 0, sink_tokens 0\) gives 8"):
        spec_from_dict(d)
    d["request"]["kv_layers"] = "0-9:fp8"
    with pytest.raises(SpecError, match="field 'kv_layers': --kv-layers 0-9:fp8: layer 9 is "
                       "outside the model"):  # fmt: skip
        spec_from_dict(d)


def test_plan_shows_the_ranges_and_warns_about_the_rest(capsys):
    code, out, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-layers", "0:auto,1-3:fp8")
    assert code == 0
    assert "--kv-cache-dtype auto --kv-layers 0:auto,1-3:fp8" in out
    assert "--kv-layers 0:auto" in out  # why layer 0 is unquantized
    assert err == (
        "warning: --kv-layers leaves layers 4-5 out: they get --kv-cache-dtype auto (give them "
        "an entry to choose otherwise)\n"
    )
    code, out, _ = main_inproc(capsys, "plan", "tiny-llama", "--kv-layers", "0:auto,1-5:fp8",
                               "--json")  # fmt: skip
    assert [la["kv_cache_dtype"] for la in json.loads(out)["layers"]] == ["auto", *["fp8"] * 5]


def test_vllm_args_express_one_dtype_with_skips_and_say_what_they_cannot(capsys):
    code, out, _ = main_inproc(capsys, "plan", "tiny-llama", "--kv-layers", "0-1:auto,2-5:fp8",
                               "--vllm-args")  # fmt: skip
    assert (code, out) == (0, "vllm serve tiny-llama --dtype float32 --kv-cache-dtype fp8 "
                           "--block-size 16 --kv-cache-dtype-skip-layers 0 1\n")  # fmt: skip
    mixed = "0-1:auto,2-3:turboquant_4bit_nc,4-5:fp8"
    code, out, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-layers", mixed, "--vllm-args")
    assert (code, out) == (1, "")
    assert err.endswith(
        "error: vLLM cannot serve this plan: layers use fp8, turboquant_4bit_nc; vLLM has one "
        "--kv-cache-dtype\n"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "tiny-llama", "--kv-layers", "0-9:fp8"],
         "--kv-layers 0-9:fp8: layer 9 is outside the model (attention layers 0..5); end the "
         "range at 5 at most"),
        (["build", "tiny-llama", "-o", NOWHERE, "--kv-layers", "0:fp8,0:nvfp4"],
         "--kv-layers: 0:fp8 and 0:nvfp4 both cover layer 0; give each layer one entry"),
        (["build", "tiny-llama", "-o", NOWHERE, "--kv-layers", "0:tqx_k4v4", "--kv-scales", "2"],
         "--kv-scales 2 has no effect: --kv-cache-dtype auto nor --kv-layers has no per-layer "
         "scales (fp8 and nvfp4 have); drop it"),
        (["bench", "quality", "tiny-llama", "--kv-layers", "0-9:fp8"],
         "--kv-layers 0-9:fp8: layer 9 is outside the model"),
        (["bench", "quality", "tiny-llama", "--kv-layers", "0:fp8", "--kv-cache-dtype",
          "fp8,nvfp4"],
         "--kv-layers takes one --kv-cache-dtype (what the layers it leaves out get), got "
         "fp8,nvfp4; give one"),
    ],
)  # fmt: skip
def test_cli_refuses_bad_kv_layers_before_any_work(capsys, monkeypatch, tmp_path, args, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = main_inproc(capsys, *args)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


BIG = "9" * 5000  # Python refuses to convert more than 4300 digits


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "tiny-llama", "--kv-layers", f"{BIG}:fp8"],
         "--kv-layers 9999999999999999999999999999999999999...: a layer index must be from 0 to "
         "1023, got 5000 digits"),
        (["plan", "tiny-llama", "--kv-layers", "1024:fp8"],
         "--kv-layers 1024:fp8: a layer index must be from 0 to 1023, got 1024"),
        (["plan", "tiny-llama", "--kv-layers", f"0-{BIG}:fp8"],
         "--kv-layers 0-99999999999999999999999999999999999...: a layer index must be from 0 to "
         "1023, got 5000 digits"),
        (["plan", "tiny-llama", "--kv-layers", f"0:fp8:w{BIG}"],
         "--kv-layers 0:fp8:w999999999999999999999999999999...: the recent window wN must be "
         "from 0 to 1048576, got 5000 digits"),
        (["plan", "tiny-llama", "--kv-layers", f"0:fp8:w4:s{BIG}"],
         "--kv-layers 0:fp8:w4:s999999999999999999999999999...: the sink tokens sN must be "
         "from 0 to 1024, got 5000 digits"),
        (["plan", "tiny-llama", "--kv-layers", ",".join(["0:fp8"] * 1025)],
         "--kv-layers has 1025 entries, more than a model has layers (1024 at most); join ranges "
         "as START-END:DTYPE"),
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", BIG],
         "--skip-layers 9999999999999999999999999999999999999...: N must be from -1024 to 1023, "
         "got 5000 digits"),
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", f"-{BIG}"],
         "--skip-layers -999999999999999999999999999999999999...: N must be from -1024 to 1023, "
         "got 5000 digits"),
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", f"0-{BIG}"],
         "--skip-layers 0-99999999999999999999999999999999999...: N must be from 0 to 1023, got "
         "5000 digits"),
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", f"boundary:{BIG}"],
         "--skip-layers boundary:9999999999999999999999999999...: N must be from 1 to 1024, got "
         "5000 digits"),
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", ",".join("0" * 1025)],
         "--skip-layers has more than 1024 patterns (a model has at most that many layers); use "
         "ranges such as 0-3"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--candidates", f"fp8:w{BIG}"],
         "--kv-layers 0:fp8:w999999999999999999999999999999...: the recent window wN must be "
         "from 0 to 1048576, got 5000 digits"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--candidates",
          ",".join(f"fp8:w{i + 1}" for i in range(65))],
         "--candidates has 65 values, more than 64; measure the ones --kv-bits should choose "
         "among"),
    ],
)  # fmt: skip
def test_huge_numbers_in_layer_options_are_one_line(capsys, monkeypatch, tmp_path, args,
                                                    message):  # fmt: skip
    """Every number of --kv-layers, --skip-layers and calibrate --candidates is bounded as it
    is parsed (5000 digits would be a ValueError traceback from int())."""
    monkeypatch.chdir(tmp_path)
    code, out, err = main_inproc(capsys, *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_built_mixed_artifact_matches_the_reference(artifacts):
    from tqexport.verify.parity import run_parity

    kv = "0:auto,1-2:tqx_k4v2_mse:w8:s2,3:fp8,4:int4_per_token_head:w4"
    art = open_artifact(artifacts("tiny-llama", "nvfp4", kv_layers=kv))
    assert dtypes_of(art.spec) == ["auto", "tqx_k4v2_mse", "tqx_k4v2_mse", "fp8",
                                   "int4_per_token_head", "nvfp4"]  # fmt: skip
    assert [la.recent_window for la in art.spec.layers] == [0, 8, 8, 0, 4, 0]
    assert art.spec.request.kv_layers == kv
    assert run_parity(art, steps=2, prompt_len=20, batch=2).ok


def test_built_plan_mixing_fp8_and_centred_tqx_layers_matches_the_reference(artifacts):
    """What --kv-bits under --kv-key-transform center builds: fp8 layers with plain keys beside
    tqx_* layers with fitted centres, through ONNX Runtime as through the torch reference."""
    from tqexport.verify.parity import run_parity

    kv = "0:fp8,1-4:tqx_k4v3_mse:w8:s2,5:auto"
    art = open_artifact(artifacts("tiny-llama", "auto", kv_layers=kv, key_transform="center"))
    assert [la.key_transform is not None for la in art.spec.layers] == [False] + [True] * 4 + [
        False]  # fmt: skip
    assert art.spec.layers[1].key_transform.kinds == ("center",)
    assert run_parity(art, steps=2, prompt_len=20, batch=2).ok


def test_bench_quality_scores_a_kv_layers_configuration(monkeypatch):
    from tqexport.bench import matrix

    configs = matrix.quality_configs(None, "both", None, "0,4", kv_layers=["0-2:fp8", "3:nvfp4"])
    assert [(c.request.kv_layers, c.request.recent_window, c.label) for c in configs] == [
        ("0-2:fp8", 0, "layers 0-2:fp8"),
        ("0-2:fp8", 4, "layers 0-2:fp8 recent 4"),
        ("3:nvfp4", 0, "layers 3:nvfp4"),
        ("3:nvfp4", 4, "layers 3:nvfp4 recent 4"),
    ]
    assert configs[1].request.kv_layers == "0-2:fp8"


def test_key_transforms_go_to_the_quantized_ranges_only():
    from tqexport.kvquant import transforms

    fitted = {
        i: transforms.fit(("signs",), None, i, num_kv_heads=2, head_size=64) for i in range(4)
    }
    spec = resolve(
        dense(4),
        BuildRequest("auto", kv_layers="0-1:tqx_k4v4,2:float16", key_transform=("signs",)),
        key_transforms=fitted,
    ).spec
    assert [la.key_transform is not None for la in spec.layers] == [True, True, False, False]
    assert spec_from_json(spec.to_json()).to_dict() == spec.to_dict()
