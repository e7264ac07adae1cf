"""Recent window (--kv-recent-window N): the last N tokens of every quantized layer also kept
in the model dtype. N = 0 is exactly the plain design; the quantized cache still gets every
token; attention reads positions > q - N from the recent cache."""

import json

import pytest
import torch
from helpers import (
    assert_greedy,
    assert_same_generation,
    assert_same_run,
    prefill_chunks,
    serve_on_torch,
    teacher_forced,
)

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.kvplan.resolve import ResolveError, resolve
from tqexport.models.loader import load_model
from tqexport.ops import reference
from tqexport.runtime.executor import Executor
from tqexport.runtime.sequence import SamplingParams
from tqexport.spec import BuildRequest, SpecError, spec_from_dict, spec_from_json
from tqexport.verify.parity import run_parity


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama", "float32")


TOKENS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def test_zero_window_spec_is_exactly_the_plain_spec():
    from tqexport.models.config import describe_model

    desc = describe_model("tiny-gemma2", None)
    plain = resolve(desc, BuildRequest("turboquant_4bit_nc"))
    zero = resolve(desc, BuildRequest("turboquant_4bit_nc", recent_window=0))
    assert zero.spec.to_json() == plain.spec.to_json()
    assert "recent" not in plain.spec.to_json()
    assert zero.spec.graph_io() == plain.spec.graph_io()


def test_plan_gives_each_quantized_layer_a_recent_cache_in_its_own_group():
    from tqexport.models.config import describe_model

    desc = describe_model("tiny-gemma2", None)  # sliding(8) / full alternating
    spec = resolve(desc, BuildRequest("fp8", ["0"], recent_window=32)).spec
    assert [la.recent_window for la in spec.layers] == [0, 32, 8, 32, 8, 32]
    recent = {g.window: g for g in spec.groups if g.recent}
    assert recent[32].layers == (1, 3, 5) and recent[8].layers == (2, 4)
    la = spec.layer(1)
    assert [r for r, _, _ in la.cache_tensors] == ["k", "v", "recent_k", "recent_v"]
    assert la.recent.kv_cache_dtype == "auto" and la.recent.model_dtype == spec.dtype
    assert la.page_size_bytes == la.cache.page_size_bytes + 16 * 2 * 64 * 4 * 2
    names = [x["name"] for x in spec.graph_io()["inputs"]]
    assert names.index("cache.1.recent_k") == names.index("cache.1.v") + 1
    assert spec_from_json(spec.to_json()) == spec
    d = json.loads(spec.to_json())
    d["layers"][1]["recent"]["window"] = 16
    with pytest.raises(SpecError, match="recent-window group"):
        spec_from_dict(d)
    with pytest.raises(TQExportError, match="--kv-recent-window must be from 0 to 1048576, got -1"):
        BuildRequest("fp8", recent_window=-1)
    with pytest.raises(ResolveError, match="--kv-recent-window 8 has no effect: --kv-cache-dtype"):
        resolve(desc, BuildRequest("auto", recent_window=8))


def test_window_covering_the_context_reads_only_full_precision(llama):
    spec = resolve(llama.description, BuildRequest("turboquant_4bit_nc", boundary=False)).spec
    covered = resolve(
        llama.description, BuildRequest("turboquant_4bit_nc", boundary=False, recent_window=64)
    )
    auto = resolve(llama.description, BuildRequest("auto")).spec
    quantized = prefill_chunks(llama, spec, TOKENS, 40)
    covered_run = prefill_chunks(llama, covered.spec, TOKENS, 40)
    got, r_caches = covered_run.logits, covered_run.caches
    want = prefill_chunks(llama, auto, TOKENS, 40).logits
    assert torch.equal(got, want)  # every key read from the model-dtype cache
    assert (quantized.logits - want).abs().max() > 1e-2  # while the quantized path differs
    # the quantized cache still receives every token, encoded exactly as without the window
    assert torch.equal(r_caches["cache.0.kv"], quantized.caches["cache.0.kv"])  # same bytes
    slots = torch.arange(16, 56)  # blocks 1.. contiguous
    for la in covered.spec.layers:
        k, v = covered_run.kv[la.index]
        empty = [torch.zeros_like(r_caches[la.onnx_input("kv")])]
        want_bytes = reference.write_cache(la.cache.codec, empty, k, v, slots)[0]
        assert torch.equal(r_caches[la.onnx_input("kv")], want_bytes), la.index
        assert torch.equal(r_caches[la.onnx_input("recent_k")][1:4].flatten(0, 1)[:40], k)


@pytest.mark.parametrize("dtype", ["turboquant_k3v4_nc", "fp8", "int4_per_token_head"])
def test_recent_window_is_chunking_invariant_and_between_plain_and_quantized(llama, dtype):
    spec = resolve(llama.description, BuildRequest(dtype, boundary=False, recent_window=8)).spec
    whole = prefill_chunks(llama, spec, TOKENS, 40)
    for chunk in (7, 1):
        assert_same_run(spec, prefill_chunks(llama, spec, TOKENS, chunk), whole)
    whole = whole.logits
    plain = prefill_chunks(
        llama, resolve(llama.description, BuildRequest(dtype, boundary=False)).spec, TOKENS, 40
    )
    auto = prefill_chunks(llama, resolve(llama.description, BuildRequest("auto")).spec, TOKENS, 40)
    # the first 8 positions see only recent keys: exactly the unquantized result
    torch.testing.assert_close(whole[:8], auto.logits[:8], atol=1e-5, rtol=1e-5)
    assert (whole[8:] - plain.logits[8:]).abs().max() > 1e-3  # later ones mix both caches


def test_executor_recycles_recent_blocks_and_matches_contiguous_prefill(llama):
    """Served through the block manager (window blocks recycled through the null block), a
    long generation equals a prefill of the same tokens with contiguous tables."""
    spec = resolve(
        llama.description, BuildRequest("turboquant_4bit_nc", boundary=False, recent_window=8)
    ).spec
    ex, seq = serve_on_torch(llama, spec, TOKENS[:20])
    recent_group = next(g.id for g in spec.groups if g.recent)
    assert ex.group_num_blocks[recent_group] == 1 + 2 * (1 + 2) + 1 < 16
    assert len(seq.output) == 40
    tokens = seq.prompt + seq.output
    logits = prefill_chunks(llama, spec, tokens[:-1], 59, num_blocks=8).logits
    assert assert_greedy(logits[19:], seq.output) > 30


@pytest.mark.parametrize(
    "model,dtype,skip,sink",
    [("tiny-llama", "turboquant_4bit_nc", [], 5), ("tiny-gemma2", "fp8", ["1"], 0)],
)
def test_onnx_artifact_with_recent_window_matches_reference(artifacts, model, dtype, skip, sink):
    """The graph (ORT) against the reference, through the block manager: a recent window, and
    for tiny-llama 5 sink tokens too (each sequence's first block kept past the window)."""
    kw = {"sink_tokens": sink} if sink else {}
    art = open_artifact(artifacts(model, dtype, skip, recent_window=8, **kw))
    assert any(la.recent_window for la in art.spec.layers)
    assert art.spec.sink_tokens == sink
    report = run_parity(art, steps=12, prompt_len=20, batch=3)
    assert report.ok, [c for c in report.layers if not c.ok]  # cache bytes and attention
    ort = Executor(art, "ort", num_blocks=24, max_num_seqs=3)
    torch_ex = Executor(art, "torch", num_blocks=24, max_num_seqs=3)
    params = SamplingParams(max_tokens=24, ignore_stop=True)
    ps = [TOKENS[:11], TOKENS[:3], TOKENS[5:30]]
    outputs = list(zip(ps, ort.generate(ps, params), torch_ex.generate(ps, params)))
    module = torch_ex.backend.module
    module.mode = "functional"
    for p, a, b in outputs:
        logits = teacher_forced(module, art.spec, p, a.output)
        assert assert_greedy(logits, a.output) > 0
        assert_same_generation(logits, a.output, b.output)
