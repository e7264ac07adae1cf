"""Artifact confinement: every file a consumer opens from an artifact is a regular file inside
it; a link leading outside, a FIFO, a directory, a dangling link or a loop is one error line
naming the file, and nothing outside the artifact is ever read."""

import json
import os
import shutil
import signal
from contextlib import contextmanager

import pytest
from helpers import with_byte_tokenizer

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.runtime.engine import Engine, EngineConfig
from tqexport.runtime.executor import Executor

FIX = "copy the file itself into the artifact or rebuild it"
#: an engine's limits, so the TensorRT backend gets as far as its plan
LIMITS = {"max_batch": 8, "max_num_batched_tokens": 64, "max_blocks": 64, "tensorrt": "10"}
#: every file an artifact may carry -> what a stand-in for it holds when the artifact has none
#: (valid content, so only its place decides whether it is read)
FILES = {
    "tqexport.json": None,
    "model.onnx": None,
    "model.onnx.data": None,
    "tokenizer.json": None,
    "tokenizer_config.json": None,
    "special_tokens_map.json": b"{}",
    "added_tokens.json": b"{}",
    "chat_template.jinja": b"{{ messages[0].content }}",
    "chat_template.json": b'{"chat_template": "{{ messages[0].content }}"}',
    "additional_chat_templates/tool_use.jinja": b"{{ messages[0].content }}",
    "vocab.json": b'{"a": 0}',
    "merges.txt": b"#version: 0.2\n",
    "tokenizer.model": b"spm",
    "generation_config.json": None,
    "engine.plan": b"plan",
    "engine.json": json.dumps(LIMITS).encode(),
}
ENGINE_FILES = ("engine.plan", "engine.json")


@pytest.fixture
def art(artifacts, tmp_path):
    """A copy of the tiny-llama fp8 artifact with a byte-level tokenizer and chat template."""
    return with_byte_tokenizer(artifacts("tiny-llama", "fp8"), tmp_path / "art")


@contextmanager
def bounded(seconds=60):
    """Fail instead of hanging (a blocking open of a FIFO is interrupted by the alarm)."""

    def expire(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def consume(art, name):
    """What opens ``name``: the engine's backend for engine files, else the engine itself
    (artifact, graph, weights, tokenizer, chat template, generation config)."""
    with bounded():
        if name in ENGINE_FILES:
            for other in ENGINE_FILES:
                if not os.path.lexists(art / other):
                    (art / other).write_bytes(FILES[other])
            return Executor(open_artifact(art), backend="trt", num_blocks=8)
        return Engine.from_artifact(art, EngineConfig(num_blocks=8))


def move_out(art, name, outside):
    """``art / name`` moved to ``outside`` (a stand-in written when the artifact has none)."""
    (art / name).parent.mkdir(exist_ok=True)
    if (art / name).exists():
        shutil.move(art / name, outside)
    else:
        outside.write_bytes(FILES[name])


@pytest.mark.parametrize("name", FILES)
def test_a_link_leading_outside_the_artifact_is_refused(art, tmp_path, name):
    outside = tmp_path / "outside"
    move_out(art, name, outside)
    (art / name).symlink_to(outside)
    with pytest.raises(TQExportError) as e:
        consume(art, name)
    assert str(e.value) == (
        f"{art / name} is a link to {os.path.realpath(outside)!r}, outside the artifact; "
        f"refusing to read it, {FIX}"
    )


@pytest.mark.parametrize("name", FILES)
def test_a_fifo_is_refused_without_blocking(art, name):
    (art / name).parent.mkdir(exist_ok=True)
    (art / name).unlink(missing_ok=True)
    os.mkfifo(art / name)
    with pytest.raises(TQExportError) as e:
        consume(art, name)
    assert str(e.value) == f"{art / name} is a named pipe (FIFO), not a regular file; {FIX}"


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p.mkdir(), "is a folder, not a regular file"),
        (lambda p: p.symlink_to("gone.json"), "is a link to '{dir}/gone.json', which does not"),
        (lambda p: p.symlink_to(p.name), "is a link loop"),
        (lambda p: p.symlink_to(".."), "is a link to '{up}', outside the artifact"),
    ],
)
def test_what_is_not_a_file_inside_is_refused(art, make, message):
    tok = art / "tokenizer.json"
    tok.unlink()
    make(tok)
    with pytest.raises(TQExportError) as e:
        consume(art, tok.name)
    real = os.path.realpath(art)
    want = message.format(dir=real, up=os.path.dirname(real))
    assert str(e.value).startswith(f"{tok} {want}") and str(e.value).endswith(FIX)


def test_links_inside_the_artifact_are_read(art):
    """A link whose target is a file of the artifact itself reads only the artifact's bytes."""
    (art / "template.txt").write_text("[{{ messages[0].content }}]")
    (art / "chat_template.jinja").symlink_to("template.txt")
    shutil.move(art / "model.onnx", art / "graph.onnx")
    (art / "model.onnx").symlink_to(art / "graph.onnx")  # absolute, and still inside
    engine = consume(art, "chat_template.jinja")
    assert engine.encode("hi") == list(b"[hi]")
