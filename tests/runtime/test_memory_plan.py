"""The hybrid memory plan: each cache group sized by what it can use, the budget split so that
the full-attention group bounds the batch at the context served, and serving through it."""

import json

import pytest
from helpers import assert_greedy, main_inproc, teacher_forced, with_spec

from tqexport.contract.artifact import open_artifact
from tqexport.runtime.blocks import BlockManager
from tqexport.runtime.executor import Executor
from tqexport.runtime.memory import allocation, max_sequences, resolve_num_blocks
from tqexport.runtime.scheduler import Scheduler
from tqexport.runtime.sequence import SamplingParams, Sequence
from tqexport.spec import CacheGroup

# tiny-gemma3, fp8 with --skip-layers sw, float32, blocks of 16 tokens: group 0 is the full
# layer 5 (fp8: 16 tokens * 2 kv heads * 64 * (K, V) = 4096 bytes a block), group 1 the five
# window-8 layers (float32: 5 * 16 * 2 * 64 * 2 * 4 = 81920 bytes a block). At 512 tokens (its
# position limit) a sequence holds 32 full blocks and at most ceil(8 / 16) + 2 = 3 window
# blocks; one step of 512 tokens adds 32 window blocks at most, and each group has a null block.
FULL_BLOCK, WINDOW_BLOCK = 4096, 81920
MIB4 = 4 * 2**20


@pytest.fixture
def gemma3(artifacts):
    return open_artifact(artifacts("tiny-gemma3", "fp8", ["sw"]))


def seq(i, n, max_tokens=8):
    return Sequence(i, list(range(n)), SamplingParams(max_tokens=max_tokens))


def ran(batch):
    """What the executor does after a step: cache the computed tokens, sample one token per
    sequence whose prompt is done."""
    for s, n in batch:
        s.num_cached += n
        if s.num_cached == s.num_tokens:
            s.output.append(7)


def test_budget_is_split_so_the_full_group_bounds_the_batch(gemma3):
    spec = gemma3.spec
    assert [g.window for g in spec.groups] == [None, 8]
    assert [spec.group_block_bytes(g) for g in spec.groups] == [FULL_BLOCK, WINDOW_BLOCK]
    # sequences of 512 tokens 4 MiB holds: (4 MiB - 33 window blocks - a null full block) //
    # (32 full + 3 window blocks) = 1486848 // 376832 = 3; the full group gets 1 + 3 * 32 = 97
    # blocks, the window group 33 + the rest's 3-block share: 1093632 * 3 // 245760 = 13, 46 in
    # all; the full group then gets what is left: (4 MiB - 46 * 81920) // 4096 = 104
    plan = resolve_num_blocks(gemma3, None, "4MiB", context=512)
    assert plan == [104, 46]
    assert max_sequences(spec, plan, 512) == (3, 0)  # 103 // 32; the window holds 13 // 3 = 4
    equal = MIB4 // (FULL_BLOCK + WINDOW_BLOCK)  # 48: every group alike, as before
    assert resolve_num_blocks(gemma3, None, "4MiB") == [equal, equal]  # no context: no split
    assert max_sequences(spec, [equal, equal], 512) == (1, 0)
    # a context within the window needs as many window blocks as full ones: no split pays
    assert resolve_num_blocks(gemma3, None, "4MiB", context=8) == [equal, equal]
    # --max-num-seqs bounds the split: 2 sequences' window blocks (1 + 2 * 3 + 32 = 39), the
    # rest to the full group: (4 MiB - 39 * 81920) // 4096 = 244
    assert resolve_num_blocks(gemma3, None, "4MiB", max_num_seqs=2, context=512) == [244, 39]


def test_num_blocks_gives_window_groups_only_what_they_can_use(gemma3):
    # 4 sequences of at most 3 live blocks, a step of 32 tokens (2 blocks), the null block
    assert resolve_num_blocks(gemma3, 100, None, max_num_seqs=4, max_num_batched_tokens=32) == [
        100,
        1 + 4 * 3 + 2,
    ]
    assert resolve_num_blocks(gemma3, 10, None, max_num_seqs=4) == [10, 10]  # never more


def test_allocation_reports_the_groups_and_the_sequences_at_the_context(gemma3):
    doc = allocation(gemma3.spec, [104, 46], context=512)
    assert [(g["blocks"], g["bytes"], g["max_blocks_per_seq"]) for g in doc["groups"]] == [
        (103, 104 * FULL_BLOCK, None),
        (45, 46 * WINDOW_BLOCK, 3),
    ]
    s = doc["summary"]
    assert (s["max_seqs_at_context"], s["bound_by"], s["full_attention_tokens"]) == (
        3,
        "group 0",
        103 * 16,
    )
    assert s["total_bytes"] == 104 * FULL_BLOCK + 46 * WINDOW_BLOCK
    assert allocation(gemma3.spec, [104, 46], 512, max_num_seqs=2)["summary"]["bound_by"] == (
        "max_num_seqs"
    )


def test_admission_is_bounded_by_the_full_group(gemma3):
    """Sequences of the planned context hold it 3 at once (the equal split: 1): whenever one
    waits with step tokens to spare, the full group is short of blocks, not the window group."""
    peaks = {}
    for name, plan in (("hybrid", [104, 46]), ("equal", [48, 48])):
        bm = BlockManager(gemma3.spec.groups, plan)
        sched = Scheduler(bm, 512, 64)
        seqs = [seq(i, 500, max_tokens=12) for i in range(5)]
        for s in seqs:
            sched.add(s)
        running, window_free = 0, plan[1]
        for _ in range(200):
            batch = sched.schedule()
            if not batch:
                break
            running = max(running, sum(s.num_cached >= 500 for s in sched.running))
            window_free = min(window_free, len(bm.groups[1].free))
            if sched.waiting and sum(n for _, n in batch) < 512:
                # one waits with tokens to spare: the full group cannot give it its 32 blocks
                assert len(bm.groups[0].free) < 32 <= len(bm.groups[1].free)
            ran(batch)
            for s in list(sched.running):
                if len(s.output) == s.params.max_tokens:
                    sched.finish(s, "length")
        assert sched.idle and all(len(s.output) == 12 for s in seqs)
        peaks[name] = running
        assert window_free > 0
    assert peaks == {"hybrid": 3, "equal": 1}


def test_a_block_leaving_the_window_pays_for_the_next():
    """A window group with no free block still grows a sequence whose oldest block has left the
    window (it is freed first); the old check counted only free blocks and preempted."""
    full, sliding = CacheGroup(0, None, 4, (0,)), CacheGroup(1, 8, 4, (1,))
    bm = BlockManager((full, sliding), [8, 4])  # 3 usable window blocks of 4 tokens
    s = seq(0, 12)
    bm.grow(s, 12)
    s.num_cached = 12  # the query at 12 sees positions > 4: block 0 (positions 0..3) is out
    assert bm.can_grow(s, 13)
    bm.grow(s, 13)
    assert s.block_tables == [[1, 2, 3, 4], [0, 2, 3, 1]]


def test_long_generation_through_recycled_window_blocks_equals_a_contiguous_prefill(gemma3):
    """300 greedy tokens through a window group of 4 usable blocks (each handed out 5 times):
    wherever the contiguous prefill of the same tokens is decisive, it predicts them."""
    ex = Executor(gemma3, "ort", num_blocks=24, max_num_seqs=1, max_num_batched_tokens=16)
    assert ex.group_num_blocks == [24, 1 + 3 + 1]
    prompt = [(7 * i + 3) % 256 for i in range(20)]
    s = ex.add_request(prompt, SamplingParams(max_tokens=300, ignore_stop=True))
    handed = {}
    while not ex.scheduler.idle:
        ex.step()
        for i, b in enumerate(s.block_tables[1] if s.block_tables else []):
            if b:
                handed.setdefault(b, set()).add(i)
    assert len(s.output) == 300
    assert sorted(handed) == [1, 2, 3, 4] and min(len(v) for v in handed.values()) >= 5
    module = Executor(gemma3, "torch", num_blocks=2).backend.module
    module.mode = "functional"
    logits = teacher_forced(module, gemma3.spec, prompt, s.output)
    assert assert_greedy(logits, s.output) > 250


def test_inspect_prints_the_plan_for_max_model_len(gemma3, capsys):
    args = ["inspect", str(gemma3.path), "--kv-cache-memory", "4MiB", "--max-model-len", "512"]
    code, out, err = main_inproc(capsys, *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [g["blocks"] for g in doc["groups"]] == [103, 45]
    assert (doc["summary"]["context"], doc["summary"]["max_seqs_at_context"]) == (512, 3)
    code, out, err = main_inproc(capsys, *args)
    assert code == 0, err
    assert "group 1 (window 8): layers [0, 1, 2, 3, 4], 45 usable blocks, 3.6 MiB; a sequence " \
        "holds at most 3 blocks" in out  # fmt: skip
    assert "at 512 tokens per sequence: 3 sequences at once (group 0 bounds them)" in out
    code, out, err = main_inproc(capsys, *args[:-1], "600")
    assert (code, out, err) == (
        2,
        "",
        "error: --max-model-len 600 exceeds the model's position limit of 512 tokens; lower it\n",
    )


def test_engine_splits_for_max_model_len_and_names_it_in_rejections(gemma3):
    from tqexport.errors import TQExportError
    from tqexport.runtime.engine import Engine, EngineConfig

    # the default length is the model's position limit, 512: the plan worked out above
    assert Engine(gemma3, EngineConfig(kv_cache_memory="4MiB")).executor.group_num_blocks == [
        104,
        46,
    ]
    engine = Engine(gemma3, EngineConfig(kv_cache_memory="4MiB", max_model_len=100))
    # 100 tokens: 7 full blocks and 3 window blocks a sequence; 4 MiB holds
    # (4194304 - 33 * 81920 - 4096) // (7 * 4096 + 3 * 81920) = 5, so the full group gets
    # 1 + 5 * 7 = 36 blocks, the window group 33 + (4194304 - 2703360 - 36 * 4096) * 3 // 245760
    # = 33 + 16 = 49, and the full group what is left: (4194304 - 49 * 81920) // 4096 = 44,
    # fewer than the equal split's 48: every group gets 48
    assert engine.executor.group_num_blocks == [48, 48]
    with pytest.raises(TQExportError, match="exceeds the --max-model-len limit of 100 tokens"):
        engine.check_prompt_size(list(range(101)))
    with pytest.raises(TQExportError, match="--max-model-len 600 exceeds the model's position"):
        Engine(gemma3, EngineConfig(kv_cache_memory="4MiB", max_model_len=600))


def test_the_build_records_the_position_limit_and_the_plan_is_sized_by_it(gemma3, capsys):
    """No --max-model-len: the plan is the one for 512 tokens, the limit tiny-gemma3's config
    gives (written to tqexport.json, read back), and nothing is said about it."""
    on_disk = json.loads((gemma3.path / "tqexport.json").read_text())
    assert on_disk["model"]["max_position_embeddings"] == 512
    assert gemma3.spec.max_position_embeddings == 512
    code, out, err = main_inproc(capsys, "inspect", str(gemma3.path), "--kv-cache-memory",
                                 "4MiB", "--json")  # fmt: skip
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert [g["blocks"] for g in doc["groups"]] == [103, 45]
    assert (doc["summary"]["context"], doc["summary"]["max_seqs_at_context"]) == (512, 3)


def _older(d):
    del d["model"]["max_position_embeddings"]


def _older_from_gguf(d):
    """Built before the limit was recorded, from a source not read again (a GGUF's metadata)."""
    _older(d)
    d["model"]["source"] = "gguf:tiny.gguf"


@pytest.mark.parametrize(
    ("change", "blocks", "sized"),
    [
        (_older, [104, 46], "512 tokens (the source model's config)"),
        (_older_from_gguf, [48, 48], "the whole budget (no limit known)"),
    ],
)
def test_an_artifact_built_before_the_limit_was_recorded_falls_back_with_one_line(
    gemma3, tmp_path, capsys, change, blocks, sized
):
    from tqexport.runtime.engine import Engine, EngineConfig

    old = with_spec(gemma3.path, tmp_path / "old", change)
    assert open_artifact(old).spec.max_position_embeddings is None  # older artifacts still load
    note = (f"{old} was built before tqexport recorded the model's position limit: the memory "
            f"plan is sized for {sized}; give --max-model-len or rebuild it")  # fmt: skip
    code, out, err = main_inproc(capsys, "inspect", str(old), "--kv-cache-memory", "4MiB",
                                 "--json")  # fmt: skip
    assert (code, err) == (0, f"warning: {note}\n")
    assert [g["blocks"] for g in json.loads(out)["groups"]] == [b - 1 for b in blocks]
    engine = Engine(open_artifact(old), EngineConfig(kv_cache_memory="4MiB"))
    assert (engine.executor.group_num_blocks, engine.limit_note) == (blocks, note)
    given = EngineConfig(kv_cache_memory="4MiB", max_model_len=512)
    assert Engine(open_artifact(old), given).limit_note is None  # told: nothing to say
    code, out, err = main_inproc(capsys, "inspect", str(old), "--kv-cache-memory", "4MiB",
                                 "--max-model-len", "512", "--json")  # fmt: skip
    assert (code, err) == (0, "")
    assert [g["blocks"] for g in json.loads(out)["groups"]] == [103, 45]
