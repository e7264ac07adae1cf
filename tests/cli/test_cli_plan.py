"""`tqexport plan`: the per-layer plan, and the model inputs it (and build) refuse in one line."""

import json

import pytest
from cli_helpers import one_error_line, run, truncated_gguf_error, write_config
from helpers import main_inproc


def test_plan_json_is_the_per_layer_spec():
    r = run("plan", "tiny-gemma2", "--kv-cache-dtype", "fp8", "--skip-layers", "sw", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert set(plan) == {"groups", "layers", "weights_bytes"}
    assert set(plan["weights_bytes"]) == {"fp32"}  # a float checkpoint under --weights auto
    assert [la["kv_cache_dtype"] for la in plan["layers"]] == ["auto", "fp8"] * 3
    assert [la["softcap"] for la in plan["layers"]] == [50.0] * 6
    assert plan["layers"][0]["scale"] == 64**-0.5
    assert [g["window"] for g in plan["groups"]] == [None, 8]


def test_plan_shows_sink_tokens_with_the_recent_window_and_refuses_them_alone(capsys):
    code, out, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-cache-dtype", "fp8",
                                 "--kv-recent-window", "8", "--kv-sink-tokens", "4")  # fmt: skip
    assert code == 0, err
    assert "8 + first 4 (group 1)" in out
    code, out, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-cache-dtype", "fp8",
                                 "--kv-sink-tokens", "4")  # fmt: skip
    assert code == 2 and out == ""
    one_error_line(err, "--kv-sink-tokens 4 needs --kv-recent-window >= 1")


def test_plan_table_for_real_gguf_model():
    r = run(
        "plan", "smollm2", "--kv-cache-dtype", "turboquant_4bit_nc", "--skip-layers", "boundary:3"
    )
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM" in r.stdout
    assert r.stdout.count("TURBOQUANT") == 24
    assert "--skip-layers boundary:3" in r.stdout


def test_plan_reads_hf_config_json(tmp_path):
    cfg = {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "num_hidden_layers": 3,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "sliding_window": 4096,
        "vocab_size": 100,
        "dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run("plan", str(tmp_path), "--kv-cache-dtype", "nvfp4", "--json")
    assert r.returncode == 0, r.stderr
    layers = json.loads(r.stdout)["layers"]
    assert [la["window"] for la in layers] == [4096] * 3
    assert layers[0]["model_dtype"] == "bfloat16" and layers[0]["num_kv_heads"] == 1
    assert layers[0]["page_size_bytes"] == 16 * 1 * 2 * (64 + 8)


def test_plan_warns_for_class_pattern_matching_nothing():
    r = run("plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", "sw", "--json")
    assert r.returncode == 0
    assert "warning:" in r.stderr and "no sliding_window layers" in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp9"], "unknown kv-cache dtype 'fp9'"),
        (["plan", "tiny-llama", "--kv-cache-dtype", "fp8_inc"], "not supported"),
        (
            ["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", "7"],
            "outside the model",
        ),
        (
            ["plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", "x-y"],
            "malformed pattern",
        ),
        (["plan", "no/such/dir"], "not found"),
        (
            ["plan", "tiny-llama-d80", "--kv-cache-dtype", "turboquant_4bit_nc", "--no-boundary"],
            "turboquant_k8v4",
        ),
        (["dtypes", "--head-size", "0"], "--head-size must be positive"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in r.stderr


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64})
    )
    r = run("plan", str(tmp_path))
    assert r.returncode == 2
    assert "unsupported architecture 'gpt2'" in r.stderr and "LlamaForCausalLM" in r.stderr


# --- bounded from small inputs: absurd configs, damaged GGUF files ---


ABSURD = {"num_hidden_layers": 10**7, "hidden_size": 10**9, "num_attention_heads": 8,
          "num_key_value_heads": 8, "intermediate_size": 10**9, "vocab_size": 32000}  # fmt: skip


@pytest.fixture
def no_transformers_config(monkeypatch):
    """Fails the test if transformers is asked to build a config (what took minutes)."""
    from transformers import AutoConfig, PretrainedConfig

    def refuse(*a, **kw):
        raise AssertionError("transformers saw a config that should have been refused first")

    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(PretrainedConfig, "get_config_dict", refuse)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("command", ["plan", "build"])
def test_absurd_config_sizes_are_refused_before_anything_is_built(
    capsys, tmp_path, no_transformers_config, model_type, command
):
    src = write_config(tmp_path / "huge", model_type, **ABSURD)
    out = tmp_path / "out"
    args = [command, src] + (["-o", out] if command == "build" else [])
    code, stdout, err = main_inproc(capsys, *args)
    assert code == 2 and stdout == ""
    assert one_error_line(err, "") == (
        f"error: {src}: config num_hidden_layers must be an integer from 1 to 1024 (tqexport's "
        "limit), got 10000000; is the config damaged?"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge"]


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_hidden_layers": 2, "hidden_size": 10**6, "num_attention_heads": 8},
         "hidden_size 1000000 / num_attention_heads 8 is a head size of 125000, more than 1024"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1 to 1024 "
         "(tqexport's limit), got 0"),
        ({"num_key_value_heads": 2.5}, "num_key_value_heads must be an integer from 1 to 1024 "
         "(tqexport's limit), got 2.5"),
        ({"vocab_size": 2**30}, "vocab_size must be an integer from 1 to 16777216"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2000},
         "config layer_types lists 2000 layers, more than 1024"),
    ],
)  # fmt: skip
def test_config_sizes_outside_the_spec_limits_are_one_line(
    capsys, tmp_path, no_transformers_config, fields, message
):
    src = write_config(tmp_path / "m", **fields)
    code, _, err = main_inproc(capsys, "plan", src)
    assert code == 2
    assert one_error_line(err, message).startswith(f"error: {src}: config ")


@pytest.mark.parametrize("depth", [100_000, 40])
def test_deeply_nested_config_is_one_line(capsys, tmp_path, no_transformers_config, depth):
    src = tmp_path / "deep"
    src.mkdir()
    (src / "config.json").write_text(
        '{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}"
    )
    code, _, err = main_inproc(capsys, "plan", src)
    assert code == 2
    if depth > 1000:  # beyond Python's recursion limit: json itself gives up
        assert one_error_line(err, "") == (
            f"error: {src / 'config.json'} is not a config: its JSON nests too deeply"
        )
    else:
        assert one_error_line(err, "") == (
            f"error: {src}: the config nests lists/objects more than 32 deep; is it damaged?"
        )


@pytest.mark.parametrize("size", [10, 24, 100, 300])
@pytest.mark.parametrize("command", ["plan", "build"])
def test_truncated_gguf_header_is_one_line(capsys, tmp_path, gguf_bytes, size, command):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_bytes[:size])
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, command, path, *(["-o", out] if command == "build" else []))
    assert code == 2
    truncated_gguf_error(err, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_valid_small_gguf_still_plans(capsys, tmp_path, gguf_bytes):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_bytes)
    code, out, err = main_inproc(capsys, "plan", path, "--json")
    assert code == 0, err
    assert [la["head_size"] for la in json.loads(out)["layers"]] == [8, 8]
