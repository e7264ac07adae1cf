"""What every command shares: user text printed literally, one-line usage errors, every
argument validated before any work, conflicting or empty options refused."""

import os
import subprocess
import sys

import pytest
from cli_helpers import NOWHERE, one_error_line, run
from helpers import main_inproc

from tqexport.models.builtins import BUILTIN_NAMES

# --- issue 13: user text printed literally, one-line usage errors, every argument validated ---


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

    def commands(cmd, path=""):
        subs = getattr(cmd, "commands", None)
        if not subs:
            return {path: cmd}
        return {
            k: c for n, s in subs.items() for k, c in commands(s, f"{path} {n}".strip()).items()
        }

    found = commands(typer.main.get_command(app))
    assert list(found) == [
        "dtypes",
        "plan",
        "build",
        "calibrate",
        "parity",
        "inspect",
        "run",
        "serve",
        "engine",
        "bench quality",
        "bench speed",
        "bench scale",
    ]
    assert all(isinstance(c, Command) for c in found.values()), found


def combined(*args):
    """``tqexport ARGS`` in a subprocess, stdout and stderr as one stream: (code, lines)."""
    r = subprocess.run([sys.executable, "-m", "tqexport", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    return r.returncode, r.stdout.splitlines()


def test_no_progress_line_before_an_error():
    code, lines = combined("bench", "quality", "no/such/model", "--no-peer", "--chunks", "1")
    assert code == 2 and lines[0].startswith("error: model 'no/such/model' not found"), lines


def test_printable_escapes_control_characters():
    from tqexport.validate import printable

    assert printable("a\x1b[31mb\nc\u202ed\u2028") == "a\\x1b[31mb\\nc\\u202ed\\u2028"
    assert printable("line\n\ttab\x07", keep_newlines=True) == "line\n\ttab\\x07"
    assert printable("héllo € [/x] :100:") == "héllo € [/x] :100:"
