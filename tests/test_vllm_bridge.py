"""``plan --vllm-args``: the vLLM flags for a plan, or the parts vLLM cannot express."""

import subprocess
import sys

import pytest
from helpers import dense, gemma_like, main_inproc

from tqexport.kvplan.resolve import resolve
from tqexport.spec import BuildRequest
from tqexport.vllm_bridge import vllm_args

BASE = ("--dtype", "bfloat16")


def flags(desc, dtype, skip=(), **kw):
    return vllm_args(resolve(desc, BuildRequest(dtype, tuple(skip), **kw)).spec)


def test_one_dtype_everywhere_is_one_flag():
    got = flags(dense(6), "fp8")
    assert got.args == (*BASE, "--kv-cache-dtype", "fp8", "--block-size", "16")
    assert got.unsupported == ()
    assert flags(dense(6), "auto", block_size=32).args == (
        *BASE, "--kv-cache-dtype", "auto", "--block-size", "32",
    )  # fmt: skip


def test_skipped_layers_are_listed_by_index():
    got = flags(dense(8), "int8_per_token_head", ["0", "5-6"])
    assert got.args[-4:] == ("--kv-cache-dtype-skip-layers", "0", "5", "6")
    assert got.unsupported == ()


def test_every_sliding_layer_skipped_is_sliding_window():
    got = flags(gemma_like(6), "fp8", ["sw"])
    assert got.args[-2:] == ("--kv-cache-dtype-skip-layers", "sliding_window")
    got = flags(gemma_like(6), "fp8", ["sw", "1"])
    assert got.args[-3:] == ("--kv-cache-dtype-skip-layers", "sliding_window", "1")
    got = flags(gemma_like(6), "fp8", ["0"])  # one sliding layer of three: an index
    assert got.args[-2:] == ("--kv-cache-dtype-skip-layers", "0")


def test_turboquant_boundary_is_what_vllm_adds_itself():
    got = flags(dense(6), "turboquant_4bit_nc")
    assert got.unsupported == ()
    assert got.args[-5:] == ("--kv-cache-dtype-skip-layers", "0", "1", "4", "5")
    got = flags(dense(6), "turboquant_4bit_nc", boundary=False)
    assert got.unsupported == (
        "layers 0, 1, 4, 5 are quantized, but vLLM always keeps turboquant_4bit_nc's boundary "
        "layers (the first and last 2) at auto",
    )
    got = flags(dense(6), "turboquant_k8v4", ["0", "1", "4", "5"], boundary=False)
    assert got.unsupported == ()  # the same layers, protected by hand


@pytest.mark.parametrize(
    ("dtype", "kw", "why"),
    [
        ("fp8", {"recent_window": 32}, "a recent window (--kv-recent-window)"),
        ("tqx_k4v4_g32", {"boundary": False}, "tqx_k4v4_g32 is a tqexport-native preset"),
    ],
)
def test_what_vllm_cannot_express_is_named(dtype, kw, why):
    got = flags(dense(6), dtype, **kw)
    assert len(got.unsupported) == 1 and got.unsupported[0].startswith(why)


def test_cli_prints_the_command_or_exits_1_saying_why():
    def plan(*args):
        return subprocess.run([sys.executable, "-m", "tqexport.cli", "plan", "tiny-llama", *args,
                               "--vllm-args"], capture_output=True, text=True)  # fmt: skip

    ok = plan("--kv-cache-dtype", "turboquant_k3v4_nc")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == (
        "vllm serve tiny-llama --dtype float32 --kv-cache-dtype turboquant_k3v4_nc --block-size 16"
        " --kv-cache-dtype-skip-layers 0 1 4 5\n"
    )
    bad = plan("--kv-cache-dtype", "fp8", "--kv-recent-window", "16")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("error: vLLM cannot serve this plan: a recent window")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_inspect_prints_the_command_for_a_built_artifact(artifacts, capsys):
    """The artifact's own spec, and the model it was built from, give the command."""
    code, out, err = main_inproc(capsys, "inspect", artifacts("tiny-llama", "fp8"), "--vllm-args")
    assert (code, out, err) == (
        0, "vllm serve tiny-llama --dtype float32 --kv-cache-dtype fp8 --block-size 16\n", ""
    )  # fmt: skip
