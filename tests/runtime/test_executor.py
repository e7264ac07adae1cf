"""The executor: per-layer caches from the spec, scheduling, preemption, sampling, backends."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import (
    MATRIX_DTYPES,
    TWO_THREAD_DTYPES,
    assert_greedy,
    assert_same_generation,
    at_accuracy,
    teacher_forced,
    with_byte_tokenizer,
)

from tqexport.contract.artifact import open_artifact
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.errors import TQExportError
from tqexport.models.paged import PagedCausalLM
from tqexport.runtime.backends.ort import OrtBackend
from tqexport.runtime.executor import Executor
from tqexport.runtime.sampling import sample
from tqexport.runtime.sequence import SamplingParams
from tqexport.validate import parse_memory

GREEDY32 = SamplingParams(max_tokens=32)


def prompts(n=8, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 30, 9, 40, 3, 22, 11][:n]
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def reference_module(art):
    """The torch reference of an artifact, run functionally for teacher forcing."""
    module = Executor(art, "torch", num_blocks=2).backend.module
    module.mode = "functional"
    return module


@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
def test_greedy_ort_agrees_with_torch_reference(artifacts, dtype):
    """ORT (at 1 thread, and 2 for one dtype per codec path: two summation orders) and the
    torch backend generate what the reference predicts, and the same tokens up to a near tie."""
    art = open_artifact(artifacts("tiny-llama", dtype))
    ps = prompts(3)
    torch_ex = Executor(art, "torch", num_blocks=32)
    torch_out = [s.output for s in torch_ex.generate(ps, GREEDY32)]
    module = torch_ex.backend.module
    module.mode = "functional"
    for p, t in zip(ps, torch_out):
        assert_greedy(teacher_forced(module, art.spec, p, t), t)
    for threads in (1, 2) if dtype in TWO_THREAD_DTYPES else (1,):
        ort_ex = Executor(art, "ort", num_blocks=32, threads=threads)
        for p, o, t in zip(ps, [s.output for s in ort_ex.generate(ps, GREEDY32)], torch_out):
            assert len(o) == 32
            logits = teacher_forced(module, art.spec, p, o)
            assert assert_greedy(logits, o) > 0
            assert_same_generation(logits, o, t)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["auto", "turboquant_4bit_nc"])
def test_continuous_batch_equals_each_prompt_alone(artifacts, dtype, threads):
    art = open_artifact(artifacts("tiny-gemma2", dtype))
    ps = prompts(8)
    ex = Executor(art, "ort", num_blocks=64, max_num_batched_tokens=48, threads=threads)
    batched = [s.output for s in ex.generate(ps, GREEDY32)]
    assert ex.steps > 32  # prompts were chunked and joined while others decoded
    alone = [
        Executor(art, "ort", num_blocks=64, threads=threads).generate([p], GREEDY32)[0].output
        for p in ps
    ]
    assert_same_generations(art, ps, alone, batched)


def assert_same_generations(art, ps, alone, other):
    """Each prompt's output equals its output alone, up to a near tie of the reference."""
    module = reference_module(art)
    for p, a, b in zip(ps, alone, other):
        assert_same_generation(teacher_forced(module, art.spec, p, a), a, b)


def test_small_budget_preempts_and_rejects_too_long_prompt(artifacts):
    art = open_artifact(artifacts("tiny-gemma2", "turboquant_4bit_nc"))
    ps = prompts(8)
    alone = [Executor(art, "ort", num_blocks=64).generate([p], GREEDY32)[0].output for p in ps]
    ex = Executor(art, "ort", num_blocks=12, max_num_batched_tokens=32)
    seqs = ex.generate(ps + [list(range(200))], GREEDY32)
    assert_same_generations(art, ps, alone, [s.output for s in seqs[:-1]])
    assert sum(s.preemptions for s in seqs) > 0
    assert seqs[-1].output == [] and "does not fit in the whole cache" in seqs[-1].finish_reason
    assert ex.blocks.used_blocks() == [0, 0]  # everything freed


def test_sliding_window_blocks_are_recycled_to_other_sequences(artifacts):
    art = open_artifact(artifacts("tiny-gemma2", "auto"))
    sliding = next(g.id for g in art.spec.groups if g.window)
    ex = Executor(art, "ort", num_blocks=9, max_num_batched_tokens=16)
    ps = prompts(4, seed=5)
    for p in ps:
        ex.add_request(p, SamplingParams(max_tokens=40))
    owners: dict[int, set[int]] = {}
    nulls = 0
    while not ex.scheduler.idle:
        ex.step()
        for seq in ex.scheduler.running:
            table = seq.block_tables[sliding]
            nulls += table.count(0)
            for b in table:
                if b:
                    owners.setdefault(b, set()).add(seq.id)
    assert nulls > 0  # blocks that left the window were replaced by the null block
    assert any(len(ids) > 1 for ids in owners.values())  # and handed to another sequence
    alone = [
        Executor(art, "ort", num_blocks=64).generate([p], SamplingParams(max_tokens=40))[0].output
        for p in ps
    ]
    batched = [s.output for s in sorted(ex.scheduler.running + [], key=lambda s: s.id)]
    assert batched == []  # all finished
    again = Executor(art, "ort", num_blocks=9, max_num_batched_tokens=16)
    recycled = [s.output for s in again.generate(ps, SamplingParams(max_tokens=40))]
    assert_same_generations(art, ps, alone, recycled)


def test_caches_update_in_place_and_bit_identical(artifacts):
    art = open_artifact(artifacts("tiny-llama", "turboquant_k3v4_nc"))
    spec = art.spec
    bound, copied = OrtBackend(art, 8, in_place=True), OrtBackend(art, 8, in_place=False)
    ptrs = {n: a.ctypes.data for n, a in bound.caches.items()}
    tables = [[1, 2]] * len(spec.groups)
    for step in (
        build_step(spec, [SeqChunk(list(range(10)), 0, tables)]),
        build_step(spec, [SeqChunk([3], 10, tables)]),
    ):
        la, lb = bound.run(step), copied.run(step)
        assert torch.equal(la, lb)
        for n, ptr in ptrs.items():
            assert bound.last_output_ptrs[n.replace("cache.", "cache_out.", 1)] == ptr
            assert bound.caches[n].ctypes.data == ptr
            assert np.array_equal(bound.caches[n], copied.caches[n])
    assert bound.caches["cache.0.kv"][1].any()  # the bound buffer itself was written


@pytest.mark.parametrize("in_place", [True, False])
def test_a_node_failing_at_run_time_is_our_error_with_orts_message_and_no_log_line(
    artifacts, capfd, in_place
):
    """ORT's coloured "[E:onnxruntime:...]" line never reaches stderr: its message is ours."""
    art = open_artifact(artifacts("tiny-llama", "fp8"))
    backend = OrtBackend(art, 8, in_place=in_place, kernels="bodies")
    step = build_step(art.spec, [SeqChunk([1, 2, 3], 0, [[1]] * len(art.spec.groups))])
    step["slot_mapping_0"] = step["slot_mapping_0"] + 10**6  # past the cache: ScatterND fails
    capfd.readouterr()
    with pytest.raises(TQExportError) as e:
        backend.run(step)
    assert str(e.value).startswith("ONNX Runtime failed in a step: Non-zero status code ")
    assert "ScatterND" in str(e.value) and "invalid indice found" in str(e.value)
    assert "\n" not in str(e.value) and "[ONNXRuntimeError]" not in str(e.value)
    assert capfd.readouterr().err == ""


def test_sampling_is_per_request_and_seeded(artifacts):
    art = open_artifact(artifacts("tiny-llama", "fp8"))
    p = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    ps = prompts(4)
    alone = Executor(art, "ort", num_blocks=32).generate([ps[0]], p)[0].output
    with_others = Executor(art, "ort", num_blocks=32).generate(
        ps, [p] + [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(3)]
    )
    assert with_others[0].output == alone
    other_seed = Executor(art, "ort", num_blocks=32).generate(
        [ps[0]], SamplingParams(12, 0.8, 50, 0.9, 8)
    )
    assert other_seed[0].output != alone


def test_sample_top_k_top_p():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0, 4.8])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=0.0), g) == 1
    got = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert got == {1, 2}
    got = {sample(logits, SamplingParams(temperature=1.0, top_p=0.01), g) for _ in range(50)}
    assert got == {1}
    got = {sample(logits, SamplingParams(temperature=1.0, top_p=0.6), g) for _ in range(300)}
    assert got == {1, 2}  # 1 alone holds ~36% of the mass, 1+2 ~69%


def test_stop_tokens_end_requests(artifacts):
    art = open_artifact(artifacts("tiny-llama", "auto"))
    p = prompts(1)[0]
    free = Executor(art, "ort", num_blocks=32).generate([p], GREEDY32)[0].output
    stop = SamplingParams(max_tokens=32, stop_token_ids=(free[5],))
    seq = Executor(art, "ort", num_blocks=32).generate([p], stop)[0]
    assert seq.finish_reason == "stop" and seq.output == free[: free.index(free[5]) + 1]


def test_parse_memory():
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("1000") == 1000


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqexport", *args], capture_output=True, text=True, timeout=900
    )


def test_inspect_json(artifacts):
    path = artifacts("tiny-gemma2", "turboquant_4bit_nc", ["sw"])
    r = cli("inspect", str(path), "--num-blocks", "10", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    layers = data["layers"]
    assert [la["kv_cache_dtype"] for la in layers] == ["auto", "turboquant_4bit_nc"] * 3
    assert all(la["blocks"] == 10 for la in layers)
    assert layers[1]["bytes"] == 10 * 16 * 2 * 70
    assert data["summary"]["total_bytes"] == sum(la["bytes"] for la in layers)
    assert [g["window"] for g in data["groups"]] == [None, 8]


def test_smollm2_greedy_matches_transformers_generate(artifacts):
    from transformers import AutoTokenizer

    from tqexport.models.loader import load_model

    path = artifacts("smollm2", "auto")
    art = open_artifact(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    # accuracy level 0: the 4-bit weights in float32 products, as transformers computes them
    ours = Executor(at_accuracy(art, 0), "ort", num_blocks=16).generate(
        [ids], SamplingParams(max_tokens=32, ignore_stop=True)
    )[0]
    lm = load_model("smollm2")
    with torch.no_grad():
        ref = lm.model.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )[0, len(ids) :].tolist()
    pm = PagedCausalLM(lm.model, art.spec, mode="functional")
    logits = teacher_forced(pm, art.spec, ids, ours.output)
    assert assert_greedy(logits, ours.output) > 20
    assert_same_generation(logits, ours.output, ref)


def test_run_cli_json_and_stream(artifacts, tmp_path):
    """`run` end to end (a subprocess): tiny Llama with a byte-level tokenizer and chat
    template (SmolLM2 is served by `make demo` and the transformers test above)."""
    path = with_byte_tokenizer(artifacts("tiny-llama", "turboquant_k3v4_nc"), tmp_path / "art")
    r = cli("run", str(path), "--prompt", "What is 2+2?", "--max-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    res = data["results"][0]
    assert 1 <= len(res["token_ids"]) <= 12 and res["text"].strip()
    assert data["summary"]["requests"] == 1 and data["summary"]["peak_kv_bytes"] > 0
    r = cli("run", str(path), "--prompt", "Say hello.", "--max-tokens", "8")
    assert r.returncode == 0 and r.stdout.strip() and "tokens/s" in r.stderr
    r = cli("run", str(path))
    assert r.returncode == 2 and "exactly one of --prompt" in r.stderr


class _BytesTokenizer:
    """Decodes token ids as raw UTF-8 bytes, like a byte-level BPE mid-character."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streaming_never_splits_a_utf8_character():
    from tqexport.runtime.text import StreamDecoder

    data = list("héllo €!".encode())
    dec = StreamDecoder(_BytesTokenizer())
    pieces = [dec.push(data[: i + 1]) for i in range(len(data))]
    assert "".join(pieces) == "héllo €!"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # the two bytes of é arrive as one piece


def test_run_prompts_file_is_one_continuous_batch(artifacts, tmp_path):
    path = with_byte_tokenizer(artifacts("tiny-llama", "turboquant_k3v4_nc"), tmp_path / "art")
    f = tmp_path / "prompts.txt"
    f.write_text("Name a fruit.\n\nName a colour.\nCount to three.\n")
    r = cli("run", str(path), "--prompts-file", str(f), "--max-tokens", "6", "--json",
            "--no-chat-template")  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [x["prompt"] for x in data["results"]] == [
        "Name a fruit.",
        "Name a colour.",
        "Count to three.",
    ]
    assert data["summary"]["requests"] == 3
    assert data["summary"]["peak_kv_bytes_bf16_equivalent"] > data["summary"]["peak_kv_bytes"]


# --- issue 13: the library validates completely, with the CLI's one-line errors ---


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(top_p=0.0), "top_p must be > 0 and <= 1"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(max_tokens=True), "max_tokens must be an integer"),
        (dict(seed=2**64), "seed must be from 0 to 18446744073709551615"),
        (dict(seed=-1), "seed must be from 0"),
        (dict(stop_token_ids=("2",)), "stop_token_ids must be an integer"),
    ],
)
def test_sampling_params_validate_completely(kwargs, message):
    from tqexport.errors import TQExportError

    with pytest.raises(TQExportError, match=message.replace("(", r"\(")):
        SamplingParams(**kwargs)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # what torch's generator takes


def test_parse_memory_refuses_malformed_and_zero():
    from tqexport.errors import TQExportError

    assert parse_memory("1.5GiB") == 3 * 2**29 and parse_memory("2TB") == 2 * 10**12
    for bad in ("", "lots", "12XB", "-5MiB", "1e9", "1" * 40):
        with pytest.raises(TQExportError, match="cannot read"):
            parse_memory(bad)
    with pytest.raises(TQExportError, match="must be a positive size"):
        parse_memory("0MiB")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_num_seqs=0), "--max-num-seqs must be from 1"),
        (dict(max_num_seqs=-1), "--max-num-seqs must be from 1"),
        (dict(max_num_batched_tokens=0), "--max-num-batched-tokens must be from 1"),
        (dict(num_blocks=1), "--num-blocks must be from 2"),
        (dict(num_blocks=None, kv_cache_memory="0"), "must be a positive size"),
        (dict(backend="cuda"), "backend must be one of ort, torch, trt"),
        (dict(threads=0), r"threads must be from 1 to \d+, got 0"),
        (dict(max_model_len=0), "max_model_len must be >= 1"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be from 0"),
    ],
)
def test_executor_validates_before_allocating(artifacts, kwargs, message):
    from tqexport.errors import TQExportError

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    with pytest.raises(TQExportError, match=message):
        Executor(art, **{"num_blocks": 8, **kwargs})


def test_resolve_num_blocks_validates_what_inspect_reports(artifacts):
    from tqexport.errors import TQExportError
    from tqexport.runtime.memory import resolve_num_blocks

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    with pytest.raises(TQExportError, match="--max-num-seqs must be from 1"):
        resolve_num_blocks(art, None, "512MiB", max_num_seqs=-1)
    with pytest.raises(TQExportError, match="--num-blocks must be from 2"):
        resolve_num_blocks(art, 0, None)
    with pytest.raises(TQExportError, match="cannot read"):
        resolve_num_blocks(art, None, "lots")


def test_executor_refuses_caches_beyond_the_memory_limit(artifacts):
    from tqexport.errors import TQExportError
    from tqexport.runtime.memory import block_bytes, resolve_num_blocks

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    with pytest.raises(TQExportError, match="--num-blocks 1000 needs .* more than this machine"):
        resolve_num_blocks(art, 1000, None, memory_limit=999 * block_bytes(art))
    assert resolve_num_blocks(art, 1000, None, memory_limit=1000 * block_bytes(art)) == [1000]


def test_executor_rejects_prompts_beyond_the_position_limit(artifacts):
    art = open_artifact(artifacts("tiny-llama", "fp8"))
    ex = Executor(art, "ort", num_blocks=32, max_model_len=40)
    fits, too_long, no_room = ex.generate(
        [[1] * 30, [1] * 41, [1] * 36], [SamplingParams(max_tokens=10, ignore_stop=True)] * 3
    )
    assert len(fits.output) == 10 and fits.finish_reason == "length"
    assert too_long.output == [] and too_long.finish_reason == (
        "rejected: a prompt of 41 tokens exceeds the model's position limit of 40 tokens "
        "(max_position_embeddings)"
    )
    assert no_room.finish_reason.startswith("rejected: a prompt of 36 tokens plus max_tokens 10")


def test_score_steps_stream_one_prefill_step_at_a_time(artifacts):
    """score_steps yields each prefill step's rows (steps of max_num_batched_tokens); together
    they are score(), and the blocks come back whether the steps are read to the end or not."""
    art = open_artifact(artifacts("tiny-llama", "turboquant_4bit_nc"))
    ex = Executor(art, "torch", num_blocks=16, max_num_batched_tokens=16)
    ids = prompts(5)[4]  # 40 tokens: steps of 16, 16 and 8
    steps = list(ex.score_steps(ids))
    assert [s.shape[0] for s in steps] == [16, 16, 8] and ex.blocks.used_blocks() == [0]
    assert torch.equal(torch.cat(steps), ex.score(ids))
    partial = ex.score_steps(ids)
    next(partial)
    assert ex.blocks.used_blocks() == [-(-16 // art.spec.block_size)]  # the first step's
    partial.close()
    assert ex.blocks.used_blocks() == [0] and ex.scheduler.idle
