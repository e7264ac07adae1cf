"""Quality benchmark arithmetic: perplexity, KL and top-1 through the paged caches on a tiny model,
checked against direct computations; evaluation text and chunking; report goals."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from benchmarks.report import report, speed_report
from tqexport import metrics
from tqexport.bench import evaltext, quality
from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import make_codec
from tqexport.metrics import Totals
from tqexport.models.loader import load_model
from tqexport.spec import BuildRequest

MODEL = "tiny-llama"
ROOT = Path(__file__).resolve().parents[2]


class ByteTokenizer:
    """Bytes as token ids: tiny built-ins have no tokenizer, and the vocab is 256."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


@pytest.mark.parametrize("rows_per_block", [4, 256])
def test_totals_match_direct_computation(monkeypatch, rows_per_block):
    # blocks of 4 rows split both chunks (6 and 11 predictions) mid-way, the default does not
    monkeypatch.setattr(metrics, "ROWS_PER_BLOCK", rows_per_block)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (7, 12)]
    base = [torch.randn(len(c), 50, generator=g) * 3 for c in chunks]
    run = [b + 0.5 * torch.randn(b.shape, generator=g) for b in base]
    t = Totals()
    for c, r, b in zip(chunks, run, base):
        t.add(r, c, b)
    lr = torch.cat([r[:-1] for r in run]).double()
    lb = torch.cat([b[:-1] for b in base]).double()
    targets = torch.cat([torch.tensor(c[1:]) for c in chunks])
    s = t.summary()
    assert s["predictions"] == 6 + 11
    assert s["ppl"] == pytest.approx(math.exp(F.cross_entropy(lr, targets).item()), rel=1e-12)
    kl = F.kl_div(lr.log_softmax(-1), lb.log_softmax(-1), log_target=True, reduction="batchmean")
    assert s["kl"] == pytest.approx(kl.item(), rel=1e-10)
    assert s["top1"] == (lr.argmax(-1) == lb.argmax(-1)).double().mean().item()
    same = Totals()
    same.add(base[0], chunks[0], base[0])
    assert same.summary()["kl"] == pytest.approx(0, abs=1e-15) and same.summary()["top1"] == 1.0


def test_totals_added_by_rows_equal_the_whole_chunk():
    # a chunk added one prefill step at a time (rows 0-4, 5-9, 10-11; the last row predicts
    # nothing), against raw baseline logits or a Baseline, sums what the whole chunk does
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30, (12,), generator=g).tolist()
    base, run = torch.randn(12, 30, generator=g), torch.randn(12, 30, generator=g)
    whole, pieces, precomputed = Totals(), Totals(), Totals()
    whole.add(run, ids, base)
    for start, stop in ((0, 5), (5, 10), (10, 12)):
        targets = ids[start + 1 : stop + 1]
        pieces.add_rows(run[start:stop], targets, base[start:stop])
        ref = metrics.Baseline(base[start:stop], len(targets))
        precomputed.add_rows(run[start:stop], targets, ref)
    for t in (pieces, precomputed):
        assert (t.count, t.compared, t.top1) == (11, 11, whole.top1)
        assert t.nll == pytest.approx(whole.nll, rel=1e-14)
        assert t.kl == pytest.approx(whole.kl, rel=1e-12)


def test_chunking_and_text_identity(tmp_path):
    assert evaltext.chunk_tokens(list(range(10)), 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert evaltext.chunk_tokens(list(range(10)), 4, 1) == [[0, 1, 2, 3]]
    with pytest.raises(TQExportError, match="fewer than one chunk of 16"):
        evaltext.chunk_tokens(list(range(10)), 16, 1)
    text = evaltext.pydoc_topics()
    from pydoc_data.topics import topics

    keys = sorted(topics)
    assert text.text.startswith(topics[keys[0]] + "\n\n" + topics[keys[1]])
    assert text.text.endswith(topics[keys[-1]])
    f = tmp_path / "t.txt"
    f.write_text("héllo")
    got = evaltext.file_text(f)
    assert got.sha256 == hashlib.sha256("héllo".encode()).hexdigest()
    assert got.describe()["characters"] == 5
    with pytest.raises(TQExportError, match="not found"):
        evaltext.file_text(tmp_path / "missing.txt")


def _fake_quant_attention(codec_for_layer, recent_window=0):
    """Eager attention on K/V round-tripped through each layer's codec (keys within the last
    ``recent_window`` positions of each query left raw): an independent path (no paged cache,
    no block tables, no custom ops) to the same quantized arithmetic."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kw):
        codec = codec_for_layer(module.layer_idx)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
        kq, vq = codec.decode(codec.encode(k, v))
        groups = query.shape[1] // k.shape[1]

        def heads(x):  # [T, KVH, D] -> [H, T, D]
            return x.transpose(0, 1).repeat_interleave(groups, 0)

        q = query[0]
        t = q.shape[1]
        dist = torch.arange(t)[:, None] - torch.arange(t)[None, :]  # query pos - key pos
        raw = (dist < recent_window)[None]  # read unquantized
        scores = torch.where(raw, q @ heads(k).transpose(1, 2), q @ heads(kq).transpose(1, 2))
        scores = torch.where((dist >= 0)[None], scores * scaling, float("-inf"))
        p = scores.softmax(-1)
        out = (p * raw) @ heads(v) + (p * ~raw) @ heads(vq)
        return out.transpose(0, 1)[None].contiguous(), None

    return attend


@pytest.mark.parametrize(
    "kv_dtype,recent,step",
    [("auto", 0, 512), ("fp8", 0, 512), ("turboquant_4bit_nc", 0, 512),
     ("int4_per_token_head", 0, 512), ("turboquant_4bit_nc", 8, 512),
     ("fp8", 0, 20), ("turboquant_4bit_nc", 8, 20)],
)  # fmt: skip
def test_paged_perplexity_matches_direct_computation(monkeypatch, kv_dtype, recent, step):
    # step 20: each 48-token chunk is prefilled and scored in steps of 20, 20 and 8 tokens
    monkeypatch.setattr(quality, "SCORE_STEP_TOKENS", step)
    text = evaltext.EvalText("bytes", "".join(chr(32 + (i * 7919) % 90) for i in range(200)))
    config = quality.Config(BuildRequest(kv_dtype, boundary=False, recent_window=recent))
    res, chunks = quality.evaluate(
        MODEL, [config], text, chunk=48, max_chunks=3, tokenizer=ByteTokenizer()
    )
    assert [len(c) for c in chunks] == [48, 48, 48] and chunks[0] == list(text.text[:48].encode())
    lm = load_model(MODEL, "float32")
    spec = quality.resolve_spec(MODEL, lm, BuildRequest(kv_dtype, boundary=False))[0]
    name = f"tq_fake_{kv_dtype}_{recent}"
    codecs = {la.index: make_codec(la.kv_cache_dtype, la.cache.head_size, model_dtype="float32",
                                   k_scale=la.cache.k_scale, v_scale=la.cache.v_scale)
              for la in spec.layers}  # fmt: skip
    attend = _fake_quant_attention(codecs.__getitem__, recent)
    transformers.AttentionInterface.register(name, attend)
    lm.model.config._attn_implementation = name
    direct, base_direct = Totals(), Totals()
    with torch.no_grad():
        for c in chunks:
            logits = lm.model(torch.tensor([c])).logits[0]
            lm.model.config._attn_implementation = "sdpa"
            base = lm.model(torch.tensor([c])).logits[0]
            lm.model.config._attn_implementation = name
            direct.add(logits, c, base)
            base_direct.add(base, c, base)
    run = res["runs"][0] if res["runs"] else res["baseline"]
    assert run["predictions"] == 3 * 47 and run["recent_window"] == recent
    assert res["baseline"]["ppl"] == pytest.approx(base_direct.summary()["ppl"], rel=1e-5)
    assert run["ppl"] == pytest.approx(direct.summary()["ppl"], rel=1e-4)
    assert run["kl"] == pytest.approx(direct.summary()["kl"], rel=1e-3, abs=1e-7)
    assert run["top1"] == direct.summary()["top1"]
    assert run["layer_dtypes"] == [la.kv_cache_dtype for la in spec.layers]


def test_bits_per_element_counts_every_layer():
    lm = load_model(MODEL, "float32")
    spec = quality.resolve_spec(MODEL, lm, BuildRequest("turboquant_4bit_nc"))[0]
    dtypes = [la.kv_cache_dtype for la in spec.layers]
    tq = "turboquant_4bit_nc"
    assert dtypes == ["auto", "auto", tq, tq, "auto", "auto"]  # 6 layers: vLLM's boundary 2
    d = spec.layers[0].cache.head_size  # 64: 70-byte slot for 2*64 elements = 4.375 bits
    slot_bits = 8 * make_codec("turboquant_4bit_nc", d).bytes_per_token_head / (2 * d)
    assert quality.bits_per_element(spec, 16) == pytest.approx((4 * 16 + 2 * slot_bits) / 6)
    assert quality.bits_per_element(spec) == pytest.approx((4 * 32 + 2 * slot_bits) / 6)


def test_goals_compare_each_tool_with_its_own_baseline():
    quality_result = {
        "baseline": {"label": "auto", "ppl": 10.0, "bits_per_element": 16},
        "runs": [
            {"label": "turboquant_4bit_nc", "ppl": 10.5, "bits_per_element": 4.4},
            {"label": "fp8", "ppl": 10.02, "bits_per_element": 8},
        ],
    }
    peer = {"runs": [
        {"label": "f16", "kv_type": "f16", "ppl": 12.0, "bits_per_element": 16},
        {"label": "q8_0", "kv_type": "q8_0", "ppl": 12.0, "bits_per_element": 8.5},
        {"label": "q4_0", "kv_type": "q4_0", "ppl": 12.72, "bits_per_element": 4.5},
    ]}  # fmt: skip
    rows = quality.with_deltas(quality_result, peer)
    assert [round(r["ppl_delta_pct"], 6) for r in rows] == [0, 5, 0.2, 0, 0, 6]
    g = report.goals(rows, None)
    assert [x["met"] for x in g] == [True, False, False]
    assert g[0]["detail"] == "+5.00% vs +6.00%" and g[1]["detail"] == "+0.20% vs +0.00%"
    assert g[2]["detail"] == "best: turboquant_4bit_nc at 4.400 bits, +5.00%"
    assert [x["met"] for x in report.goals(rows[:3], None)] == [None, None, False]
    quality_result["runs"].append({"label": "k recent 32", "ppl": 10.09, "bits_per_element": 4.5})
    assert report.goals(quality.with_deltas(quality_result, peer), None)[2]["met"] is True


def test_quality_parts_merge_only_when_comparable():
    q = {
        "model": "m",
        "text": {"sha256": "abc"},
        "chunking": {"chunks": 2},
        "baseline": {"label": "auto", "ppl": 10.0},
        "runs": [{"label": "fp8", "ppl": 10.1}],
    }
    other = {**q, "runs": [{"label": "fp8", "ppl": 10.1}, {"label": "tq r32", "ppl": 10.2}]}
    merged, peer, note = report.merge_quality(
        [{"quality": q, "peer": None, "peer_note": "not run (--no-peer)"},
         {"quality": other, "peer": {"runs": []}, "peer_note": None}], "m")  # fmt: skip
    assert [r["label"] for r in merged["runs"]] == ["fp8", "tq r32"] and peer == {"runs": []}
    assert note is None
    with pytest.raises(TQExportError, match="differ in model, text, chunking or baseline"):
        report.merge_quality([{"quality": q}, {"quality": {**q, "chunking": {"chunks": 3}}}], "m")
    rerun = {**q, "baseline": {"label": "auto", "ppl": 10.0 * (1 + 2e-10)}}
    assert report.merge_quality([{"quality": q}, {"quality": rerun}], "m")[0]["runs"]
    moved = {**q, "baseline": {"label": "auto", "ppl": 10.0 * (1 + 2e-9)}}
    with pytest.raises(TQExportError, match="differ in model, text, chunking or baseline"):
        report.merge_quality([{"quality": q}, {"quality": moved}], "m")


def test_artifact_dir_is_scored_on_onnx_runtime_like_the_torch_path(artifacts):
    art = artifacts("tiny-llama", "fp8")
    text = evaltext.EvalText("bytes", "".join(chr(40 + (i * 31) % 80) for i in range(120)))
    kw = dict(chunk=40, max_chunks=2, tokenizer=ByteTokenizer())
    on_dir, _ = quality.evaluate(str(art), [], text, **kw)
    on_model, _ = quality.evaluate(
        MODEL, [quality.Config(BuildRequest("fp8", boundary=False))], text, **kw
    )
    (ort_run,), (torch_run,) = on_dir["runs"], on_model["runs"]
    assert (ort_run["backend"], torch_run["backend"]) == ("ort", "torch")
    assert ort_run["layer_dtypes"] == torch_run["layer_dtypes"] == ["fp8"] * 6
    assert ort_run["ppl"] == pytest.approx(torch_run["ppl"], rel=1e-5)
    assert ort_run["top1"] == torch_run["top1"]


def test_speed_measures_every_artifact_and_memory_from_the_spec(artifacts):
    from tqexport.bench import speed
    from tqexport.contract.artifact import open_artifact
    from tqexport.runtime.memory import block_bytes

    arts = {d: open_artifact(artifacts("tiny-llama", d)) for d in ("auto", "fp8")}
    res = speed.measure(arts, [16, 40], [1, 3], steps=2, budget="1MiB", kernels=["bodies"])
    assert [(r["context"], r["batch"]) for r in res["decode"]] == [(16, 1), (16, 3), (40, 1),
                                                                   (40, 3)]  # fmt: skip
    for r in res["decode"]:
        assert r["speed_vs_auto"]["auto [bodies]"] == 1.0
        assert r["tokens_per_second"]["fp8 [bodies]"] == pytest.approx(
            1000 * r["batch"] / r["ms_per_step"]["fp8 [bodies]"]
        )
    mem = {m["label"]: m for m in res["memory"]}
    for d, art in arts.items():
        assert mem[d]["resident_tokens"] == (2**20 // block_bytes(art) - 1) * 16
        assert mem[d]["kv_bytes_per_token"] == art.spec.bytes_per_token
    assert mem["fp8"]["bytes_ratio_auto_over_this"] == 4.0  # fp32 model dtype vs 1-byte fp8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["quality", "smollm2", "--boundary", "sideways"], "--boundary must be on, off or both"),
        (["quality", "smollm2", "--kv-cache-dtype", "fp9"], "unknown kv-cache dtype"),
        (["quality", "smollm2", "--text-file", "/nonexistent.txt"], "not found"),
        (["quality", "smollm2", "--kv-scales", "x"], "--kv-scales must be a number or 'calibrate'"),
        (["quality", "smollm2", "--recent-window", "-8"], "--recent-window must be integers >= 0"),
        (["quality", "smollm2", "--kv-key-transform", "none,centre"], "kinds joined by '+'"),
        (["quality", "tiny-llama", "--chunks", "1", "--no-peer"], "has no tokenizer"),
        (["speed", "smollm2", "--contexts", "1k"], "--contexts must be positive integers"),
        (["speed", "smollm2", "--budget", "lots"], "--budget: cannot read"),
        (
            ["speed", "smollm2", "--kernels", "native,foo"],
            "--kernels must be one of auto, native, bodies, got 'foo'",
        ),
        (["speed", "smollm2", "--kernels", " , "], "--kernels needs one or more of auto, native"),
    ],
)
def test_bench_bad_input_is_one_line_exit_2(args, message):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tqexport", "bench", *args], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["smollm2", "-o", "out/never", "--kernels", "bodeis"],
         "--kernels must be one of auto, native, bodies, got 'bodeis'"),
        (["smollm2", "-o", "out/never", "--peer-speed-json", "pyproject.toml"],
         "--peer-speed-json pyproject.toml is not the output of"),
        (["smollm2", "-o", "out/never", "--speed-json", "pyproject.toml"],
         "--speed-json pyproject.toml is not a report's results.json with a speed section"),
        (["tiny-llama", "-o", "out/never", "--contexts", "x"], "--contexts must"),
        (["tiny-llama", "-o", "out/never", "--quality-json", "out/never", "--chunks", "2"],
         "--chunks has no effect with --quality-json (its quality runs are reused as they are); "
         "drop one"),
    ],
)  # fmt: skip
def test_report_bad_input_is_one_line_exit_2_before_any_run(args, message):
    """``python -m benchmarks.report`` (from the repository) checks its input as tqexport does."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "benchmarks.report", *args], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_memory_goal_ignores_recent_window_rows():
    speed = {"memory": [
        {"label": "auto", "resident_vs_auto": 1.0, "bytes_ratio_auto_over_this": 1.0},
        {"label": "fp8", "resident_vs_auto": 4.004, "bytes_ratio_auto_over_this": 4.0},
        {"label": "fp8 recent 32", "resident_vs_auto": 2.4, "bytes_ratio_auto_over_this": 4.0},
    ]}  # fmt: skip
    goal = report.goals([], speed)[-1]
    assert goal["met"] is True and goal["detail"].startswith("largest relative gap 0.10%")


def test_quality_configs_score_key_transforms_on_native_turboquant_only():
    from tqexport.bench.matrix import quality_configs

    dtypes = ["auto", "turboquant_4bit_nc", "tqx_k4v4"]
    configs = quality_configs(dtypes, "off", None, "0,32", key_transforms="none,signs+center")
    got = [(c.label, c.request.key_transform_label) for c in configs]
    assert got == [
        ("auto", "none"),
        ("turboquant_4bit_nc no-boundary", "none"),
        ("turboquant_4bit_nc no-boundary recent 32", "none"),
        ("tqx_k4v4 no-boundary", "none"),
        ("tqx_k4v4 no-boundary keys center+signs", "center+signs"),
        ("tqx_k4v4 no-boundary recent 32", "none"),
        ("tqx_k4v4 no-boundary recent 32 keys center+signs", "center+signs"),
    ]


def _part(chunk_tokens, runs, peer=None):
    return {
        "quality": {
            "model": "m",
            "text": {"name": "t", "characters": 9, "sha256": "abc", "python": "3.11"},
            "chunking": {"chunk_tokens": chunk_tokens, "chunks": 1, "text_tokens": 5000},
            "baseline": {"label": "auto", "kv_cache_dtype": "auto", "ppl": 10.0,
                         "bits_per_element": 16.0},
            "runs": [{"kv_cache_dtype": r[0].split()[0], "label": r[0], "ppl": r[1],
                      "bits_per_element": r[2]} for r in runs],
        },
        "peer": peer,
        "peer_note": None if peer else "not run (--no-peer)",
    }  # fmt: skip


def test_report_gives_each_window_size_its_section_and_goals(tmp_path):
    parts = [
        _part(1024, [("fp8", 10.01, 8.0)]),
        _part(4096, [("tqx_k4v4 recent 24 sink 8", 10.07, 4.5), ("tqx_k3v3", 10.1, 3.375)]),
        _part(1024, [("turboquant_4bit_nc", 10.5, 4.375)]),
        _part(4096, [("turboquant_3bit_nc", 10.03, 3.375), ("tqx_k4v4", 10.05, 4.625)]),
    ]
    main, *others = report.split_by_chunking(parts)
    assert [len(main), [len(g) for g in others]] == [2, [2]]
    sections = [report.quality_section(g, "m") for g in others]
    assert sections[0]["chunk_tokens"] == 4096
    labels = [r["label"] for r in sections[0]["rows"]]
    assert labels == ["auto", "tqx_k4v4 recent 24 sink 8", "tqx_k3v3", "turboquant_3bit_nc",
                      "tqx_k4v4"]  # fmt: skip
    # the best native configuration within each budget (not vLLM's preset, nor 4.625 bits)
    long_goals = report.goals([], None, sections)[-2:]
    assert [(g["met"], g["detail"]) for g in long_goals] == [
        (False, "best: tqx_k4v4 recent 24 sink 8 at 4.500 bits, +0.70%"),
        (True, "best: tqx_k3v3 at 3.375 bits, +1.00%"),
    ]
    assert len(report.goals([], None, sections)) == len(report.goals([], None)) + 2
    first = report.quality_section(main, "m")
    assert [r["label"] for r in first["rows"]] == ["auto", "fp8", "turboquant_4bit_nc"]
    results = {"model": "m", "command": "c", "rows": first["rows"], "quality_windows": sections,
               "quality": first["quality"], "peer": None,
               "peer_note": first["peer_note"], "goals": long_goals,
               "machine": dict.fromkeys(["cpu", "cores", "memory_gib", "os", "python", "torch",
                                          "onnxruntime", "transformers"], "x")}  # fmt: skip
    files = report.write(tmp_path, results)
    assert {f.name for f in files} == {
        "results.json",
        "ppl_vs_bits.png",
        "ppl_vs_bits_4096.png",
        "report.md",
    }
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Quality\n") < md.index("## Quality at 4096-token windows\n")
    tail = md[md.index("## Quality at 4096-token windows") :]
    assert "the first 1 windows of 4096 tokens" in tail and "| tqexport | tqx_k3v3 | 3.38 |" in tail
    assert "turboquant_4bit_nc" not in tail and "![PPL change vs bits per element]" in tail
    assert "costs <= 0.6% perplexity: **NOT MET**" in md


def _peer_speed():
    tps = {  # (context, batch) -> tokens/s per system
        (1024, 1): {"tqexport auto": 20.0, "tqexport fp8": 15.0,
                    "tqexport turboquant_4bit_nc": 12.0, "ORT GenAI fp32": 24.0,
                    "llama.cpp q4_0": 50.0},
        (1024, 8): {"tqexport auto": 72.0, "tqexport fp8": 40.0,
                    "tqexport turboquant_4bit_nc": 36.0, "ORT GenAI fp32": 80.0},
        (4096, 1): {"tqexport auto": 10.0, "tqexport fp8": 5.5,
                    "tqexport turboquant_4bit_nc": 5.0},
    }  # fmt: skip
    return {"command": "benchmarks/peers_speed.py --json x", "versions": {"onnxruntime": "1"},
            "threads": 2, "steps": 4,
            "decode": [{"context": c, "batch": b, "tokens_per_second": t}
                       for (c, b), t in tps.items()]}  # fmt: skip


def test_peer_speed_goals_are_ratios_within_the_run():
    got = [(g["met"], g["detail"]) for g in speed_report.peer_speed_goals(_peer_speed())]
    assert got == [
        (True, "3.60x: batch 8 / batch 1 = 72.0 / 20.0 tokens/s"),
        (False, "3.00x: batch 8 / batch 1 = 36.0 / 12.0 tokens/s"),
        (False, "0.55x: this / auto = 5.5 / 10.0 tokens/s"),
        (True, "0.50x: this / auto = 5.0 / 10.0 tokens/s"),
        (True, "0.83x: auto / GenAI = 20.0 / 24.0 tokens/s"),
        (True, "0.90x: auto / GenAI = 72.0 / 80.0 tokens/s"),
        (None, "not measured: this run has no [native] rows (run it with --kernels native,bodies)"),
    ]
    partial = _peer_speed()
    partial["decode"] = partial["decode"][:1]  # no batch 8, no 4096
    assert [g["met"] for g in speed_report.peer_speed_goals(partial)] == [
        None, None, None, None, True, None, None
    ]  # fmt: skip


def test_report_renders_a_peer_speed_run(tmp_path):
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(_peer_speed()))
    ps = speed_report.read_peer_speed(path)
    results = {"model": "m", "command": "c", "rows": [], "quality": None, "peer": None,
               "peer_note": None, "peer_speed": ps, "goals": report.goals([], None, (), ps),
               "machine": dict.fromkeys(["cpu", "cores", "memory_gib", "os", "python", "torch",
                                          "onnxruntime", "transformers"], "x")}  # fmt: skip
    files = report.write(tmp_path / "r", results)
    assert {f.name for f in files} == {"results.json", "decode_peers.png", "report.md"}
    md = (tmp_path / "r" / "report.md").read_text()
    section = md[md.index("## Decode speed against peers") : md.index("## Goals")]
    assert "| 1024 | 8 | 72.0 | 40.0 | 36.0 | 80.0 | - | 0.90x |" in section
    assert "| 1024 | 8 / 1 | 3.60x | 2.67x | 3.00x | 3.33x | - |" in section
    assert "batch 1 at context 1024: **NOT MET** (3.00x:" in md
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"threads": 2, "steps": 4, "decode": [{"context": 1}]}))
    with pytest.raises(ValueError, match="not a peer-speed run"):
        speed_report.read_peer_speed(bad)


def test_quality_plot_labels_never_overlap_and_the_frontier_is_named(tmp_path):
    """The report's PPL-vs-bits plot (on the committed results): no two labels overlap, and
    every point of the best trade-offs (the frontier) and every peer point carries its label."""
    results = json.loads((ROOT / "docs" / "report" / "results.json").read_text())
    rows = results["rows"]
    labels = report.plot_quality(rows, tmp_path / "p.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(labels[0].figure)
    canvas.draw()
    boxes = [t.get_window_extent(canvas.get_renderer()) for t in labels]
    assert not [(a.get_text(), b.get_text()) for i, (a, x) in enumerate(zip(labels, boxes))
                for b, y in zip(labels[i + 1:], boxes[i + 1:]) if x.overlaps(y)]  # fmt: skip
    named = {t.get_text() for t in labels}
    frontier = report._frontier([r for r in rows if r["tool"] == "tqexport"])
    assert {r["label"] for r in frontier} <= named
    assert {"llama.cpp q8_0", "llama.cpp q4_0", "llama.cpp f16"} <= named
    assert (tmp_path / "p.png").stat().st_size > 0


def test_readme_glance_table_quotes_the_report():
    """The front page's formats table: one row per dtype as run (no-boundary and window
    variants only when their speed was measured), speed at batch 1 and the longest context,
    native-kernel labels preferred, where each format runs."""
    from benchmarks.report import glance

    def row(label, dtype, bits, pct, kl, **kw):
        return {"tool": "tqexport", "label": label, "kv_cache_dtype": dtype,
                "bits_per_element": bits, "ppl_delta_pct": pct, "kl": kl, **kw}  # fmt: skip

    results = {
        "quality": {"chunking": {"chunk_tokens": 1024}},
        "rows": [row("auto", "auto", 16.0, 0.0, 0.0), row("fp8", "fp8", 8.0, 0.97, 0.0107),
                 row("fp8 no-boundary", "fp8", 8.0, 1.0, 0.01),
                 row("tqx_k4v3_mse recent 32", "tqx_k4v3_mse", 3.9, 1.01, 0.01, recent_window=32),
                 {"tool": "llama.cpp", "label": "q4_0", "bits_per_element": 4.5,
                  "ppl_delta_pct": 5.54, "kl": 0.05}],
        "speed": {"decode": [
            {"context": 1024, "batch": 1, "speed_vs_auto": {"auto": 1.0, "fp8": 0.5}},
            {"context": 4096, "batch": 8, "speed_vs_auto": {"auto": 1.0, "fp8": 0.4}},
            {"context": 4096, "batch": 1, "speed_vs_auto": {
                "auto [native]": 1.0, "fp8 [native]": 0.9, "fp8 [bodies]": 0.7,
                "tqx_k4v3_mse recent 32 [native]": 0.8}},
        ]},
        "goals": [{"goal": "at 4096-token windows, a tqexport-native configuration at <= 3.5 bits "
                   "per element all in costs <= 1.5% perplexity", "met": True,
                   "detail": "best: tqx_k4v2_mse recent 60 at 3.500 bits, +1.45%"}],
    }  # fmt: skip
    assert glance.table(results).splitlines() == [
        "| format | bits/element all in | weights | PPL change (1024-token windows) | mean KL "
        "| decode vs auto (context 4096, batch 1) | runs on |",
        "|---|---|---|---|---|---|---|",
        "| `auto` | 16.00 | fp32 | +0.00% | 0.00000 | 1.00x | ORT CPU, CUDA, TensorRT, vLLM |",
        "| `fp8` | 8.00 | fp32 | +0.97% | 0.01070 | 0.90x | ORT CPU, CUDA, TensorRT, vLLM |",
        "| `tqx_k4v3_mse recent 32` | 3.90 | fp32 | +1.01% | 0.01000 | 0.80x "
        "| ORT CPU, CUDA, TensorRT |",
        "",
        "llama.cpp's own caches on the same text: q4_0 4.50 bits +5.54%.",
        "",
        "Best measured at <= 3.5 bits on one 4096-token window: tqx_k4v2_mse recent 60 at 3.500 "
        "bits, +1.45%.",
    ]
    page = f"a\n{glance.BEGIN}\nold\n{glance.END}\nb\n"
    assert (
        glance.update(page, results)
        == f"a\n{glance.BEGIN}\n{glance.table(results)}\n{glance.END}\nb\n"
    )
    with pytest.raises(ValueError, match="glance markers"):
        glance.update("no markers", results)


def test_peer_holds_one_llama_context_at_a_time(monkeypatch):
    """Each llama.cpp context holds n_ctx x vocab scores (4 GiB for Gemma 3 at 4096 tokens):
    the peer opens one per cache type and chunk, closes it, and compares with f16's logits."""
    import sys
    import types

    import numpy as np

    from tqexport.bench import peers

    g = torch.Generator().manual_seed(0)
    chunks = [[1, 5, 2, 7], [3, 3, 0, 6]]
    logits = {(t, i): torch.randn(4, 8, generator=g).numpy() for t in peers.KV_TYPES
              for i in range(2)}  # fmt: skip
    open_now, most = set(), []

    class FakeLlama:
        def __init__(self, kv_type):
            self.kv_type, self.n = kv_type, 0
            open_now.add(self)
            most.append(len(open_now))

        def reset(self):
            self.scores = None

        def eval(self, ids):
            self.scores = logits[(self.kv_type, chunks.index(ids))].copy()

        def close(self):
            self.scores[:] = np.nan  # what the caller still holds of it is gone
            open_now.discard(self)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="fake"))
    monkeypatch.setattr(peers, "_llama", lambda path, t, chunk, threads: FakeLlama(t))
    got = peers.evaluate(Path("m.gguf"), chunks)
    assert max(most) == 1 and not open_now
    for run in got["runs"]:
        want = Totals()
        for i, ids in enumerate(chunks):
            want.add(logits[(run["kv_type"], i)], ids, logits[("f16", i)])
        assert {k: run[k] for k in ("ppl", "kl", "top1")} == pytest.approx(
            {k: v for k, v in want.summary().items() if k != "predictions"}, rel=1e-12
        )
    assert [r["kv_type"] for r in got["runs"]] == ["f16", "q8_0", "q4_0"]
    assert [r["bits_per_element"] for r in got["runs"]] == [16.0, 8.5, 4.5]
    shared = peers.evaluate(Path("m.gguf"), chunks, held_share=0.25)
    assert [r["bits_per_element"] for r in shared["runs"]] == [4.0, 2.125, 1.125]


def test_sliding_layers_hold_their_window_share_of_the_elements():
    """Gemma 3 270M's 15 sliding layers (window 512) and 3 full ones hold 13/48 of a full cache
    at 4096 tokens; windows at or beyond 4096 and dense models hold it all."""
    from fractions import Fraction

    from helpers import dense, describe, gemma_like

    from tqexport.kvplan.storage_bits import held_share

    assert held_share(describe(([512] * 5 + [None]) * 3).layers) == Fraction(13, 48)
    assert held_share(gemma_like(6, window=512).layers) == Fraction(3 * 1 + 3 * 8, 6 * 8)
    assert held_share(gemma_like(4, window=5000).layers) == 1 == held_share(dense(3).layers)


def test_model_report_names_where_a_smollm2_winner_loses(tmp_path):
    """A model scored like SmolLM2's 1024-token part, but where fp8_e5m2 costs 0.1%: every
    configuration within a bit of it that beat it on SmolLM2 now loses to it, nothing else."""
    from benchmarks.report import model_report

    part = json.loads((ROOT / "docs/report/quality.json").read_text())
    part["quality"]["model"] = "m"
    base = part["quality"]["baseline"]["ppl"]
    next(r for r in part["quality"]["runs"] if r["label"] == "fp8_e5m2")["ppl"] = base * 1.001
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "quality.json").write_text(json.dumps(part))
    (tmp_path / "results.json").write_text((ROOT / "docs/report/results.json").read_text())
    results = model_report.build(tmp_path, ["m"])
    [sec] = results["models"][0]["sections"]
    assert sec["chunk_tokens"] == 1024
    winners = ["fp8", "fp8_per_token_head", "turboquant_k8v4"]  # largest SmolLM2 margin first
    assert [(f["winner"][1], f["loser"][1]) for f in sec["flips"]] == [
        (w, "fp8_e5m2") for w in winners
    ]
    assert sec["flips"][0]["model_pct"][1] == pytest.approx(0.1)
    files = model_report.write(tmp_path, results)
    assert [f.name for f in files] == ["models.json", "models.md", "ppl_vs_bits_1024.png"]
    md = (tmp_path / "models.md").read_text()
    assert "## m at 1024-token windows" in md and "| fp8 | fp8_e5m2 |" not in md
    assert "| tqexport fp8 | tqexport fp8_e5m2 | +0.97% vs +4.50% | +0.97% vs +0.10% |" in md


def test_model_report_without_runs_is_one_line(tmp_path, capsys):
    from benchmarks.report import model_report

    (tmp_path / "results.json").write_text((ROOT / "docs/report/results.json").read_text())
    (tmp_path / "m").mkdir()
    with pytest.raises(SystemExit) as e:
        model_report.main([str(tmp_path), "m"])
    assert str(e.value) == (
        f"error: {tmp_path / 'm'} holds no `bench quality --json` output; run them first"
    )


def test_report_sets_each_kv_bits_budget_beside_the_best_single_configuration(tmp_path):
    """Each --kv-bits run: its predicted and measured KL, the best other configuration of the
    same windows at no more bits, llama.cpp q4_0; the budget goals at 4096-token windows."""
    from benchmarks.report import budget_report

    def budget(b, bits, ppl, kl):
        return {"label": f"kv-bits {b:g}", "kv_cache_dtype": "auto", "ppl": ppl, "kl": kl,
                "bits_per_element": bits, "kv_bits": b, "predicted_kl": kl / 2,
                "kv_layers": "0-29:tqx_k4v2_mse:w24:s8"}  # fmt: skip

    q4 = {"tool": "llama.cpp", "gguf": "g", "runs": [
        {"kv_type": "f16", "ppl": 20.0, "bits_per_element": 16.0},
        {"kv_type": "q4_0", "ppl": 21.0, "bits_per_element": 4.5}]}  # fmt: skip
    part = _part(4096, [("tqx_k4v2_mse recent 60", 10.145, 3.5), ("fp8", 10.02, 8.0)], q4)
    part["quality"]["runs"] += [budget(3.5, 3.4921875, 10.07, 0.01), budget(3.0, 2.96875, 10.2,
                                                                           0.02)]  # fmt: skip
    sec = report.quality_section([part], "m")
    rows = budget_report.budget_rows([(part["quality"]["chunking"], sec["rows"])])
    assert [(r["kv_bits"], r["uniform"] and r["uniform"]["label"]) for r in rows] == [
        (3.0, None), (3.5, "tqx_k4v2_mse recent 60")]  # fmt: skip
    assert rows[1]["q4_0_ppl_delta_pct"] == pytest.approx(5.0)
    assert rows[1]["ppl_delta_pct"] == pytest.approx(0.7)
    goals = report.goals([], None, [sec])[-2:]
    assert [(g["met"], g["detail"]) for g in goals] == [
        (True, "+0.70% at 3.492 bits (predicted KL 0.00500, measured 0.01000)"),
        (False, "+2.00% at 2.969 bits (predicted KL 0.01000, measured 0.02000)"),
    ]
    main = report.quality_section([_part(1024, [("fp8", 10.01, 8.0)])], "m")
    results = {"model": "m", "command": "c", "rows": main["rows"], "quality": main["quality"],
               "quality_windows": [sec], "peer": None, "peer_note": None, "goals": goals,
               "machine": dict.fromkeys(["cpu", "cores", "memory_gib", "os", "python", "torch",
                                          "onnxruntime", "transformers"], "x")}  # fmt: skip
    files = {f.name for f in report.write(tmp_path, results)}
    assert "ppl_vs_kv_bits.png" in files
    md = (tmp_path / "report.md").read_text()
    assert ("| 1 x 4096 | 3.5 | 3.492 | 0.00500 | 0.01000 | +0.70% | tqx_k4v2_mse recent 60 "
            "(3.50): +1.45% | +5.00% (4.50) |") in md  # fmt: skip
    assert "| 1 x 4096 | 3 | 2.969 | 0.01000 | 0.02000 | +2.00% | - | +5.00% (4.50) |" in md
    assert md.index("## Per-layer precision under a bits budget") < md.index("## Goals")


def test_model_report_gives_each_model_its_budget_section(tmp_path):
    """A real model's --kv-bits runs get their own table and plot in models.md, beside the best
    single configuration within each budget and q4_0 at its own bits (a sliding model's share)."""
    from benchmarks.report import model_report

    budget = {"label": "kv-bits 2", "kv_cache_dtype": "auto", "ppl": 10.05, "kl": 0.01,
              "bits_per_element": 1.98, "kv_bits": 2.0, "predicted_kl": 0.004,
              "kv_layers": "0-29:tqx_k4v2_mse:w24:s8"}  # fmt: skip
    q4 = {"tool": "llama.cpp", "gguf": "g", "runs": [
        {"kv_type": "f16", "ppl": 20.0, "bits_per_element": 4.33},
        {"kv_type": "q4_0", "ppl": 22.0, "bits_per_element": 1.22}]}  # fmt: skip
    part = _part(4096, [("fp8", 10.1, 2.17), ("tqx_k4v3_mse recent 184", 10.2, 1.71)], q4)
    part["quality"]["runs"][1]["kl"] = 0.0125
    part["quality"]["runs"].append(budget)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "quality_4096.json").write_text(json.dumps(part))
    (tmp_path / "results.json").write_text((ROOT / "docs/report/results.json").read_text())
    results = model_report.build(tmp_path, ["m"])
    [row] = results["models"][0]["budgets"]
    assert (row["uniform"]["label"], row["q4_0_bits_per_element"]) == ("tqx_k4v3_mse recent 184",
                                                                        1.22)  # fmt: skip
    files = [f.name for f in model_report.write(tmp_path, results)]
    assert files[-1] == "ppl_vs_kv_bits.png" and (tmp_path / "m" / "ppl_vs_kv_bits.png").exists()
    md = (tmp_path / "models.md").read_text()
    assert "### m: per-layer precision under a bits budget" in md
    assert ("| 1 x 4096 | 2 | 1.980 | 0.00400 | 0.01000 | +0.50% | tqx_k4v3_mse recent 184 "
            "(1.71): +2.00%, KL 0.01250 | +10.00% (1.22) |") in md  # fmt: skip
    assert "![PPL change vs --kv-bits budget](m/ppl_vs_kv_bits.png)" in md
