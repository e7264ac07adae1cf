"""The engine API, and the scheduler and block manager under it driven directly."""

import pytest
import torch
from helpers import with_byte_tokenizer

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.runtime.blocks import BlockManager
from tqexport.runtime.engine import Engine, EngineConfig, cache_token_limit
from tqexport.runtime.executor import Executor
from tqexport.runtime.sampling import sample
from tqexport.runtime.scheduler import Scheduler
from tqexport.runtime.sequence import SamplingParams, Sequence, Status
from tqexport.spec import CacheGroup

FULL = CacheGroup(0, None, 4, (0,))
SLIDING = CacheGroup(1, 8, 4, (1,))


def seq(i, n, max_tokens=8):
    return Sequence(i, list(range(n)), SamplingParams(max_tokens=max_tokens))


def ran(batch, token=7):
    """What the executor does after a step: cache the computed tokens, sample one per sequence
    whose prompt is done."""
    for s, n in batch:
        s.num_cached += n
        if s.num_cached == s.num_tokens:
            s.output.append(token)


def test_blocks_are_allocated_on_demand_and_freed():
    bm = BlockManager((FULL,), 6)
    s = seq(0, 9)
    assert bm.can_grow(s, 20) and not bm.can_grow(s, 21)  # 5 usable blocks of 4 tokens
    bm.grow(s, 9)
    assert s.block_tables == [[1, 2, 3]] and bm.used_blocks() == [3]
    bm.grow(s, 12)  # still inside block 3
    assert s.block_tables == [[1, 2, 3]]
    bm.free(s)
    assert s.block_tables == [] and bm.used_blocks() == [0]
    assert list(bm.groups[0].free) == [4, 5, 1, 2, 3]


def test_sliding_window_blocks_go_back_to_the_free_list():
    bm = BlockManager((FULL, SLIDING), 10)
    s = seq(0, 20)
    bm.grow(s, 20)
    assert s.block_tables == [[1, 2, 3, 4, 5]] * 2
    s.num_cached = 20  # the next query (position 20) sees positions > 12 only
    bm.grow(s, 24)
    assert s.block_tables == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 4, 5, 6]]
    assert bm.used_blocks() == [6, 3]
    assert cache_token_limit(bm) == 36  # the full group: 9 blocks of 4
    assert bm.fits_ever(36) and not bm.fits_ever(37)
    assert cache_token_limit(BlockManager((SLIDING,), 10)) is None  # 4 live blocks at most


def test_admission_rejects_a_prompt_that_never_fits():
    sched = Scheduler(BlockManager((FULL,), 4), 64, 8)  # 12 tokens in all
    too_long, fits = seq(0, 12), seq(1, 11)
    sched.add(too_long)
    sched.add(fits)
    assert too_long.status is Status.FINISHED
    assert too_long.finish_reason == (
        "rejected: a prompt of 12 tokens does not fit in the whole cache (3 blocks of 4 tokens)"
    )
    assert list(sched.waiting) == [fits]


def test_schedule_chunks_prefill_under_the_token_budget_and_caps_sequences():
    sched = Scheduler(BlockManager((FULL,), 32), max_num_batched_tokens=10, max_num_seqs=2)
    a, b, c = seq(0, 6), seq(1, 6), seq(2, 3)
    for s in (a, b, c):
        sched.add(s)
    first = sched.schedule()
    assert first == [(a, 6), (b, 4)]  # b's prefill is chunked, c waits for the budget
    ran(first)
    second = sched.schedule()
    assert second == [(a, 1), (b, 2)]  # a decodes, b finishes its prompt; c: 2 seqs at most
    assert list(sched.waiting) == [c]


def test_long_prefill_threshold_caps_prompt_tokens_only_while_others_decode():
    sched = Scheduler(BlockManager((FULL,), 64), 64, 8, long_prefill_token_threshold=5)
    a, b, c = seq(0, 3, max_tokens=30), seq(1, 20), seq(2, 9)
    sched.add(a)
    first = sched.schedule()
    assert first == [(a, 3)]  # nothing decodes yet: a's prompt runs whole
    ran(first)
    sched.add(b)
    sched.add(c)
    second = sched.schedule()
    assert second == [(a, 1), (b, 5)]  # a decodes: 5 prompt tokens in all, c waits
    ran(second)
    third = sched.schedule()
    assert third == [(a, 1), (b, 5)]
    ran(third)
    sched.abort(a)  # nothing decodes: b and c take whole chunks again
    assert sched.schedule() == [(b, 10), (c, 9)]


def test_long_prefill_threshold_shares_its_tokens_between_prompts():
    sched = Scheduler(BlockManager((FULL,), 64), 64, 8, long_prefill_token_threshold=6)
    a, b, c = seq(0, 1, max_tokens=30), seq(1, 4), seq(2, 7)
    sched.add(a)
    ran(sched.schedule())
    sched.add(b)
    sched.add(c)
    batch = sched.schedule()
    assert batch == [(a, 1), (b, 4), (c, 2)]
    ran(batch)
    assert sched.schedule() == [(a, 1), (b, 1), (c, 5)]  # b decodes now, c goes on


def test_preemption_takes_the_newest_running_request_first():
    sched = Scheduler(BlockManager((FULL,), 4), 64, 8)  # 3 usable blocks
    a, b, c = seq(0, 4), seq(1, 4), seq(2, 4)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch == [(a, 4), (b, 4), (c, 4)]
    ran(batch)
    # each needs a second block now: c (newest) goes first, then b, which was next in line
    assert sched.schedule() == [(a, 1)]
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    assert (b.preemptions, c.preemptions, sched.num_preemptions) == (1, 1, 2)
    assert (b.num_cached, b.block_tables, b.status) == (0, [], Status.WAITING)
    assert a.block_tables == [[1, 3]]


def test_abort_frees_blocks_at_once_running_or_waiting():
    bm = BlockManager((FULL,), 8)
    sched = Scheduler(bm, 64, 1)
    a, b = seq(0, 9), seq(1, 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert bm.used_blocks() == [3] and list(sched.waiting) == [b]
    sched.abort(a)
    assert bm.used_blocks() == [0] and sched.running == [] and a.finish_reason == "abort"
    sched.abort(b, "stop")
    assert list(sched.waiting) == [] and b.status is Status.FINISHED and b.finish_reason == "stop"
    sched.abort(b)  # finished already: left alone
    assert b.finish_reason == "stop" and sched.idle


def test_engine_config_checks_and_defaults(artifacts):
    assert EngineConfig().memory == "512MiB" and EngineConfig(num_blocks=8).memory is None
    assert EngineConfig(kv_cache_memory="1MiB").memory == "1MiB"
    with pytest.raises(TQExportError, match="not both"):
        EngineConfig(num_blocks=8, kv_cache_memory="1MiB")
    with pytest.raises(TQExportError, match="--backend must be one of ort, torch, trt"):
        EngineConfig(backend="tpu")
    with pytest.raises(TQExportError, match="--max-num-seqs must be from 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(TQExportError, match=r"--threads must be from 1 to \d+, got 0"):
        EngineConfig(threads=0)
    with pytest.raises(TQExportError, match="--long-prefill-token-threshold must be from 0"):
        EngineConfig(long_prefill_token_threshold=-1)
    assert EngineConfig().long_prefill_token_threshold == 0
    art = open_artifact(artifacts("tiny-llama", "turboquant_4bit_nc"))
    assert EngineConfig(num_blocks=8).group_blocks(art) == [8]


@pytest.fixture(scope="module")
def tiny(artifacts):
    return artifacts("tiny-llama", "turboquant_4bit_nc")


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine.from_artifact(tiny, EngineConfig(num_blocks=64))


@pytest.fixture(scope="module")
def texty(tiny, tmp_path_factory):
    """The tiny artifact with a byte-level tokenizer and chat template."""
    path = with_byte_tokenizer(tiny, tmp_path_factory.mktemp("texty") / "art")
    return Engine.from_artifact(path, EngineConfig(num_blocks=64))


PROMPTS = [[5, 9, 200, 3], list(range(30, 70)), [17] * 11]


def test_generate_equals_the_executor(engine, tiny):
    ours = engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    ex = Executor(open_artifact(tiny), num_blocks=64)
    theirs = ex.generate(PROMPTS, SamplingParams(max_tokens=16, stop_token_ids=(2,)))
    assert engine.eos_token_ids == (2,)  # the generation config's eos
    assert [c.token_ids for c in ours] == [s.output for s in theirs]
    assert [c.prompt_token_ids for c in ours] == PROMPTS
    want = ["stop" if s.finish_reason == "stop" else "length" for s in theirs]
    assert [c.finish_reason for c in ours] == want
    assert [c.text for c in ours] == ["", "", ""]  # no tokenizer: token ids only
    assert not engine.has_unfinished() and engine.executor.blocks.used_blocks() == [0]


def test_admission_fails_at_add_request(engine, tiny):
    small = Engine.from_artifact(tiny, EngineConfig(num_blocks=8))  # 7 blocks of 16 tokens
    assert (small.max_model_len, small.max_cache_tokens, small.max_seq_len) == (512, 112, 112)
    cases = [
        (engine, [], 4, "empty prompt"),
        (engine, [256], 4, r"prompt token ids must be in \[0, 256\)"),
        (engine, [-1, 4], 4, r"prompt token ids must be in \[0, 256\)"),
        (engine, [1.5], 4, "prompt token ids must be an integer"),
        (
            engine,
            [1] * 500,
            13,
            "500 tokens plus max_tokens 13 exceeds the model's position limit of 512",
        ),
        (
            engine,
            [1] * 512,
            1,
            "512 tokens exceeds the model's position limit of 512 tokens \\(max_pos",
        ),
        (
            small,
            [1] * 112,
            1,
            r"a prompt of 112 tokens does not fit in the whole cache \(7 blocks of 16",
        ),
        (small, [1] * 100, 13, r"does not fit in the whole KV cache \(112 tokens"),
        (engine, "hello", 4, "has no tokenizer"),
        (engine, 7, 4, "a prompt is text, a list of token ids or a list of chat messages"),
    ]
    for eng, prompt, n, message in cases:
        with pytest.raises(TQExportError, match=message):
            eng.add_request(prompt, SamplingParams(max_tokens=n))
    with pytest.raises(TQExportError, match="stop strings need a tokenizer"):
        engine.add_request([1], stop=["x"])
    for eng in (engine, small):
        assert not eng.has_unfinished() and eng.executor.scheduler.idle
    # exactly the whole cache: admitted, and runs to the end without preemption
    outs = run_all(small, [1] * 100, SamplingParams(max_tokens=12), ignore_eos=True)
    assert outs[-1].num_output_tokens == 12 and outs[-1].finish_reason == "length"
    assert small.executor.scheduler.num_preemptions == 0


def test_abort_frees_the_requests_blocks_at_once(engine):
    a = engine.add_request(list(range(20)), SamplingParams(max_tokens=50), ignore_eos=True)
    b = engine.add_request(list(range(40)), SamplingParams(max_tokens=50), ignore_eos=True)
    first = engine.step()  # both prompts fit in one step: blocks for 20 and 40 tokens
    assert [(o.request_id, len(o.new_token_ids)) for o in first] == [(a, 1), (b, 1)]
    assert engine.executor.blocks.used_blocks() == [2 + 3]
    assert engine.abort(b) and not engine.abort(b) and not engine.abort("nope")
    assert engine.executor.blocks.used_blocks() == [2]
    seen = set()
    while engine.has_unfinished():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {a} and engine.executor.blocks.used_blocks() == [0]


def test_abort_a_waiting_request(tiny):
    eng = Engine.from_artifact(tiny, EngineConfig(num_blocks=16, max_num_seqs=1))
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4), ignore_eos=True)
    b = eng.add_request([4, 5, 6], SamplingParams(max_tokens=4), ignore_eos=True)
    eng.step()
    assert len(eng.executor.scheduler.waiting) == 1
    assert eng.abort(b) and len(eng.executor.scheduler.waiting) == 0
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert {o.request_id for o in outs} == {a} and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 4


def run_all(eng, prompt, params, **kw):
    rid = eng.add_request(prompt, params, **kw)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert all(o.request_id == rid for o in outs) and outs[-1].finished
    return outs


def test_text_deltas_and_stop_strings(texty):
    params = SamplingParams(max_tokens=40)
    outs = run_all(texty, "The cat", params, ignore_eos=True, chat_template=False)
    tokens = [t for o in outs for t in o.new_token_ids]
    full = texty.tokenizer.decode(tokens)
    assert len(tokens) == 40 and "".join(o.text for o in outs) == full
    assert outs[-1].finish_reason == "length"
    # the first two characters that occur nowhere earlier: the text must stop right before them
    j = next(j for j in range(1, len(full) - 1) if full.find(full[j : j + 2]) == j)
    stop = full[j : j + 2]
    cut = run_all(texty, "The cat", params, ignore_eos=True, chat_template=False, stop=[stop])
    assert "".join(o.text for o in cut) == full[:j]
    assert all(stop not in o.text for o in cut)
    assert cut[-1].finish_reason == "stop" and cut[-1].num_output_tokens < 40
    assert [t for o in cut for t in o.new_token_ids] == tokens[: cut[-1].num_output_tokens]
    assert texty.executor.blocks.used_blocks() == [0]


def test_prompts_through_the_tokenizer_and_chat_template(texty):
    assert texty.encode("hi") == list(b"<user>hi\n<assistant>")  # the config's chat template
    assert texty.encode("hi", chat_template=False) == list(b"hi")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hé"}]
    assert texty.encode(messages) == list("<system>be brief\n<user>hé\n<assistant>".encode())
    with pytest.raises(TQExportError, match=r"messages\[0\].role must be one of"):
        texty.encode([{"role": "robot", "content": "x"}])
    done = texty.generate([messages], SamplingParams(max_tokens=6))
    assert done[0].prompt_token_ids == texty.encode(messages)
    assert done[0].text == texty.tokenizer.decode(done[0].token_ids)


# --- one request's failure ends that request only; sampling params are checked in float32 ---

GREEDY16 = SamplingParams(max_tokens=16)


def alone_tokens(eng, prompts, params=GREEDY16):
    return [eng.generate([p], params)[0].token_ids for p in prompts]


def test_top_p_that_is_0_in_float32_is_refused_and_cannot_break_sampling(engine):
    """The repro: top_p 1e-300 passed the float64 check, was 0 in float32 and made
    torch.multinomial raise for the whole step."""
    with pytest.raises(TQExportError, match=r"^top_p must be > 0 and <= 1, got 1e-300, which is 0"):
        SamplingParams(temperature=1.0, top_p=1e-300)
    with pytest.raises(TQExportError, match=r"^temperature must be <= 3.40282e\+38, got 1e\+39"):
        SamplingParams(temperature=1e39)
    # params that slipped past the checks: the sampler still keeps the most likely token, so
    # the request is greedy and the others in its batch are untouched
    bad = SamplingParams(max_tokens=16, temperature=1.0)
    object.__setattr__(bad, "top_p", 1e-300)
    rows = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    assert [sample(r, bad, torch.Generator()) for r in rows] == rows.argmax(-1).tolist()
    ex = engine.executor
    want = [ex.generate([p], GREEDY16)[0].output for p in PROMPTS]
    got = ex.generate(PROMPTS + [PROMPTS[0]], [GREEDY16] * 3 + [bad])
    assert [s.output for s in got] == want + want[:1]
    assert [s.finish_reason for s in got] == ["length"] * 4


def test_a_request_whose_sampling_raises_ends_alone(engine, monkeypatch):
    from tqexport.runtime import executor

    want = alone_tokens(engine, PROMPTS + [[7, 7, 7]])
    real, boom = executor.sample, RuntimeError("injected sampling fault")
    calls = {"n": 0}

    def faulty(logits, params, rng):
        if params.seed == 666:
            calls["n"] += 1
            if calls["n"] == 4:  # mid-run: after three tokens of its own
                raise boom
        return real(logits, params, rng)

    monkeypatch.setattr(executor, "sample", faulty)
    victim = SamplingParams(max_tokens=16, seed=666)
    got = engine.generate(PROMPTS + [[7, 7, 7]], [GREEDY16] * 3 + [victim])
    assert [c.token_ids for c in got[:3]] == want[:3]
    assert [c.finish_reason for c in got] == ["length"] * 3 + ["error"]
    assert got[3].error is boom and got[3].token_ids == want[3][:3]
    assert [c.error for c in got[:3]] == [None] * 3
    assert not engine.has_unfinished() and engine.executor.blocks.used_blocks() == [0]


def test_a_request_whose_step_raises_ends_alone_among_running_ones(engine, monkeypatch):
    want = alone_tokens(engine, PROMPTS)
    backend = engine.executor.backend
    real, boom = backend.run, RuntimeError("injected step fault")

    def faulty(step):
        if int((step["input_ids"] == 251).sum()) >= 5:  # only the bad prompt's prefill
            raise boom
        return real(step)

    monkeypatch.setattr(backend, "run", faulty)
    rids = [engine.add_request(p, GREEDY16) for p in PROMPTS]
    outs = engine.step() + engine.step()  # the others are running when it joins
    bad = engine.add_request([251] * 5, GREEDY16)
    done = {rid: [] for rid in rids}
    while engine.has_unfinished():
        outs += engine.step()
    for o in outs:
        if o.request_id != bad:
            done[o.request_id] += o.new_token_ids
    assert [done[r] for r in rids] == want
    failed = [o for o in outs if o.request_id == bad]
    assert [(o.finish_reason, o.error, o.new_token_ids) for o in failed] == [("error", boom, [])]
    assert engine.executor.blocks.used_blocks() == [0]


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(texty, engine, monkeypatch):
    """Prompt characters against the context times the most characters a token can stand for
    (the byte tokenizer: 1, times 4 for normalization); token ids against the context."""
    assert texty.token_chars == (4, 1) and texty.max_seq_len == 512
    monkeypatch.setattr(texty, "encode", lambda *a, **k: pytest.fail("tokenized"))
    for prompt in ("x" * 2049, [{"role": "user", "content": "x" * 2049}]):
        with pytest.raises(TQExportError) as e:
            texty.prompt_ids(prompt)
        assert str(e.value) == (
            "a prompt of 2049 characters cannot fit the model's position limit of 512 tokens: "
            "one token stands for at most 4 characters (the vocabulary's longest entry, 1, "
            "times 4 for normalization), so it needs more than 512 tokens; shorten it"
        )
    with pytest.raises(TQExportError, match="^a prompt of 513 tokens exceeds the model's pos"):
        engine.add_request([1] * 513)
    monkeypatch.undo()
    with pytest.raises(TQExportError, match="a prompt of 2048 tokens exceeds the model's pos"):
        texty.add_request("x" * 2048, chat_template=False)  # within the bound: tokenized
    assert not texty.has_unfinished() and not engine.has_unfinished()
