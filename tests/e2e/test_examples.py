"""Every script in examples/ runs as written, on the tiny built-in models."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from helpers import with_byte_tokenizer

from tqexport.serve.runner import listen

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(*cmd, env=None, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_python_api_builds_and_generates(tmp_path):
    out = run(sys.executable, EXAMPLES / "python_api.py", "--model", "tiny-llama",
              "--kv-cache-dtype", "fp8", "--out", tmp_path / "art")  # fmt: skip
    lines = out.splitlines()
    assert lines[:6] == [f"layer {i}: fp8 (as asked)" for i in range(6)]
    assert len(lines) == 8 and all(": 24 tokens, length: " in line for line in lines[6:])


def test_sliding_window_export_keeps_sliding_layers_unquantized(tmp_path):
    env = {**os.environ, "TQEXPORT": f"{sys.executable} -m tqexport"}
    out = run("bash", EXAMPLES / "sliding_window_export.sh", "tiny-gemma3", tmp_path / "art",
              env=env)  # fmt: skip
    assert out.rstrip().splitlines()[-1] == (
        "vllm serve tiny-gemma3 --dtype float32 --kv-cache-dtype fp8 --block-size 16 "
        "--kv-cache-dtype-skip-layers sliding_window"
    )
    assert (tmp_path / "art" / "tqexport.json").is_file()


def test_openai_client_against_tqexport_serve(artifacts, tmp_path):
    art = with_byte_tokenizer(artifacts("tiny-llama", "turboquant_4bit_nc"), tmp_path / "art")
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "tqexport", "serve", str(art), "--port", str(port),
         "--served-model-name", "tiny", "--num-blocks", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        out = run(sys.executable, EXAMPLES / "openai_client.py", "--base-url", base + "/v1",
                  "--model", "tiny", timeout=180)  # fmt: skip
        lines = out.splitlines()
        assert lines[0] == "models: ['tiny']"
        assert lines[1].startswith("completion (")
        assert lines[2].startswith("chat, streamed: ")
    finally:
        server.terminate()
        assert server.wait(60) == 0
