"""tqexport build: artifacts for every kv dtype on a tiny model, read back and run on ORT."""

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

import tqexport
from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.export.artifact_build import build_artifact
from tqexport.ops.attributes import CACHE_WRITE, PAGED_ATTENTION
from tqexport.spec import BuildRequest
from tqexport.verify.parity import run_parity


def _node_dtypes(model_path):
    graph = onnx.load(str(model_path), load_external_data=False)
    out = {}
    for node in graph.graph.node:
        if node.domain == "tqexport" and node.op_type in (CACHE_WRITE, PAGED_ATTENTION):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["plugin_namespace"] == b"tqexport"
            assert node.overload == attrs["variant"].decode()
            out.setdefault(attrs["layer"], set()).add(
                (node.op_type, attrs["kv_cache_dtype"].decode())
            )
    return out, graph


def test_skip_sw_on_gemma_is_in_spec_and_graph(artifacts):
    art = open_artifact(artifacts("tiny-gemma2", "turboquant_4bit_nc", ["sw"]))
    nodes, graph = _node_dtypes(art.model_file)
    inputs = {i.name: i.type.tensor_type.elem_type for i in graph.graph.input}
    for la in art.spec.layers:
        expected = "auto" if la.window else "turboquant_4bit_nc"
        assert la.kv_cache_dtype == expected
        assert nodes[la.index] == {("CacheWrite", expected), ("PagedAttention", expected)}
        if la.window:
            assert inputs[f"cache.{la.index}.k"] == onnx.TensorProto.FLOAT
            assert f"cache.{la.index}.kv" not in inputs
        else:
            assert inputs[f"cache.{la.index}.kv"] == onnx.TensorProto.UINT8
    meta = {p.key: p.value for p in graph.metadata_props}
    assert json.loads(meta["tqexport.spec"]) == json.loads((art.path / "tqexport.json").read_text())


def test_graph_names_no_local_path(artifacts):
    """No node of the graph or of its function bodies carries torch's stack trace, which names
    the build machine's files: the same build gives the same bytes in any checkout."""
    art = open_artifact(artifacts("tiny-llama", "fp8"))
    model = onnx.load(str(art.model_file), load_external_data=False)
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    keys = {p.key for n in nodes for p in n.metadata_props}
    assert "pkg.torch.onnx.stack_trace" not in keys
    assert "namespace" in keys  # the rest of torch's node metadata stays
    data = art.model_file.read_bytes()
    for local in (Path(tqexport.__file__).resolve().parents[1], Path(torch.__file__).parent):
        assert str(local).encode() not in data


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma2"])
def test_block_size_1_builds_and_matches_the_reference(artifacts, model):
    """The help allows --block-size 1: the export's example step holds enough one-token blocks
    (it gave IndexError), and the artifact runs as the reference does (windows included)."""
    art = open_artifact(artifacts(model, "fp8", block_size=1))
    assert art.spec.block_size == 1
    assert run_parity(art, steps=2, prompt_len=6, batch=2).ok


def test_graph_shape_per_layer(artifacts):
    """Each cache input feeds only its CacheWrite, whose output is the graph output itself; the
    functions are the cache ops', RotateHalf's (every rotary) and FusedAddRMSNorm's (every
    residual norm), one body each for all rotaries and all norms."""
    art = open_artifact(artifacts("tiny-llama", "fp8"))
    graph = onnx.load(str(art.model_file), load_external_data=False).graph
    outputs = {o.name for o in graph.output}
    for la in art.spec.layers:
        for t in la.cache.tensors:
            consumers = [n for n in graph.node if la.onnx_input(t.role) in n.input]
            assert [n.op_type for n in consumers] == ["CacheWrite"]
            assert la.onnx_output(t.role) in consumers[0].output
            assert la.onnx_output(t.role) in outputs
    fns = {
        (f.name, f.overload)
        for f in onnx.load(str(art.model_file), load_external_data=False).functions
    }
    assert {name for name, _ in fns} == {"CacheWrite", "PagedAttention", "RotateHalf",
                                         "FusedAddRMSNorm"}  # fmt: skip
    assert ("RotateHalf", "") in fns and ("FusedAddRMSNorm", "") in fns


def test_default_calibration_text_is_not_the_evaluation_text(tmp_path, monkeypatch):
    # --kv-scales calibrate fits on held-out topics: none of the text bench quality scores
    from tqexport.bench.evaltext import pydoc_topics
    from tqexport.export import artifact_build as artifact

    seen = []
    real = artifact.calibrate_scales
    monkeypatch.setattr(artifact, "calibrate_scales", lambda lm, spec, text: seen.append(text)
                        or real(lm, spec, text))  # fmt: skip
    build_artifact("tiny-llama", tmp_path / "a", BuildRequest(kv_cache_dtype="fp8",
                                                              kv_scales="calibrate"))  # fmt: skip
    scored = pydoc_topics().text[:60_000]  # the report scores 8192 tokens: ~34k characters
    assert len(seen) == 1 and len(seen[0]) >= 24000
    assert not any(part in scored for part in seen[0].split("\n\n") if len(part) > 200)


def test_calibrated_scales_land_in_spec_and_nodes(artifacts):
    # two fp8 layers: each calibrated layer is a body variant of its own (its scales are baked in)
    art = open_artifact(artifacts("tiny-llama", "fp8", ("0-3",), kv_scales="calibrate"))
    caches = [la.cache for la in art.spec.layers]
    assert [c.kv_cache_dtype for c in caches] == ["auto"] * 4 + ["fp8"] * 2
    assert {(c.k_scale, c.v_scale) for c in caches[:4]} == {(1.0, 1.0)}
    scales = [(c.k_scale, c.v_scale) for c in caches[4:]]
    assert len(set(scales)) == 2 and all(k != 1.0 and v != 1.0 for k, v in scales)
    graph = onnx.load(str(art.model_file), load_external_data=False).graph
    on_nodes = {}
    for node in graph.node:
        if node.domain == "tqexport" and node.op_type in (CACHE_WRITE, PAGED_ATTENTION):
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            on_nodes.setdefault(a["layer"], set()).add((a["k_scale"], a["v_scale"]))
    assert on_nodes == {i: {(c.k_scale, c.v_scale)} for i, c in enumerate(caches)}
    assert run_parity(art, steps=1, prompt_len=12, batch=2).ok


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["build", "no/such/model", "-o", "{out}"], "not found"),
        (
            ["build", "tiny-llama", "-o", "{out}", "--kv-cache-dtype", "fp9"],
            "unknown kv-cache dtype",
        ),
        (
            [
                "build",
                "tiny-llama",
                "-o",
                "{out}",
                "--kv-cache-dtype",
                "fp8",
                "--skip-layers",
                "3-x",
            ],
            "malformed pattern",
        ),
        (
            [
                "build",
                "tiny-llama",
                "-o",
                "{out}",
                "--kv-cache-dtype",
                "fp8",
                "--skip-layers",
                "99",
            ],
            "outside the model",
        ),
        (
            [
                "build",
                "tiny-llama-d80",
                "-o",
                "{out}",
                "--kv-cache-dtype",
                "turboquant_4bit_nc",
                "--no-boundary",
            ],
            "turboquant_k8v4",
        ),
        (["build", "tiny-llama", "-o", "{out}", "--kv-scales", "big"], "--kv-scales"),
        (["build", "{gpt2}", "-o", "{out}"], "unsupported architecture"),
    ],
)
def test_bad_build_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    out = tmp_path / "out"
    r = cli(*[a.format(out=out, gpt2=gpt2) for a in args])
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1], r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_existing_output_needs_force(tmp_path, artifacts):
    existing = artifacts("tiny-llama", "auto")
    r = cli("build", "tiny-llama", "-o", str(existing))
    assert r.returncode == 2 and "--force" in r.stderr
    with pytest.raises(TQExportError, match="--force"):
        build_artifact("tiny-llama", existing, BuildRequest())


def spec_text(old: str, new: str):
    """An edit of an artifact that replaces ``old`` by ``new`` in its tqexport.json."""

    def edit(d):
        path = d / "tqexport.json"
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))

    return edit


def corrupt(tmp_path, artifacts, edit):
    import shutil

    src = artifacts("tiny-llama", "fp8")
    dst = tmp_path / "a"
    shutil.copytree(src, dst)
    edit(dst)
    return dst


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: (d / "tqexport.json").unlink(), "has no tqexport.json"),
        (lambda d: (d / "tqexport.json").write_text("{oops"), "not valid JSON"),
        (lambda d: (d / "model.onnx").unlink(), "has no model.onnx"),
        (
            lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:5000]),
            "truncated",
        ),
        (lambda d: (d / "model.onnx.data").write_bytes(b"x"), "missing or truncated"),
        (spec_text('"schema_version": 1', '"schema_version": 9'), "schema version 9"),
        (spec_text('"fp8"', '"fp8_e5m2"'), "differs from the spec embedded"),
        (  # the top-level block size sizes every block table: it must be the layers'
            spec_text('  "block_size": 16,\n  "request"', '  "block_size": 32,\n  "request"'),
            "differs from the spec's block_size 32",
        ),
        (
            spec_text('"num_kv_heads": 2', '"num_kv_heads": null'),
            r"'num_kv_heads' must be an integer in 1\.\.1024, got null",
        ),
        (
            spec_text('"head_size": 64', '"head_size": 65536'),
            r"'head_size' must be an integer in 1\.\.1024, got 65536",
        ),
        (
            lambda d: (d / "tqexport.json").write_bytes(
                b"\xff" + (d / "tqexport.json").read_bytes()
            ),
            "not UTF-8 text",
        ),
        (  # external data must stay in the artifact's own weights file
            lambda d: (d / "model.onnx").write_bytes(
                (
                    m := onnx.load(str(d / "model.onnx"), load_external_data=False),
                    next(
                        e
                        for t in m.graph.initializer
                        for e in t.external_data
                        if e.key == "location"
                    ).__setattr__("value", "/etc/passwd"),
                    m.SerializeToString(),
                )[2]
            ),
            "refusing to read outside the artifact",
        ),
    ],
)
def test_damaged_artifacts_fail_clearly(tmp_path, artifacts, edit, message):
    path = corrupt(tmp_path, artifacts, edit)
    with pytest.raises(TQExportError, match=message):
        open_artifact(path)
    r = cli("parity", str(path))
    assert r.returncode == 2 and message.split()[0] in r.stderr and "Traceback" not in r.stderr


def test_smollm2_boundary_3_plan_and_real_artifact_read_back(artifacts):
    """boundary:3 on the real model's config; the real artifact (shared with the transformers
    generation test) carries its tokenizer and generation config. A quantized SmolLM2 build
    with parity is `make demo`'s job (mixed per-layer graphs: the tiny models above)."""
    from tqexport.kvplan.resolve import resolve
    from tqexport.models.config import describe_model
    from tqexport.spec import BuildRequest

    spec = resolve(
        describe_model("smollm2"), BuildRequest("turboquant_k3v4_nc", ["boundary:3"])
    ).spec
    quantized = [la.index for la in spec.layers if la.mode.is_quantized]
    assert quantized == list(range(3, 27)) and len(spec.layers) == 30
    assert {la.skipped_by for la in spec.layers if la.index not in quantized} == {
        "--skip-layers boundary:3"
    }
    art = open_artifact(artifacts("smollm2", "auto"))
    nodes, _ = _node_dtypes(art.model_file)
    assert all(nodes[la.index] == {("CacheWrite", "auto"), ("PagedAttention", "auto")}
               for la in art.spec.layers)  # fmt: skip
    assert (art.path / "tokenizer.json").is_file() or (art.path / "tokenizer_config.json").is_file()
    assert (art.path / "generation_config.json").is_file()


def test_build_from_hf_directory(tmp_path):
    from tqexport.models.loader import load_model

    lm = load_model("tiny-qwen3")
    src = tmp_path / "hf-model"
    lm.model.save_pretrained(src)
    art = build_artifact(str(src), tmp_path / "art", BuildRequest(kv_cache_dtype="fp8_e4m3"))
    spec = open_artifact(art.out_dir).spec
    assert spec.model["architecture"] == "Qwen3ForCausalLM" and spec.model["path"] == str(src)
    assert run_parity(open_artifact(art.out_dir), steps=1, prompt_len=10, batch=2).ok


@pytest.mark.parametrize("dtype", ["auto", "turboquant_4bit_nc"])
def test_float16_artifacts_run_on_ort_cpu(artifacts, dtype):
    art = open_artifact(artifacts("tiny-llama", dtype, (), dtype="float16"))
    assert art.spec.dtype == "float16"
    assert run_parity(art, steps=2, prompt_len=16, batch=2).ok
