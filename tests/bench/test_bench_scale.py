"""``bench scale``'s arithmetic on tiny models: the bytes a step reads, the caches a filled
point allocates (as the block manager would hold them), the batch a budget holds (the serving
scheduler's own count), the grid's memory rule; and one small run end to end. Timings are not
checked, only that each is reported beside its bound."""

import json

import pytest
from helpers import main_inproc

from tqexport.bench.filled import filled_tables
from tqexport.bench.scale import (
    Capacity,
    capacity,
    filled_bytes,
    grid_points,
    kv_read_bytes,
    measure_scale,
    scale_contexts,
)
from tqexport.contract.artifact import open_artifact
from tqexport.runtime.blocks import NULL_BLOCK, BlockManager
from tqexport.runtime.memory import resolve_num_blocks
from tqexport.runtime.scheduler import Scheduler
from tqexport.runtime.sequence import SamplingParams, Sequence

# tiny-gemma3 fp8 with --skip-layers sw: layers 0-4 keep float32 caches in a window of 8
# (2 kv heads x 64 x K,V x 4 bytes = 1024 bytes a token each), layer 5 is fp8 (256 bytes a
# token) with full attention; tiny-llama: 6 layers of 2 kv heads x 64.
WINDOW_TOKEN, FULL_FP8_TOKEN = 1024, 256


@pytest.fixture
def gemma3(artifacts):
    return open_artifact(artifacts("tiny-gemma3", "fp8", ["sw"]))


def test_a_step_reads_each_layers_visible_tokens_in_its_own_format(gemma3, artifacts):
    assert kv_read_bytes(gemma3.spec, 100) == 5 * 8 * WINDOW_TOKEN + 100 * FULL_FP8_TOKEN
    assert kv_read_bytes(gemma3.spec, 5) == 5 * 5 * WINDOW_TOKEN + 5 * FULL_FP8_TOKEN
    recent = open_artifact(artifacts("tiny-llama", "fp8", recent_window=32)).spec
    # the last 32 tokens from the float32 recent cache, the 68 before in fp8
    assert kv_read_bytes(recent, 100) == 6 * (32 * 1024 + 68 * 256)
    assert kv_read_bytes(recent, 20) == 6 * 20 * 1024


@pytest.mark.parametrize("tokens,query", [(100, 98), (40, 40), (7, 5), (512, 500)])
def test_filled_tables_hold_what_the_block_manager_holds(gemma3, tokens, query):
    """A sequence prefilled chunk by chunk to ``query`` tokens, then grown to ``tokens``: the
    blocks it holds per group (and where the null block stands) are the filled tables'."""
    spec = gemma3.spec
    counts, tables = filled_tables(spec, 3, tokens, query)
    bm = BlockManager(spec.groups, [10_000] * len(spec.groups))
    seq = Sequence(0, list(range(query)), SamplingParams(max_tokens=tokens - query + 1))
    for upto in [*range(16, query, 16), query]:
        bm.grow(seq, upto)
        seq.num_cached = upto
    bm.grow(seq, tokens)
    for g, (want, got) in enumerate(zip(seq.block_tables, tables[0], strict=True)):
        assert [b == NULL_BLOCK for b in got] == [b == NULL_BLOCK for b in want], g
    assert [n - 1 for n in counts] == [3 * n for n in bm.used_blocks()]
    assert filled_bytes(spec, 3, tokens, query) == sum(
        n * spec.group_block_bytes(g) for g, n in zip(spec.groups, counts, strict=True)
    )
    for g in range(len(spec.groups)):  # no two sequences share a block of a group
        live = [b for t in tables for b in t[g] if b != NULL_BLOCK]
        assert sorted(live) == list(range(1, counts[g]))


def _peak_running(art, plan, context, seqs):
    """The most sequences of ``context`` tokens the scheduler holds at once under ``plan``."""
    bm = BlockManager(art.spec.groups, plan)
    sched = Scheduler(bm, 512, 64)
    batch_of = [Sequence(i, [7] * (context - 4), SamplingParams(max_tokens=4))
                for i in range(seqs)]  # fmt: skip
    for s in batch_of:
        sched.add(s)
    peak = 0
    for _ in range(2000):
        batch = sched.schedule()
        if not batch:
            break
        for s, n in batch:
            s.num_cached += n
            if s.num_cached == s.num_tokens:
                s.output.append(7)
        peak = max(peak, sum(s.num_cached >= context - 4 for s in sched.running))
        for s in list(sched.running):
            if len(s.output) == s.params.max_tokens:
                sched.finish(s, "length")
    assert sched.idle
    return peak


@pytest.mark.parametrize(
    "model,skip,budget,context",
    [("tiny-gemma3", ["sw"], "4MiB", 512), ("tiny-gemma3", ["sw"], "2MiB", 256),
     ("tiny-llama", [], "1MiB", 300), ("tiny-llama", [], "3MiB", 64)],
)  # fmt: skip
def test_the_capacity_batch_is_what_the_scheduler_admits(artifacts, model, skip, budget, context):
    art = open_artifact(artifacts(model, "fp8", skip))
    cap = capacity(art, context, budget, max_num_seqs=64)
    plan = resolve_num_blocks(art, None, budget, 64, context=context)
    assert cap.batch >= 1
    assert _peak_running(art, plan, context, cap.batch + 2) == cap.batch


def test_a_budget_of_less_than_two_blocks_holds_no_sequence(artifacts):
    art = open_artifact(artifacts("tiny-llama", "auto"))
    assert capacity(art, 64, "1KiB") == Capacity(0, "the budget")


def test_grid_runs_the_formats_whose_caches_fit_and_names_the_rest(gemma3, artifacts):
    auto = open_artifact(artifacts("tiny-gemma3", "auto")).spec
    specs = {"auto": auto, "fp8": gemma3.spec}
    need = {n: filled_bytes(s, 4, 256 + 2 + 1, 256) for n, s in specs.items()}
    points = grid_points(specs, [256], [1, 4], 2, need["auto"] + need["fp8"] - 1)
    assert [p["batch"] for p in points] == [1, 4]
    assert points[0]["run"] == ["auto", "fp8"] and points[0]["skipped"] == {}
    assert points[1]["run"] == ["auto"] and points[1]["skipped"] == {"fp8": need["fp8"]}


def test_contexts_past_the_position_limit_are_left_out_those_at_it_shortened(gemma3):
    assert scale_contexts(gemma3.spec, [64, 509, 510, 512, 513, 4096], 2) == (
        [64, 509],
        [513, 4096],
    )


def test_measure_reports_every_point_beside_its_bound(artifacts):
    arts = {n: open_artifact(artifacts("tiny-llama", n)) for n in ("auto", "fp8")}
    r = measure_scale(arts, [32, 128], [1, 2], 1, "1MiB", 2**30)
    assert [(x["context"], x["batch"]) for x in r["grid"]] == [(32, 1), (32, 2), (128, 1),
                                                                (128, 2)]  # fmt: skip
    bw = r["read_bandwidth"]["used"]
    assert bw == max(r["read_bandwidth"]["bytes_per_second"]) > 0
    for x in r["grid"]:
        assert set(x["tokens_per_second"]) == {"auto", "fp8"}
        for n, tps in x["tokens_per_second"].items():
            b = x["bound"][n]
            step = r["footprint"][n]["weights_bytes"] + x["batch"] * kv_read_bytes(
                arts[n].spec, x["context"]
            )
            assert b["step_bytes"] == step
            assert b["bound_tokens_per_second"] == pytest.approx(x["batch"] * bw / step)
            assert b["share_of_bound"] == pytest.approx(tps / b["bound_tokens_per_second"])
    for x in r["capacity"]:
        want = {n: capacity(a, x["context"], "1MiB").batch for n, a in arts.items()}
        assert x["batch"] == want and want["fp8"] > want["auto"] >= 1
        assert x["vs_auto"]["auto"] == 1.0 and set(x["tokens_per_second"]) == {"auto", "fp8"}


def test_bench_scale_command_json_plot_and_refusals(capsys, tmp_path, artifacts):
    target = artifacts("tiny-llama", "fp8")
    plot = tmp_path / "scale.png"
    args = ["bench", "scale", target, "--contexts", "32,4096", "--batches", "1",
            "--steps", "1", "--kv-cache-memory", "256KiB", "--workdir", tmp_path / "w"]  # fmt: skip
    code, out, err = main_inproc(capsys, *args, "--plot", plot, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["left_out_contexts"] == [4096] and r["position_limit"] == 512
    assert [x["context"] for x in r["capacity"]] == [32]
    assert set(r["grid"][0]["tokens_per_second"]) == {"auto", "fp8"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = main_inproc(capsys, *args, "--plot", plot)
    assert (code, err) == (
        2,
        f"error: --plot {plot} already exists (a file); pass --force to replace it\n",
    )
    code, _, err = main_inproc(capsys, "bench", "scale", target, "--contexts", "600")
    assert code == 2 and err.startswith("error: --contexts 600: every context is over the ")
    code, _, err = main_inproc(capsys, "bench", "scale", target, "--grid-memory", "lots")
    assert code == 2 and err.startswith("error: --grid-memory")


def test_a_long_prompt_is_admitted_one_chunk_per_step_beside_the_streams(artifacts):
    """The streams keep decoding while the prompt is prefilled: each step carries their 4
    tokens and a chunk of the rest of the budget, so 250 tokens at 64 a step take
    ceil(250 / 60) = 5 steps to the prompt's first token (alone: 4); every step is timed."""
    from tqexport.bench.prefill import QUIET_STEPS, decode_stall, measure_prefill

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    steps = decode_stall(art, 250, 64)
    assert len(steps["quiet_ms"]) == len(steps["after_ms"]) == QUIET_STEPS
    assert len(steps["admitting_ms"]) == 5
    assert min(steps["quiet_ms"] + steps["admitting_ms"] + steps["after_ms"]) > 0
    r = measure_prefill({"fp8": art}, [100, 300], 250, chunk=64)
    assert [x["context"] for x in r["prefill"]] == [100, 300]
    for x in r["prefill"]:
        assert x["tokens_per_second"]["fp8"] == pytest.approx(x["context"] / x["seconds"]["fp8"])
    s = r["stall"]["fp8"]
    assert s["ratio"] == pytest.approx(s["admitting_p99_ms"] / s["after_p99_ms"])
    assert s["ratio_to_start"] == pytest.approx(s["admitting_p99_ms"] / s["quiet_p99_ms"])
    assert len(s["admitting_ms"]) == 5


def test_a_decode_point_ending_on_a_block_boundary_has_room_for_every_step(artifacts):
    """A warm-up step and 2 timed ones after 30 cached tokens write positions 30, 31 and 32:
    the third is the first token of a third block of 16."""
    from tqexport.bench.speed import decode_run

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    ms, _ = decode_run({"fp8": art}, 30, 2, 2)
    assert ms["fp8"] > 0


def test_small_chunks_keep_every_stream_resident_while_timed(artifacts):
    """Chunks of 16 tokens (12 for the prompt beside 4 streams): 250 tokens take 21 steps, and
    the caches are sized so that no stream is preempted meanwhile (that raises)."""
    from tqexport.bench.prefill import decode_stall

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    assert len(decode_stall(art, 250, 16)["admitting_ms"]) == 21


def test_the_long_prefill_threshold_spreads_the_prompt_over_more_steps(artifacts):
    """With a threshold of 10, each step carries 10 of the prompt's tokens beside the 4 streams
    (the budget of 64 would allow 60): 250 tokens take 25 steps, timed, nothing preempted."""
    from tqexport.bench.prefill import decode_stall, measure_prefill

    art = open_artifact(artifacts("tiny-llama", "fp8"))
    assert len(decode_stall(art, 250, 64, threshold=10)["admitting_ms"]) == 25
    r = measure_prefill({"fp8": art}, [100], 250, chunk=64, threshold=10)
    s = r["stall"]["fp8"]
    assert r["long_prefill_token_threshold"] == 10 and len(s["admitting_ms"]) == 25
    assert s["long_prompt_seconds"] == pytest.approx(sum(s["admitting_ms"]) / 1000)


def test_prefill_peers_times_the_same_prompt_for_each_system(tmp_path):
    """benchmarks/prefill_peers.py without GenAI: each context's fastest round after the warm-up,
    tokens/s from it, every length's load average recorded."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_peers.py"
    spec = importlib.util.spec_from_file_location("prefill_peers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    result = mod.main(["--model", "tiny-llama", "--contexts", "20,40", "--dtypes", "fp8",
                       "--genai-precisions", "", "--rounds", "1", "--workdir",
                       str(tmp_path / "w"), "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert [r["context"] for r in result["rows"]] == [20, 40]
    for r in result["rows"]:
        assert list(r["seconds"]) == ["tqexport fp8"]
        assert r["tokens_per_second"]["tqexport fp8"] == r["context"] / r["seconds"]["tqexport fp8"]
        assert set(r["loadavg"]) == {"before", "after"}


def test_an_artifact_runs_under_its_builds_name_beside_auto(artifacts, tmp_path):
    """A recent-window build and a per-layer plan (what --kv-bits builds) are named as bench
    quality names them, so neither takes the place of the auto artifact run beside it."""
    from tqexport.bench.matrix import speed_artifacts

    kv = "0:fp8,1-4:tqx_k4v3_mse:w8:s2,5:auto"
    plan = artifacts("tiny-llama", "auto", kv_layers=kv, key_transform="center")
    recent = artifacts("tiny-llama", "fp8", recent_window=32)
    names = [list(speed_artifacts(a, None, [0], "auto", tmp_path)[0]) for a in (plan, recent)]
    assert names == [[f"layers {kv} keys center"], ["fp8 recent 32"]]
