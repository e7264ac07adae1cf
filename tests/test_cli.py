import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args], capture_output=True, text=True, timeout=120
    )


def test_dtypes_json_lists_every_name_with_bytes():
    r = run("dtypes", "--head-size", "128", "--json")
    assert r.returncode == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)["dtypes"]}
    assert len(rows) == 16  # 14 vLLM names + 2 tqexport-native presets
    assert rows["turboquant_k3v4_nc"]["bytes_per_token_head"] == 118
    assert rows["turboquant_k3v4_nc"]["data_bits"] == "k3v4"
    assert rows["auto"]["compression_vs_bf16"] == 1.0
    assert rows["fp8"]["bits_per_element"] == 8.0
    assert rows["int8_per_token_head"]["bytes_per_token_head"] == 2 * 128 + 8


def test_dtypes_table_marks_unavailable_presets():
    r = run("dtypes", "--head-size", "80")
    assert r.returncode == 0
    assert "turboquant_4bit_nc: " in r.stdout and "power-of-two" in r.stdout
    assert "turboquant_k8v4" in r.stdout


def test_plan_json_is_the_per_layer_spec():
    r = run("plan", "tiny-gemma2", "--kv-cache-dtype", "fp8", "--skip-layers", "sw", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert set(plan) == {"groups", "layers"}
    assert [la["kv_cache_dtype"] for la in plan["layers"]] == ["auto", "fp8"] * 3
    assert [la["softcap"] for la in plan["layers"]] == [50.0] * 6
    assert plan["layers"][0]["scale"] == 64**-0.5
    assert [g["window"] for g in plan["groups"]] == [None, 8]


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
        (["plan", "tiny-llama", "--skip-layers", "7"], "outside the model"),
        (["plan", "tiny-llama", "--skip-layers", "x-y"], "malformed pattern"),
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
