"""Shared by the CLI tests: ``tqexport`` in a subprocess, the one-line error rule, and the
inputs several commands are given (a missing artifact, a config, a truncated GGUF)."""

import json
import subprocess
import sys


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args], capture_output=True, text=True, timeout=120
    )


def one_error_line(stderr: str, message: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in stderr
    return lines[0]


NOWHERE = "no/such/artifact"


def write_config(d, model_type="llama", **fields):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    return d


def truncated_gguf_error(err: str, path) -> None:
    line = one_error_line(err, "")
    assert line.startswith(f"error: cannot read the GGUF header of {path} (")
    assert line.endswith("); the file is truncated or damaged, download it again")
