"""`tqexport dtypes`: every kv-cache dtype name with its bytes."""

import json

from cli_helpers import run


def test_dtypes_json_lists_every_name_with_bytes():
    r = run("dtypes", "--head-size", "128", "--json")
    assert r.returncode == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)["dtypes"]}
    assert len(rows) == 21  # 14 vLLM names + 7 tqexport-native presets
    assert rows["tqx_k4v2_mse"]["bytes_per_token_head"] == 64 + 2 + 32 + 2  # k4 + norm, v2 + norm
    assert rows["tqx_k4v2_mse"]["data_bits"] == "k4v2"
    assert rows["tqx_k3v2_mse"]["bytes_per_token_head"] == 48 + 2 + 32 + 2  # k3 + norm, v2 + norm
    assert rows["tqx_k3v2_mse"]["data_bits"] == "k3v2"
    assert (
        rows["tqx_k4v4"]["bytes_per_token_head"]
        == rows["turboquant_4bit_nc"]["bytes_per_token_head"]
    )
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
