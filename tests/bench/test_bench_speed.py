"""Decode-speed runs under several kernel choices (``bench speed --kernels``,
``benchmarks/peers_speed.py --kernels``): labels, ratios within a run, what ran, session
options, load averages, the bytes a step reads, and the report's tables and goals."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks.report import report, speed_report
from tqexport.bench import bounds, sessions, speed, speed_table, weights_floor
from tqexport.contract.artifact import open_artifact
from tqexport.contract.files import WEIGHTS_FILE
from tqexport.errors import TQExportError
from tqexport.native import kernel_choice

ROOT = Path(__file__).resolve().parents[2]
#: the ORT session every tqexport speed run opens (DEFAULT_OPTIONS), as ORT reports it
SESSION = {
    "intra_op_num_threads": 1,
    "inter_op_num_threads": 0,
    "execution_mode": "ORT_SEQUENTIAL",
    "graph_optimization_level": "ORT_ENABLE_ALL",
    "enable_mem_pattern": False,
    "enable_cpu_mem_arena": True,
    "allow_spinning": False,
}
MACHINE = dict.fromkeys(
    ["cpu", "cores", "memory_gib", "os", "python", "torch", "onnxruntime", "transformers"], "x"
)


def test_kernel_labels_round_trip():
    assert speed.kernel_label("fp8 recent 32", "native") == "fp8 recent 32 [native]"
    assert speed.split_label("fp8 recent 32 [native]") == ("fp8 recent 32", "native")
    assert speed.split_label("auto [bodies]") == ("auto", "bodies")
    assert speed.split_label("tqexport auto") == ("tqexport auto", None)  # an earlier run
    assert speed.split_label("auto [auto]") == ("auto [auto]", None)


def test_parse_kernels_names_the_choices():
    assert speed.parse_kernels(" native, bodies,auto") == ["native", "bodies", "auto"]
    with pytest.raises(TQExportError) as e:
        speed.parse_kernels("native,foo")
    assert str(e.value) == "--kernels must be one of auto, native, bodies, got 'foo'"
    with pytest.raises(TQExportError) as e:
        speed.parse_kernels(" , ")
    assert str(e.value) == "--kernels needs one or more of auto, native, bodies"


@pytest.fixture
def specs(artifacts):
    return {d: open_artifact(artifacts("tiny-llama", d)).spec for d in ("auto", "fp8")}


def test_run_kernels_resolves_auto_for_the_whole_run(monkeypatch, specs):
    monkeypatch.setattr(kernel_choice, "_ready_library", lambda sanitize=False: (Path("x.so"), ""))
    assert speed.run_kernels(["auto", "native", "bodies"], specs) == ["native", "bodies"]
    assert speed.run_kernels(["bodies", "auto"], specs) == ["bodies", "native"]
    why = "the native kernel library is not built: set ORT_INCLUDE_DIR"
    monkeypatch.setattr(kernel_choice, "_ready_library", lambda sanitize=False: (None, why))
    assert speed.run_kernels(["auto", "bodies"], specs) == ["bodies"]
    with pytest.raises(TQExportError) as e:
        speed.run_kernels(["bodies", "native"], specs)
    assert str(e.value) == f"auto: --kernels native: {why}; use --kernels bodies"


def test_bench_speed_kernels_native_without_the_library_is_one_line(tmp_path):
    script = (
        "import sys, pathlib\n"
        "import tqexport.native.build as b\n"
        f"b.BUILD_DIR = pathlib.Path({str(tmp_path / 'build')!r})\n"
        "b.find_ort_headers = lambda: None\n"
        "from tqexport.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    work = tmp_path / "work"
    args = ["bench", "speed", "tiny-llama", "--kernels", "bodies,native", "--workdir", str(work)]
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(
        "error: auto: --kernels native: the native kernel library is not built: ONNX Runtime "
        "C/C++ API headers not found: set ORT_INCLUDE_DIR"
    ), lines[0]
    assert lines[0].endswith("; use --kernels bodies")
    assert not work.exists()  # nothing built for a run that cannot start


def _fake_decode_run(calls):
    ms = {"auto [native]": 10.0, "fp8 [native]": 8.0, "auto [bodies]": 20.0, "fp8 [bodies]": 32.0}

    def run(arts, context, batch, steps, threads=None, kernels="auto", **kw):
        calls.append((context, batch, dict(kernels)))
        ran = {n: {"kernels": kernels[n], "reason": f"{kernels[n]} because",
                   "session_options": {"threads": threads}} for n in arts}  # fmt: skip
        return {n: ms[n] * batch for n in arts}, ran

    return run


def test_measure_interleaves_every_configuration_under_every_kernel_choice(monkeypatch, artifacts):
    arts = {d: open_artifact(artifacts("tiny-llama", d)) for d in ("auto", "fp8")}
    calls, loads = [], iter(range(1, 100))
    monkeypatch.setattr(speed, "decode_run", _fake_decode_run(calls))
    monkeypatch.setattr(speed, "load_average", lambda: [float(next(loads))] * 3)
    res = speed.measure(arts, [16], [1, 2], steps=2, budget="1MiB", threads=2,
                        kernels=["native", "bodies"])  # fmt: skip
    asked = {"auto [native]": "native", "fp8 [native]": "native", "auto [bodies]": "bodies",
             "fp8 [bodies]": "bodies"}  # fmt: skip
    assert calls == [(16, 1, asked), (16, 2, asked)]  # one interleaved run per point
    assert res["kernels"] == ["native", "bodies"]
    assert res["labels"] == {
        n: {"configuration": n.split(" [")[0], "kernels": k, "reason": f"{k} because"}
        for n, k in asked.items()
    }
    assert res["session_options"] == {"threads": 2}
    assert res["loadavg"] == {"before": [1.0] * 3, "after": [6.0] * 3}
    one, two = res["decode"]
    assert one["loadavg"] == {"before": [2.0] * 3, "after": [3.0] * 3}
    assert two["loadavg"] == {"before": [4.0] * 3, "after": [5.0] * 3}
    assert two["kernels"] == asked
    assert two["ms_per_step"] == {"auto [native]": 20.0, "fp8 [native]": 16.0,
                                  "auto [bodies]": 40.0, "fp8 [bodies]": 64.0}  # fmt: skip
    assert two["tokens_per_second"] == {"auto [native]": 100.0, "fp8 [native]": 125.0,
                                        "auto [bodies]": 50.0, "fp8 [bodies]": 31.25}  # fmt: skip
    # against auto under the same kernels, not across them
    assert two["speed_vs_auto"] == {"auto [native]": 1.0, "fp8 [native]": 1.25,
                                    "auto [bodies]": 1.0, "fp8 [bodies]": 0.625}  # fmt: skip
    assert two["native_over_bodies"] == {"auto": 2.0, "fp8": 4.0}
    for name, art in arts.items():
        files = sum((art.path / f).stat().st_size for f in ("model.onnx", "model.onnx.data"))
        assert res["footprint"][name] == {
            "weights_bytes": files,
            "kv_bytes_per_token": art.spec.bytes_per_token,
            "recent_window": 0,
            "recent_bytes_per_token": 0,
        }
    assert [m["label"] for m in res["memory"]] == ["auto", "fp8"]
    one_choice = speed.measure(arts, [16], [1], steps=2, budget="1MiB", kernels=["bodies"])
    assert one_choice["decode"][0]["native_over_bodies"] == {}


def test_measure_records_what_ran_each_label_and_its_session(artifacts):
    arts = {d: open_artifact(artifacts("tiny-llama", d)) for d in ("auto", "fp8")}
    kernels = speed.run_kernels(["auto", "bodies"], {n: a.spec for n, a in arts.items()})
    res = speed.measure(arts, [16], [1], steps=1, budget="1MiB", threads=1, kernels=kernels)
    want = {"native": kernel_choice.choose(arts["fp8"].spec, "native").reason if "native" in kernels
            else None, "bodies": "function bodies (--kernels bodies)"}  # fmt: skip
    assert res["labels"] == {
        speed.kernel_label(n, k): {"configuration": n, "kernels": k, "reason": want[k]}
        for k in kernels
        for n in arts
    }
    assert res["session_options"] == SESSION
    (row,) = res["decode"]
    assert row["kernels"] == {speed.kernel_label(n, k): k for k in kernels for n in arts}
    assert all(len(row["loadavg"][w]) == 3 for w in ("before", "after"))


def _speed_row(c, b, tps):
    """A ``bench speed`` decode row from tokens/s per label (ratios as measure makes them)."""
    ms = {n: 1000 * b / v for n, v in tps.items()}
    split = {n: speed.split_label(n) for n in tps}
    return {
        "context": c, "batch": b, "ms_per_step": ms, "tokens_per_second": tps,
        "kernels": {n: k for n, (_, k) in split.items()},
        "speed_vs_auto": {n: ms[speed.kernel_label("auto", k)] / ms[n]
                          for n, (_, k) in split.items()},
        "native_over_bodies": {
            c_: ms[speed.kernel_label(c_, "bodies")] / ms[speed.kernel_label(c_, "native")]
            for c_, k in split.values() if k == "native"
        },
        "loadavg": {"before": [1.0, 1.5, 2.0], "after": [1.25, 1.5, 2.0]},
    }  # fmt: skip


FOOTPRINTS = {
    "auto": bounds.footprint(400_000_000, 40_000),
    "turboquant_4bit_nc": bounds.footprint(400_000_000, 5_000),
    "fp8": bounds.footprint(400_000_000, 10_000),
}


def _speed_run():
    def tps(auto_n, tq_n, fp8_n, auto_b, tq_b, fp8_b):
        return {"auto [native]": auto_n, "turboquant_4bit_nc [native]": tq_n,
                "fp8 [native]": fp8_n, "auto [bodies]": auto_b,
                "turboquant_4bit_nc [bodies]": tq_b, "fp8 [bodies]": fp8_b}  # fmt: skip

    rows = [
        _speed_row(1024, 1, tps(20.0, 18.0, 17.0, 15.0, 9.0, 10.0)),
        _speed_row(1024, 8, tps(90.0, 80.0, 70.0, 40.0, 30.0, 32.0)),
        _speed_row(4096, 1, tps(10.0, 12.0, 11.0, 8.0, 5.0, 6.0)),
        _speed_row(4096, 8, tps(20.0, 30.0, 16.0, 10.0, 12.0, 10.0)),
    ]
    labels = {n: {"configuration": speed.split_label(n)[0], "kernels": k,
                  "reason": "native kernels (libtqexport_ort.so)" if k == "native"
                  else "function bodies (--kernels bodies)"}
              for n, k in rows[0]["kernels"].items()}  # fmt: skip
    return {"threads": None, "steps": 4, "budget": "512MiB", "kernels": ["native", "bodies"],
            "kernels_requested": ["auto", "bodies"], "labels": labels,
            "session_options": {**SESSION, "intra_op_num_threads": 0},
            "loadavg": {"before": [1.0, 1.5, 2.0], "after": [1.25, 1.5, 2.0]},
            "footprint": FOOTPRINTS, "decode": rows,
            "memory": [{"label": "auto", "kv_bytes_per_token": 40000, "resident_tokens": 100,
                        "resident_vs_auto": 1.0, "bytes_ratio_auto_over_this": 1.0}]}  # fmt: skip


def test_speed_goals_are_the_native_goals_of_one_run_with_their_bytes_bound():
    got = [(g["goal"], g["met"], g["detail"]) for g in speed_report.speed_goals(_speed_run())]
    assert got == [
        ("turboquant_4bit_nc [native] decodes at >= 1.1x auto [native]'s tokens/s at context "
         "4096, batch 1", True,
         "1.20x: this / auto = 12.0 / 10.0 tokens/s; the bytes per step allow 1.34x"),
        ("turboquant_4bit_nc [native] decodes at >= 1.8x auto [native]'s tokens/s at context "
         "4096, batch 8", False,
         "1.50x: this / auto = 30.0 / 20.0 tokens/s; the bytes per step allow 3.03x"),
        ("turboquant_4bit_nc [native]: batch 8 decodes >= 4.0x the tokens/s of batch 1 at "
         "context 1024", True,
         "4.44x: batch 8 / batch 1 = 80.0 / 18.0 tokens/s; the bytes per step allow 7.35x"),
        ("auto [native]: batch 8 decodes >= 4.0x the tokens/s of batch 1 at context 1024", True,
         "4.50x: batch 8 / batch 1 = 90.0 / 20.0 tokens/s; the bytes per step allow 4.85x"),
        ("turboquant_4bit_nc: the native kernels decode at >= 2.0x the function bodies' "
         "tokens/s at context 4096, batch 8", True,
         "2.50x: native / bodies = 30.0 / 12.0 tokens/s; the bytes per step allow 1.00x"),
        ("fp8: the native kernels decode at >= 2.0x the function bodies' tokens/s at context "
         "4096, batch 8", False,
         "1.60x: native / bodies = 16.0 / 10.0 tokens/s; the bytes per step allow 1.00x"),
    ]  # fmt: skip
    bodies_only = _speed_run()
    for r in bodies_only["decode"]:
        r["tokens_per_second"] = {n: v for n, v in r["tokens_per_second"].items()
                                  if n.endswith("[bodies]")}  # fmt: skip
    assert speed_report.speed_goals(bodies_only) == [{
        "goal": "the native-kernel speed goals", "met": None,
        "detail": "not measured: this run has no [native] rows (run it with --kernels "
        "native,bodies)",
    }]  # fmt: skip


def test_speed_table_has_a_kernels_column_and_old_runs_still_render():
    header, rows = speed_table.speed_table(_speed_run())
    assert header == [
        "context", "batch", "kernels", "auto tok/s", "turboquant_4bit_nc tok/s", "fp8 tok/s",
        "turboquant_4bit_nc vs auto", "fp8 vs auto", "auto native/bodies",
        "turboquant_4bit_nc native/bodies", "fp8 native/bodies",
    ]  # fmt: skip
    assert rows[6:] == [
        ["4096", "8", "native", "20.0", "30.0", "16.0", "1.50x", "0.80x", "2.00x", "2.50x",
         "1.60x"],
        ["4096", "8", "bodies", "10.0", "12.0", "10.0", "1.20x", "1.00x", "-", "-", "-"],
    ]  # fmt: skip
    old = {"steps": 4, "budget": "512MiB", "memory": [], "decode": [{
        "context": 256, "batch": 1, "ms_per_step": {"auto": 50.0, "fp8": 100.0},
        "tokens_per_second": {"auto": 20.0, "fp8": 10.0},
        "speed_vs_auto": {"auto": 1.0, "fp8": 0.5},
    }]}  # fmt: skip
    assert speed_table.speed_table(old) == (
        ["context", "batch", "kernels", "auto tok/s", "fp8 tok/s", "fp8 vs auto"],
        [["256", "1", "-", "20.0", "10.0", "0.50x"]],
    )
    assert speed_table.speed_notes(old) == []
    md = "\n".join(speed_report.speed_markdown(old))
    assert "| 256 | 1 | - | 20.0 | 10.0 | 0.50x |" in md


def test_report_shows_what_ran_and_the_native_goals_of_a_speed_run(tmp_path):
    run = _speed_run()
    results = {"model": "m", "command": "c", "rows": [], "quality": None, "peer": None,
               "peer_note": None, "speed": run, "goals": report.goals([], run),
               "machine": MACHINE}  # fmt: skip
    report.write(tmp_path, results)
    md = (tmp_path / "report.md").read_text()
    section = md[md.index("## Decode speed (ONNX Runtime CPU)") : md.index("## Goals")]
    assert (
        "Kernels: [native] native kernels (libtqexport_ort.so); [bodies] function bodies "
        "(--kernels bodies). ORT session: ORT's default intra-op threads, spinning off, "
        "ORT_ENABLE_ALL, memory pattern off, CPU arena on. Load average (1/5/15 min): before "
        "1.00/1.50/2.00, after 1.25/1.50/2.00." in section
    )
    assert "| 4096 | 8 | bodies | 10.0 | 12.0 | 10.0 | 1.20x | 1.00x | - | - | - |" in section
    assert (
        "- turboquant_4bit_nc [native] decodes at >= 1.8x auto [native]'s tokens/s at context "
        "4096, batch 8: **NOT MET** (1.50x: this / auto = 30.0 / 20.0 tokens/s; the bytes per "
        "step allow 3.03x)" in md
    )
    assert (
        "- fp8: the native kernels decode at >= 2.0x the function bodies' tokens/s at context "
        "4096, batch 8: **NOT MET** (1.60x: native / bodies = 16.0 / 10.0 tokens/s; the bytes "
        "per step allow 1.00x)" in md
    )


def _peer_run():
    """A peer-speed run with kernels, GenAI at 1024 only, llama.cpp at batch 1."""
    tps = {
        (1024, 1): {"tqexport auto [native]": 30.0, "tqexport turboquant_4bit_nc [native]": 25.0,
                    "tqexport auto [bodies]": 20.0, "tqexport turboquant_4bit_nc [bodies]": 12.0,
                    "ORT GenAI fp32": 20.0, "llama.cpp f16": 60.0, "llama.cpp q4_0": 54.0},
        (1024, 8): {"tqexport auto [native]": 120.0, "tqexport turboquant_4bit_nc [native]": 110.0,
                    "tqexport auto [bodies]": 70.0, "tqexport turboquant_4bit_nc [bodies]": 40.0,
                    "ORT GenAI fp32": 100.0},
        (4096, 1): {"tqexport auto [native]": 12.0, "tqexport turboquant_4bit_nc [native]": 14.4,
                    "tqexport auto [bodies]": 9.0, "tqexport turboquant_4bit_nc [bodies]": 6.0},
        (4096, 8): {"tqexport auto [native]": 24.0, "tqexport turboquant_4bit_nc [native]": 48.0,
                    "tqexport auto [bodies]": 14.0, "tqexport turboquant_4bit_nc [bodies]": 16.0},
    }  # fmt: skip
    genai = sessions.genai_session(
        {"model": {"decoder": {"session_options": {"intra_op_num_threads": 2,
                                                   sessions.SPINNING_ENTRY: "0"}}}}, 2
    )  # fmt: skip
    ours = {**SESSION, "intra_op_num_threads": 2}
    return {
        "command": "benchmarks/peers_speed.py --json x", "versions": {"onnxruntime": "1"},
        "threads": 2, "steps": 4, "kernels": ["native", "bodies"],
        "kernels_requested": ["auto", "bodies"],
        "systems": {n: {"configuration": speed.split_label(n[9:])[0],
                        "kernels": speed.split_label(n)[1], "reason": f"{speed.split_label(n)[1]}"}
                    for n in tps[(4096, 8)]},
        "session_options": {"tqexport": ours, "ORT GenAI fp32": genai,
                            "genai_overlay": {}, "note": None,
                            "differences": sessions.differences(ours, genai)},
        "footprint": {"tqexport auto": bounds.footprint(540_000_000, 46_080),
                      "tqexport turboquant_4bit_nc": bounds.footprint(541_000_000, 6_000),
                      "ORT GenAI fp32": bounds.footprint(540_000_000, 46_080),
                      "llama.cpp f16": bounds.footprint(108_000_000, 23_040),
                      "llama.cpp q4_0": bounds.footprint(108_000_000, 6_480)},
        "loadavg": {"before": [0.5, 0.6, 0.7], "after": [2.5, 1.0, 0.8]},
        "decode": [{"context": c, "batch": b, "tokens_per_second": t,
                    "loadavg": {"before": [0.5 + b, 0.6, 0.7], "after": [1.5 + b, 0.6, 0.7]}}
                   for (c, b), t in tps.items()],
    }  # fmt: skip


def test_peer_speed_goals_add_the_native_goals_of_the_one_run():
    got = [(g["met"], g["goal"], g["detail"].split("; ")[0])
           for g in speed_report.peer_speed_goals(_peer_run())]  # fmt: skip
    tq, auto, genai = (
        "tqexport turboquant_4bit_nc [native]",
        "tqexport auto [native]",
        "ORT GenAI fp32",
    )
    assert got == [
        (True, f"{auto}: batch 8 decodes >= 3.5x the tokens/s of batch 1 at context 1024",
         "4.00x: batch 8 / batch 1 = 120.0 / 30.0 tokens/s"),
        (True, f"{tq}: batch 8 decodes >= 4.0x the tokens/s of batch 1 at context 1024",
         "4.40x: batch 8 / batch 1 = 110.0 / 25.0 tokens/s"),
        (None, f"tqexport fp8 [native] decodes at >= 0.6x {auto}'s tokens/s at context 4096, "
         "batch 1", "not measured in this run"),
        (True, f"{tq} decodes at >= 0.5x {auto}'s tokens/s at context 4096, batch 1",
         "1.20x: this / auto = 14.4 / 12.0 tokens/s"),
        (True, f"{auto} decodes at >= 0.8x {genai}'s tokens/s at context 1024, batch 1",
         "1.50x: auto / GenAI = 30.0 / 20.0 tokens/s"),
        (True, f"{auto} decodes at >= 0.6x {genai}'s tokens/s at context 1024, batch 8",
         "1.20x: auto / GenAI = 120.0 / 100.0 tokens/s"),
        (True, f"{tq} decodes at >= 1.1x {auto}'s tokens/s at context 4096, batch 1",
         "1.20x: this / auto = 14.4 / 12.0 tokens/s"),
        (True, f"{tq} decodes at >= 1.8x {auto}'s tokens/s at context 4096, batch 8",
         "2.00x: this / auto = 48.0 / 24.0 tokens/s"),
        # the earlier turboquant_4bit_nc scaling goal (4.0x) is this one: listed once
        (True, f"{auto}: batch 8 decodes >= 4.0x the tokens/s of batch 1 at context 1024",
         "4.00x: batch 8 / batch 1 = 120.0 / 30.0 tokens/s"),
        (True, f"{auto} decodes at >= 1.3x {genai}'s tokens/s at context 1024, batch 1",
         "1.50x: auto / GenAI = 30.0 / 20.0 tokens/s"),
        (False, f"{auto} decodes at >= 1.3x {genai}'s tokens/s at context 1024, batch 8",
         "1.20x: auto / GenAI = 120.0 / 100.0 tokens/s"),
        (None, f"{auto} decodes at >= 1.3x {genai}'s tokens/s at context 4096, batch 1",
         "not measured in this run"),
        (None, f"{auto} decodes at >= 1.3x {genai}'s tokens/s at context 4096, batch 8",
         "not measured in this run"),
        (True, "tqexport turboquant_4bit_nc: the native kernels decode at >= 2.0x the function "
         "bodies' tokens/s at context 4096, batch 8", "3.00x: native / bodies = 48.0 / 16.0 "
         "tokens/s"),
    ]  # fmt: skip
    details = [g["detail"] for g in speed_report.peer_speed_goals(_peer_run())]
    # auto and GenAI read the same bytes: a lead over it is not bytes
    assert details[4].endswith("; the bytes per step allow 1.00x")


def test_auto_over_genai_goals_name_the_weights_floor_where_the_run_measured_it():
    ps = _peer_run()
    for r in ps["decode"]:
        if r["context"] == 1024:
            r["tokens_per_second"][weights_floor.SYSTEM] = {1: 40.0, 8: 160.0}[r["batch"]]
    details = {g["goal"]: g["detail"] for g in speed_report.peer_speed_goals(ps)}
    goal = ("tqexport auto [native] decodes at >= 1.3x ORT GenAI fp32's tokens/s at context "
            "1024, batch {}")  # fmt: skip
    assert details[goal.format(1)] == (
        "1.50x: auto / GenAI = 30.0 / 20.0 tokens/s; the bytes per step allow 1.00x; ORT's "
        "weight MatMuls alone run at 40.0 tokens/s, 2.00x GenAI (the most any graph on these "
        "weights through ORT can lead it by), and auto steps at 75% of their rate"
    )
    assert details[goal.format(8)].endswith(
        "alone run at 160.0 tokens/s, 1.60x GenAI (the most any graph on these weights through "
        "ORT can lead it by), and auto steps at 75% of their rate"
    )
    assert details[goal.format(1).replace("1024", "4096")] == "not measured in this run"


def test_weights_floor_multiplies_by_every_weight_of_the_artifact_in_place(artifacts):
    """One MatMul per weight the artifact's MatMuls read, its initializers the artifact's own
    external tensors (nothing copied), and each output the rows times that weight."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    art = open_artifact(artifacts("tiny-llama", "auto"))
    stored = onnx.load(str(art.model_file), load_external_data=False)
    products = weights_floor.weight_products(stored)
    assert all(p.nodes == [] and len(p.initializers) == 1 for p in products)
    weights = [p.initializers[0] for p in products]
    graph_matmuls = [n for n in stored.graph.node if n.op_type == "MatMul"]
    assert len(weights) == len(graph_matmuls) == 43  # 6 layers x 7 projections + lm_head
    model = weights_floor.floor_model(art)
    assert [t.name for t in model.graph.initializer] == [w.name for w in weights]
    assert all(
        t.data_location == onnx.TensorProto.EXTERNAL
        and {e.key: e.value for e in t.external_data}["location"] == WEIGHTS_FILE
        for t in model.graph.initializer
    )
    assert weights_floor.weights_bytes(model) == sum(4 * int(np.prod(w.dims)) for w in weights)
    floor = weights_floor.WeightsFloor(art, batch=3, threads=1)
    stored_with_data = onnx.load(str(art.model_file)).graph.initializer
    full = {t.name: numpy_helper.to_array(t) for t in stored_with_data}
    outs = floor.step()
    assert len(outs) == len(weights)
    for w, y in zip(weights, outs, strict=True):
        x = floor.feed[f"rows_{w.dims[0]}"]
        assert x.shape == (3, w.dims[0])
        np.testing.assert_allclose(y, x @ full[w.name], rtol=1e-5, atol=1e-5)


def test_weights_floor_reads_a_tied_lm_head_through_its_transpose():
    """A tied embedding's lm_head multiplies by Transpose(embedding): the floor keeps that
    weight (once, however many MatMuls read it) behind the same Transpose, and no Transpose of
    an activation or MatMul of two activations counts."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(1)
    emb, w = rng.standard_normal((10, 4), np.float32), rng.standard_normal((4, 6), np.float32)
    f = onnx.TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "emb_t"], ["logits"]),
        helper.make_node("MatMul", ["x", "emb_t"], ["again"]),
        helper.make_node("Transpose", ["x"], ["xt"]),
        helper.make_node("MatMul", ["xt", "x"], ["gram"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, [2, 4])],
        [helper.make_tensor_value_info(n, f, None) for n in ("h", "logits", "again", "gram")],
        [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert [(p.b, [n.op_type for n in p.nodes], [t.name for t in p.initializers], p.k, p.n)
            for p in weights_floor.weight_products(model)] == [
        ("w", [], ["w"], 4, 6), ("emb_t", ["Transpose"], ["emb"], 4, 10)
    ]  # fmt: skip
    floor = weights_floor.floor_graph(model)
    assert [i.name for i in floor.graph.input] == ["rows_4"]
    assert [n.op_type for n in floor.graph.node] == ["MatMul", "Transpose", "MatMul"]
    assert weights_floor.weights_bytes(floor) == 4 * (emb.size + w.size)
    x = rng.standard_normal((3, 4), np.float32)
    y_w, y_emb = ort.InferenceSession(floor.SerializeToString()).run(None, {"rows_4": x})
    np.testing.assert_allclose(y_w, x @ w, rtol=1e-6)
    np.testing.assert_allclose(y_emb, x @ emb.T, rtol=1e-6)


def test_report_renders_a_peer_run_with_kernels_sessions_load_and_bounds(tmp_path):
    ps = _peer_run()
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(ps))
    ps = speed_report.read_peer_speed(path)
    results = {"model": "m", "command": "c", "rows": [], "quality": None, "peer": None,
               "peer_note": None, "peer_speed": ps, "goals": report.goals([], None, (), ps),
               "machine": MACHINE}  # fmt: skip
    report.write(tmp_path / "r", results)
    md = (tmp_path / "r" / "report.md").read_text()
    section = md[md.index("## Decode speed against peers") : md.index("## Goals")]
    assert (
        "ORT sessions: tqexport 2 intra-op threads, spinning off, ORT_ENABLE_ALL, memory "
        "pattern off, CPU arena on; ORT GenAI fp32 2 intra-op threads, spinning off, "
        "ORT_ENABLE_ALL, memory pattern on, CPU arena on; they differ in enable_mem_pattern: "
        "tqexport False, GenAI True." in section
    )
    assert (
        "Load average (1/5/15 min) over the run: before 0.50/0.60/0.70, after 2.50/1.00/0.80."
        in (section)
    )
    assert "| auto [native] / GenAI | load 1 min before / after |" in section
    assert "| 1024 | 8 | 120.0 | 110.0 | 70.0 | 40.0 | 100.0 | - | - | 1.20x | 8.50 / 9.50 |" in (
        section
    )
    # bytes per step, MB: weights + batch x context x KV bytes per token
    assert (
        "| context | batch | tqexport auto | tqexport turboquant_4bit_nc | ORT GenAI fp32 | "
        in (section)
    )
    assert "| 4096 | 8 | 2049.9 | 737.6 | 2049.9 | 863.0 | 320.3 |" in section
    assert "tqexport auto 540.0 MB + 46.08 KB/token" in section
    assert (
        "llama.cpp runs the GGUF's quantized weights: 108.0 MB on disk against tqexport's "
        "540.0 MB of fp32 weights, 5.00x fewer bytes." in section
    )
    # lead = llama / tqexport auto [native]; bytes ratio = auto's bytes / llama's
    assert "| 1024 | 1 | llama.cpp f16 | 2.00x | 4.46x | 0.45x |" in section
    assert "| 1024 | 1 | llama.cpp q4_0 | 1.80x | 5.12x | 0.35x |" in section


def test_step_bytes_read_the_weights_once_and_each_sequence_cache():
    fp = bounds.footprint(1000, 10, recent_window=32, recent_bytes_per_token=40)
    assert bounds.step_bytes(fp, 16, 1) == 1000 + 16 * 40  # all within the window
    assert bounds.step_bytes(fp, 100, 3) == 1000 + 3 * (68 * 10 + 32 * 40)
    assert bounds.step_bytes(bounds.footprint(1000, 10), 100, 3) == 1000 + 3000


def test_genai_and_gguf_footprints_come_from_their_files(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"x" * 30)
    (tmp_path / "model.onnx.data").write_bytes(b"x" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 500)
    cfg = {"model": {"decoder": {"num_hidden_layers": 30, "num_key_value_heads": 3,
                                 "head_size": 64}}}  # fmt: skip
    assert bounds.genai_footprint(tmp_path, cfg) == bounds.footprint(1030, 2 * 30 * 3 * 64 * 4)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 77)
    assert bounds.gguf_footprint(gguf, 11520, 4.5) == bounds.footprint(77, 6480.0)


def test_genai_session_options_say_where_each_comes_from():
    builder = {"model": {"decoder": {"session_options": {"log_id": "onnxruntime-genai",
                                                         "provider_options": []}}}}  # fmt: skip
    got = sessions.genai_session(builder, cpus=2)
    assert got == {
        "intra_op_num_threads": 1,  # half the hardware threads
        "inter_op_num_threads": 0,
        "execution_mode": "ORT_SEQUENTIAL",
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "enable_mem_pattern": True,
        "enable_cpu_mem_arena": True,
        "allow_spinning": True,
        "set_by": {
            "intra_op_num_threads": "GenAI's default",
            "inter_op_num_threads": "ORT's default",
            "execution_mode": "ORT's default",
            "graph_optimization_level": "ORT's default",
            "enable_mem_pattern": "ORT's default",
            "enable_cpu_mem_arena": "ORT's default",
            "allow_spinning": "ORT's default",
        },
    }
    assert sessions.genai_default_threads(64) == 16 and sessions.genai_default_threads(1) == 1
    ours = {**SESSION, "intra_op_num_threads": 2}
    assert sessions.differences(ours, got) == [
        "intra_op_num_threads: tqexport 2, GenAI 1",
        "enable_mem_pattern: tqexport False, GenAI True",
        "allow_spinning: tqexport False, GenAI True",
    ]
    overlay = sessions.genai_overlay(2, False)
    assert overlay == {"model": {"decoder": {"session_options": {
        "intra_op_num_threads": 2, "session.intra_op.allow_spinning": "0"}}}}  # fmt: skip
    same = sessions.genai_session(sessions.merged(builder, overlay), cpus=2)
    assert same["set_by"]["allow_spinning"] == "genai_config.json"
    assert sessions.differences(ours, same) == ["enable_mem_pattern: tqexport False, GenAI True"]
    assert builder["model"]["decoder"]["session_options"] == {  # merged copies
        "log_id": "onnxruntime-genai", "provider_options": []}  # fmt: skip
    assert sessions.genai_overlay(None, None) == {}


def _peers_speed():
    spec = importlib.util.spec_from_file_location(
        "peers_speed", ROOT / "benchmarks" / "peers_speed.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_open_genai_keeps_the_part_of_the_overlay_genai_takes(monkeypatch):
    mod = _peers_speed()

    class Config:
        def __init__(self, path):
            self.overlays = []

        def clear_providers(self):
            pass

        def overlay(self, text):
            if "allow_spinning" in text:
                raise RuntimeError("Unknown value: session.intra_op.allow_spinning")
            self.overlays.append(json.loads(text))

    og = types.SimpleNamespace(Config=Config, Model=lambda cfg: cfg.overlays)
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", og)
    threads = {"model": {"decoder": {"session_options": {"intra_op_num_threads": 2}}}}
    model, overlay, note = mod.open_genai(Path("m"), 2, False)
    assert model == [threads] and overlay == threads
    assert note == (
        'this GenAI refused the overlay {"model": {"decoder": {"session_options": '
        '{"intra_op_num_threads": 2, "session.intra_op.allow_spinning": "0"}}}}: '
        "Unknown value: session.intra_op.allow_spinning"
    )
    del Config.overlay  # a GenAI without Config.overlay runs as its config says
    model, overlay, note = mod.open_genai(Path("m"), 2, None)
    assert (model, overlay) == ([], {})
    assert note.startswith('this GenAI refused the overlay {"model"') and "overlay'" in note
    record = mod.genai_session_record({**SESSION, "intra_op_num_threads": 2},
                                      {"model": {"decoder": {}}}, threads, None)  # fmt: skip
    assert record["genai_overlay"] == threads and record["note"] is None
    assert record["ORT GenAI fp32"]["intra_op_num_threads"] == 2
    assert record["differences"] == [
        "enable_mem_pattern: tqexport False, GenAI True",
        "allow_spinning: tqexport False, GenAI True",
    ]


def test_peers_speed_gives_genai_the_converted_checkpoint_of_a_gguf_builtin(tmp_path):
    """GenAI's builder reads the HF directory tqexport converted SmolLM2's GGUF into: its files
    linked, config.json with the architecture the builder needs."""
    from tqexport.models import builtins, cache

    out = _peers_speed().hf_dir("smollm2", tmp_path / "hf")
    src = cache.gguf_cache(builtins.builtin_gguf("smollm2"))
    assert sorted(f.name for f in out.iterdir()) == sorted(f.name for f in src.iterdir())
    assert all((out / f.name).resolve() == f.resolve() for f in src.iterdir()
               if f.name != "config.json")  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30


def test_peers_speed_records_kernels_load_sessions_and_footprints(tmp_path):
    mod = _peers_speed()
    out = tmp_path / "peers.json"
    mod.main(["--model", "tiny-llama", "--dtypes", "auto,turboquant_4bit_nc", "--contexts",
              "16", "--batches", "1,2", "--steps", "1", "--kernels", "auto,bodies",
              "--no-genai", "--no-llama", "--workdir", str(tmp_path / "w"), "--json",
              str(out)])  # fmt: skip
    d = json.loads(out.read_text())
    arts = {n: open_artifact(tmp_path / "w" / f"tiny-llama-{n}-auto") for n in
            ("auto", "turboquant_4bit_nc")}  # fmt: skip
    assert d["weights"] == {"auto": "fp32", "turboquant_4bit_nc": "fp32"}
    kernels = speed.run_kernels(["auto", "bodies"], {n: a.spec for n, a in arts.items()})
    systems = [f"tqexport {speed.kernel_label(n, k)}" for k in kernels for n in arts]
    assert d["kernels"] == kernels and d["kernels_requested"] == ["auto", "bodies"]
    assert list(d["systems"]) == systems
    assert {(v["configuration"], v["kernels"]) for v in d["systems"].values()} == {
        (n, k) for k in kernels for n in arts
    }
    assert d["session_options"] == {"tqexport": {**SESSION, "intra_op_num_threads": 2}}
    floor = weights_floor.weights_bytes(weights_floor.floor_model(arts["auto"]))
    assert d["footprint"] == {**{f"tqexport {n}": bounds.artifact_footprint(a)
                                 for n, a in arts.items()},
                              weights_floor.SYSTEM: bounds.footprint(floor, 0)}  # fmt: skip
    measured = [*systems, weights_floor.SYSTEM]
    assert [(r["context"], r["batch"], list(r["tokens_per_second"])) for r in d["decode"]] == [
        (16, 1, measured), (16, 2, measured)
    ]  # fmt: skip
    for r in [d, *d["decode"]]:
        assert sorted(r["loadavg"]) == ["after", "before"]
        assert all(len(r["loadavg"][w]) == 3 for w in ("before", "after"))
    speed_report.read_peer_speed(out)


def test_peers_speed_builds_genai_int4_at_the_accuracy_level_of_our_blocks(tmp_path, monkeypatch):
    """GenAI's int4 peer: its builder's RTN blocks of 32 at accuracy level 4, as tqexport's
    block-quantized weights run; fp32 as before."""
    mod = _peers_speed()
    ran = []
    monkeypatch.setattr(mod, "hf_dir", lambda model, out: out)
    monkeypatch.setattr(mod.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    assert mod.genai_model_dir("smollm2", tmp_path, "int4") == tmp_path / "genai-smollm2-int4"
    mod.genai_model_dir("smollm2", tmp_path)
    flags = [cmd[cmd.index("-p") :] for cmd in ran]
    assert flags == [
        ["-p", "int4", "-e", "cpu", "-c", str(tmp_path / "genai-cache"), "--extra_options",
         "int4_accuracy_level=4", "int4_block_size=32"],
        ["-p", "fp32", "-e", "cpu", "-c", str(tmp_path / "genai-cache")],
    ]  # fmt: skip
    assert mod.genai_system("fp32") == sessions.GENAI == "ORT GenAI fp32"


def test_peers_speed_bad_kernels_is_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/peers_speed.py", "--kernels", "fast", "--workdir",
         str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: --kernels must be one of auto, native, bodies, got 'fast'"]
    assert not (tmp_path / "w").exists()


def test_a_long_peer_prompt_reports_each_chunk_and_feeds_it_all(capsys):
    """The prompt is fed in consecutive slices covering it once; past PREFILL_REPORT tokens
    each slice prints one progress line on stderr, a short prompt none."""
    mod = _peers_speed()
    fed = []
    mod.prefill("GenAI int4", mod.PREFILL_REPORT + 5, 2048, lambda a, b: fed.append((a, b)))
    total = mod.PREFILL_REPORT + 5
    assert fed == [(a, min(total, a + 2048)) for a in range(0, total, 2048)]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(fed)
    assert lines[-1].startswith(f"  GenAI int4: prompt {total}/{total} tokens (")
    fed.clear()
    mod.prefill("llama.cpp f16", 1000, 2048, lambda a, b: fed.append((a, b)))
    assert fed == [(0, 1000)] and capsys.readouterr().err == ""
