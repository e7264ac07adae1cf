"""``tqexport calibrate`` (the per-layer cost table) and ``--kv-bits`` (the knapsack over it)."""

import importlib.util
import itertools
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from helpers import dense, main_inproc

from tqexport.errors import TQExportError
from tqexport.kvplan import calibration as cal
from tqexport.kvplan.kv_budget import (
    as_kv_layers,
    candidate_bits,
    choose,
    layer_elements,
    least_cost,
)
from tqexport.kvplan.resolve import resolve
from tqexport.models.config import describe_model
from tqexport.spec import BuildRequest


def table_for(desc, candidates, cost):
    return cal.Table(desc.identity(), {"name": "t"}, tuple(candidates), tuple(map(tuple, cost)),
                     1.0, 0.0)  # fmt: skip


def test_candidate_bits_are_the_bench_all_in_bits_of_each_layer():
    desc = dense(3, head_size=64, dtype="float32")
    bits = candidate_bits(desc, ("fp8", "tqx_k4v2_mse:w24:s8"))
    n = 2 * 2 * 64  # K and V elements per token of a layer: 2 kv heads of 64
    # auto counted at 16 bits, fp8 at 8, tqx_k4v2_mse 52 bytes per token-head + 32 exact tokens
    # of 16 bits amortized over 4096
    want = [16 * n, 8 * n, 8 * 52 * 2 + Fraction(16 * n * 32, 4096)]
    assert bits == [want] * 3
    assert float(want[2] / n) == 3.375


def test_the_default_candidates_reach_down_to_tqx_k3v2_mse():
    """tqx_k3v2_mse: 24 bytes of 3-bit keys + norm, 16 of 2-bit values + norm = 44 bytes per
    token-head at D = 64 (2.75 bits); with 24 recent + 8 sink tokens 2.875."""
    desc = dense(2, head_size=64, dtype="float32")
    bits = candidate_bits(desc, cal.DEFAULT_CANDIDATES)
    n = 2 * 2 * 64
    per_elem = {c: bits[0][i + 1] / n for i, c in enumerate(cal.DEFAULT_CANDIDATES)}
    assert per_elem["tqx_k3v2_mse"] == Fraction(11, 4)
    assert per_elem["tqx_k3v2_mse:w24:s8"] == Fraction(23, 8)
    assert min(per_elem.values()) == Fraction(11, 4)
    table = table_for(desc, cal.DEFAULT_CANDIDATES, [[0.1] * len(cal.DEFAULT_CANDIDATES)] * 2)
    assert choose(desc, table, 3.0).bits_per_element <= 3


def test_choose_is_the_exact_optimum_of_the_knapsack():
    desc = dense(4, dtype="float32")
    cands = ("fp8", "tqx_k4v4", "tqx_k4v2_mse", "tqx_k4v2_mse:w24:s8")
    cost = [[0.3, 1.0, 4.0, 2.0], [0.1, 0.2, 0.5, 0.4], [0.2, 3.0, 9.0, 1.0], [0.05, 0.1, 0.3, 0.2]]
    table = table_for(desc, cands, cost)
    bits = candidate_bits(desc, cands)
    elems = sum(layer_elements(desc))
    for budget in (3.25, 3.3, 3.5, 4.0, 4.5, 6.0, 9.0, 16.0):
        best = None
        for picks in itertools.product(range(5), repeat=4):
            b = sum(bits[i][j] for i, j in enumerate(picks))
            c = sum(([0.0, *cost[i]])[j] for i, j in enumerate(picks))
            if b <= Fraction(budget) * elems and (best is None or c < best[0] - 1e-12):
                best = (c, picks)
        got = choose(desc, table, budget)
        assert got.predicted_cost == pytest.approx(best[0], abs=1e-12), budget
        assert got.bits_per_element <= Fraction(budget)
    assert choose(desc, table, 16.0).kv_layers == "0-3:auto"
    assert choose(desc, table, 3.25).kv_layers == "0-3:tqx_k4v2_mse"


def test_least_cost_takes_units_with_any_number_of_options():
    bits = [[Fraction(0), Fraction(2)], [Fraction(0), Fraction(1), Fraction(3)]]
    cost = [[5.0, 1.0], [3.0, 2.0, 0.5]]
    assert least_cost(bits, cost, Fraction(2)) == (Fraction(2), 4.0, (1, 0))
    assert least_cost(bits, cost, Fraction(3)) == (Fraction(3), 3.0, (1, 1))
    assert least_cost(bits, cost, Fraction(5)) == (Fraction(5), 1.5, (1, 2))
    assert least_cost(bits, cost, Fraction(0)) == (Fraction(0), 8.0, (0, 0))
    assert least_cost(bits, cost, Fraction(-1)) is None


def test_least_cost_scales_past_its_front_limit_and_stays_feasible(monkeypatch):
    """Past MAX_FRONT plans per layer the front is thinned: the plan still fits the budget and
    costs at least the exact optimum (found with an unlimited front), never 4 GB of states."""
    import random

    from tqexport.kvplan import kv_budget

    rng = random.Random(0)
    bits = [[Fraction(rng.randint(0, 4096 * 64), 4096) for _ in range(12)] for _ in range(8)]
    cost = [[rng.random() for _ in range(12)] for _ in range(8)]
    limit = sum(sum(r) / len(r) for r in bits)
    exact = least_cost(bits, cost, limit)
    monkeypatch.setattr(kv_budget, "MAX_FRONT", 4)
    thinned = least_cost(bits, cost, limit)
    assert thinned[0] <= limit and thinned[1] >= exact[1]
    assert thinned[0] == sum(bits[u][j] for u, j in enumerate(thinned[2]))
    assert thinned[1] == pytest.approx(sum(cost[u][j] for u, j in enumerate(thinned[2])))


def test_a_budget_below_every_candidate_is_one_error():
    desc = dense(2, dtype="float32")
    table = table_for(desc, ("fp8",), [[0.1], [0.1]])
    with pytest.raises(TQExportError, match=r"^--kv-bits 4 is below the fewest bits the table's "
                       r"candidates reach \(8.0000 per element\); give at least that"):  # fmt: skip
        choose(desc, table, 4)


def test_as_kv_layers_joins_runs():
    assert as_kv_layers(("auto", "auto", "fp8", "tqx_k4v4:w8", "fp8")) == (
        "0-1:auto,2:fp8,3:tqx_k4v4:w8,4:fp8"
    )
    spec = resolve(
        dense(5), BuildRequest("auto", kv_layers="0-1:auto,2:fp8,3:tqx_k4v4:w8,4:fp8")
    ).spec
    assert [la.kv_cache_dtype for la in spec.layers][2:] == ["fp8", "tqx_k4v4", "fp8"]


def test_calibrate_writes_a_table_that_kv_bits_reads(tmp_path, capsys):
    out = tmp_path / "cal.json"
    code, stdout, _ = main_inproc(capsys, "calibrate", "tiny-llama", "-o", out, "--candidates",
                                  "fp8,tqx_k4v4:w4", "--tokens", "24")  # fmt: skip
    assert code == 0, stdout
    d = json.loads(out.read_text())
    desc = describe_model("tiny-llama")
    assert (d["format"], d["version"], d["model"]) == ("tqexport-kv-calibration", 2,
                                                       desc.identity())  # fmt: skip
    assert d["key_transform"] == "none"
    assert d["candidates"] == ["fp8", "tqx_k4v4:w4"]
    assert d["text"]["tokens"] == 24 and len(d["text"]["sha256"]) == 64
    assert len(d["cost"]) == 6 and all(len(r) == 2 and min(r) >= 0 for r in d["cost"])
    assert d["elapsed_seconds"] > 0
    assert "6 layers x 2 candidates on 24 tokens" in stdout
    table = cal.read_table(out)
    choice = choose(desc, table, 8.0)
    code, stdout, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-bits", "8",
                                    "--calibration", out, "--json")  # fmt: skip
    assert code == 0
    layers = json.loads(stdout)["layers"]
    assert [la["kv_cache_dtype"] for la in layers] == [c.split(":")[0] for c in choice.candidates]
    assert f"--kv-bits 8 chose --kv-layers {choice.kv_layers}: " in err


def test_calibration_measures_only_the_changed_layer():
    """Skipping the unchanged layers reproduces the baseline exactly (auto: KL 0), and a
    quantized layer costs something."""
    from tqexport.kvplan.calibration_sim import LayerSimulation
    from tqexport.metrics import Totals
    from tqexport.models.loader import load_model

    lm = load_model("tiny-llama", "float32")
    ids = list(range(3, 40))
    sim = LayerSimulation(lm, ids)
    for layer in (0, 3, 5):
        assert sim.logits(layer, "auto", 0, 0).equal(sim.baseline)
        t = Totals()
        t.add(sim.logits(layer, "tqx_k4v2_mse", 0, 0), ids, sim.baseline)
        assert t.summary()["kl"] > 0
    # a window over every token keeps the layer exact
    assert sim.logits(2, "tqx_k4v2_mse", len(ids), 0).equal(sim.baseline)


def model_logits(lm, ids, implementation="eager"):
    """The model's own logits of ``ids`` under one of transformers' attention functions."""
    import torch

    for m in lm.model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = implementation
    with torch.no_grad():
        return lm.model(torch.tensor([ids]), use_cache=False).logits[0]


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-gemma2", "tiny-mistral"])
def test_simulation_attends_as_the_model_in_sliding_and_softcapped_layers(model):
    """With nothing quantized the simulated logits are transformers' eager ones (sliding window
    8 over 40 tokens; Gemma 2: attention and final-logit softcaps), every layer re-run from its
    own inputs reproduces them (Gemma 3: local and global rotary), and a sliding layer whose
    recent window covers its whole window (w8) is exact while w7 is not."""
    from tqexport.kvplan.calibration_sim import LayerSimulation
    from tqexport.models.loader import load_model

    lm = load_model(model, "float32")
    ids = list(range(3, 43))
    ref = model_logits(lm, ids)
    sim = LayerSimulation(lm, ids)
    assert (sim.baseline - ref).abs().max().item() <= 1e-5
    sliding = [la.index for la in lm.description.layers if la.window == 8]
    assert sliding and len(ids) > 8
    for layer in range(len(lm.description.layers)):
        assert sim.logits(layer, "auto", 0, 0).equal(sim.baseline), layer
    assert sim.logits(sliding[-1], "tqx_k4v2_mse", 8, 0).equal(sim.baseline)
    assert not sim.logits(sliding[-1], "tqx_k4v2_mse", 7, 0).equal(sim.baseline)


def test_simulation_refuses_a_model_without_decoder_layers():
    from types import SimpleNamespace

    from tqexport.kvplan.calibration_sim import LayerSimulation

    lm = SimpleNamespace(description=dense(2), model=SimpleNamespace(model=None))
    with pytest.raises(TQExportError) as e:
        LayerSimulation(lm, [1, 2, 3])
    assert str(e.value) == (
        f"calibrate needs a decoder with .model.layers; {lm.description.name} is "
        f"{lm.description.architecture}"
    )


def test_a_sliding_layer_counts_only_its_window():
    """tiny-gemma3: layers 0-4 slide over 8 tokens, so each stores 8 tokens of a 4096-token
    sequence (as the recent windows do); layer 5 stores every token."""
    desc = describe_model("tiny-gemma3")
    n = 2 * 2 * 64  # K and V elements per token of a layer: 2 kv heads of 64
    bits = candidate_bits(desc, ("fp8", "tqx_k4v2_mse:w4:s2"))
    held = Fraction(8, 4096)
    # tqx_k4v2_mse: 52 bytes per token-head, and its 4 + 2 exact tokens at 16 bits
    k4v2 = 8 * 52 * 2
    assert bits[:5] == [[16 * n * held, 8 * n * held,
                         k4v2 * held + 16 * n * Fraction(6, 4096)]] * 5  # fmt: skip
    assert bits[5] == [16 * n, 8 * n, k4v2 + 16 * n * Fraction(6, 4096)]


def test_calibration_kl_is_the_benchmark_kl():
    """calibrate's KL (baseline log-probabilities computed once) is Totals' to the last bit."""
    from tqexport.kvplan.calibration_sim import LayerSimulation
    from tqexport.metrics import Totals
    from tqexport.models.loader import load_model

    lm = load_model("tiny-llama", "float32")
    ids = list(range(3, 40))
    sim = LayerSimulation(lm, ids)
    kl = cal.BaselineKL(sim.baseline)
    for layer, dtype in ((0, "tqx_k3v2_mse"), (4, "fp8"), (5, "tqx_k4v2_mse")):
        logits = sim.logits(layer, dtype, 2, 1)
        t = Totals()
        t.add(logits, ids, sim.baseline)
        assert kl(logits) == t.summary()["kl"] > 0
    assert kl(sim.baseline) == 0.0


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "tiny-llama", "--kv-bits", "4", "--kv-layers", "0:fp8"],
         "--kv-bits 4 chooses every layer's dtype, window and sinks, so --kv-layers has no "
         "effect; drop one of them"),
        (["plan", "tiny-llama", "--kv-bits", "4", "--kv-recent-window", "8"],
         "--kv-bits 4 chooses every layer's dtype, window and sinks, so --kv-recent-window has "
         "no effect; drop one of them"),
        (["build", "tiny-llama", "-o", "x", "--kv-bits", "4", "--kv-cache-dtype", "fp8"],
         "--kv-bits 4 chooses every layer's dtype, window and sinks, so --kv-cache-dtype has no "
         "effect; drop one of them"),
        (["plan", "tiny-llama", "--kv-bits", "0"], "--kv-bits must be > 0 and <= 16, got 0"),
        (["plan", "tiny-llama", "--calibration", "x.json"],
         "--calibration is read only by --kv-bits; add --kv-bits or drop it"),
        (["plan", "tiny-llama", "--kv-bits", "4", "--calibration", "x.json"],
         "--calibration x.json not found"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--candidates", "auto"],
         "--candidates: auto is always a candidate (cost 0); drop it"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--candidates", "fp8,fp9"],
         "--kv-layers 0:fp9: unknown kv-cache dtype 'fp9'"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--tokens", "1"],
         "--tokens must be from 2 to 32768, got 1"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--kv-key-transform", "center",
          "--candidates", "fp8,turboquant_4bit_nc"],
         "--kv-key-transform center has no effect: no candidate is a tqexport-native "
         "TurboQuant dtype (tqx_*); add one to --candidates or drop the transform"),
        (["calibrate", "tiny-gemma2", "-o", "x.json", "--kv-key-transform", "center"],
         "--kv-key-transform center: candidate tqx_k4v4:w24:s8 (layer 0): centering is not "
         "exact under a score softcap (tanh is not shift-invariant); use smooth and/or signs on "
         "this model; drop it from --candidates"),
        (["calibrate", "tiny-llama", "-o", "x.json", "--kv-key-transform", "centre"],
         "--kv-key-transform 'centre': use none or kinds joined by '+' from center, smooth, "
         "signs (each once), e.g. center+smooth"),
    ],
)  # fmt: skip
def test_kv_bits_and_calibrate_refuse_bad_input_in_one_line(capsys, monkeypatch, tmp_path, args,
                                                            message):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    code, out, err = main_inproc(capsys, *args)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_calibrate_output_under_a_file_is_refused_before_measuring(capsys, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(cal, "measure", pytest.fail)
    out = tmp_path / "f" / "sub.json"
    code, stdout, err = main_inproc(capsys, "calibrate", "tiny-llama", "-o", out)
    assert (code, stdout) == (2, "")
    assert err == f"error: {tmp_path / 'f'} is not a directory, so -o {out} cannot be written\n"


def test_a_table_of_another_model_or_a_damaged_one_is_refused(tmp_path):
    desc = dense(2, dtype="float32")
    path = tmp_path / "t.json"
    table_for(desc, ("fp8",), [[0.1], [0.2]]).write(path)
    assert cal.read_table(path).cost == ((0.1,), (0.2,))
    with pytest.raises(TQExportError, match="measured on 'test-model', not on 'smollm2'"):
        cal.check_fits(cal.read_table(path), describe_model("smollm2"), path)
    d = json.loads(path.read_text())
    d["cost"][1] = [-1.0]
    path.write_text(json.dumps(d))
    with pytest.raises(TQExportError, match="is not a `tqexport calibrate` table \\(a cost "
                       "-1 is not from 0 to 1e\\+06\\)"):  # fmt: skip
        cal.read_table(path)
    path.write_text("{")
    with pytest.raises(TQExportError, match=r"t.json is not valid JSON \(Expecting"):
        cal.read_table(path)


def _table_text(desc, **edits) -> str:
    d = table_for(desc, ("fp8",), [[0.1]] * len(desc.layers)).to_dict()
    return json.dumps(d | edits)


BAD = " is not a `tqexport calibrate` table"
AGAIN = "; measure it again with `tqexport calibrate`"


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda desc: _table_text(desc).replace('"cost": ', '"cost": ' + "[" * 100_000),
         " is not valid JSON (nested too deeply)" + AGAIN),
        (lambda desc: _table_text(desc).replace("0.1", "9" * 400, 1),
         " has an integer of 400 digits (at most 40)" + AGAIN),
        (lambda desc: _table_text(desc).replace("0.1", "1" + "0" * 400 + ".0", 1),
         f" is not valid JSON (number 1{'0' * 39} is out of range)" + AGAIN),
        (lambda desc: _table_text(desc).replace("0.1", "NaN", 1),
         " is not valid JSON (NaN is not a JSON number)" + AGAIN),
        (lambda desc: _table_text(desc, cost=[[1e7]] * 6),
         BAD + " (a cost 1e+07 is not from 0 to 1e+06)" + AGAIN),
        (lambda desc: _table_text(desc, cost=[[0.1]] * 5),
         BAD + " (cost is not one row per layer, one column per candidate)" + AGAIN),
        (lambda desc: _table_text(desc, baseline_ppl=True),
         BAD + " (baseline_ppl must be a number)" + AGAIN),
        (lambda desc: _table_text(desc, candidates=[f"fp8:w{i + 1}" for i in range(65)]),
         BAD + " (candidates must be a list of 1 to 64)" + AGAIN),
        (lambda desc: _table_text(desc, model={"num_layers": 10**30}),
         BAD + " (model.num_layers must be from 1 to 1024)" + AGAIN),
        (lambda desc: " " * (8 * 2**20 + 1),
         f" has {8 * 2**20 + 1} bytes, more than {8 * 2**20}"),
    ],
)  # fmt: skip
def test_a_tampered_table_is_one_line_for_plan_build_and_bench(capsys, tmp_path, make, message):
    """Tables are parsed as strictly as a spec: deep nesting (RecursionError), a 400-digit cost
    (OverflowError), values out of range or of the wrong shape are one line, exit 2."""
    path = tmp_path / "t.json"
    path.write_text(make(describe_model("tiny-llama")))
    for args in (["plan", "tiny-llama"], ["build", "tiny-llama", "-o", tmp_path / "out"],
                 ["bench", "quality", "tiny-llama"]):  # fmt: skip
        code, out, err = main_inproc(capsys, *args, "--kv-bits", "8", "--calibration", path)
        assert (code, out, err) == (2, "", f"error: --calibration {path}{message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_a_table_that_is_not_a_regular_file_is_refused_without_reading(capsys, tmp_path, kind):
    """/dev/zero would be read until memory runs out, a FIFO would block forever."""
    import os

    path = {"device": Path("/dev/zero"), "fifo": tmp_path / "f", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    code, out, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-bits", "8",
                                 "--calibration", path)  # fmt: skip
    what = {"device": "a character device", "fifo": "a named pipe (FIFO)", "directory": "a folder"}
    what = what[kind]
    assert (code, out) == (2, "")
    assert err == f"error: --calibration {path} is {what}; give a regular file\n"


def test_bench_quality_kv_bits_scores_the_chosen_plan_with_its_prediction(tmp_path, monkeypatch):
    from tqexport.bench import commands

    desc = describe_model("tiny-llama")
    path = tmp_path / "t.json"
    cost = [[0.1 * (i + 1), 0.5 * (i + 1)] for i in range(6)]
    table_for(desc, ("fp8", "tqx_k4v4"), cost).write(path)
    said = []
    monkeypatch.setattr(commands, "_say", said.append)
    configs = commands._budget_configs("tiny-llama", "8,6", path, {"--kv-layers": None})
    want = [choose(desc, cal.read_table(path), b) for b in (8, 6)]
    assert [(c.label, c.request.kv_layers, c.predicted_kl) for c in configs] == [
        (f"kv-bits {b}", w.kv_layers, w.predicted_cost) for b, w in zip((8, 6), want)
    ]
    assert configs[0].request.kv_layers == "0-5:fp8"
    want = "^--kv-bits 8 chooses every layer's dtype, window and sinks, so --recent-window has "
    with pytest.raises(TQExportError, match=want + "no effect; drop one of them$"):
        commands._budget_configs("tiny-llama", "8", path, {"--recent-window": True})


def test_the_simulation_transforms_keys_as_the_executor_does():
    """One layer tqx_k4v2_mse (window 4, sinks 2) under a fitted center transform: the
    simulated logits are the paged executor's, and differ from the untransformed ones."""
    from tqexport.bench.quality import _executor
    from tqexport.export.artifact_build import resolve_spec
    from tqexport.kvplan.calibration_sim import LayerSimulation
    from tqexport.models.loader import load_model
    from tqexport.spec import BuildRequest

    lm = load_model("tiny-llama", "float32")
    ids = list(range(3, 40))
    options = BuildRequest("auto", kv_layers="2:tqx_k4v2_mse:w4:s2", key_transform="center")
    spec, _ = resolve_spec("tiny-llama", lm, options)
    transform = spec.layers[2].key_transform
    assert transform is not None and transform.kinds == ("center",)
    paged = _executor(spec, "torch", len(ids), lm=lm).score(ids)
    sim = LayerSimulation(lm, ids)
    simulated = sim.logits(2, "tqx_k4v2_mse", 4, 2, transform)
    plain = sim.logits(2, "tqx_k4v2_mse", 4, 2)
    assert (simulated - paged).abs().max().item() <= 1e-5
    assert (plain - paged).abs().max().item() > 1e-4


def test_a_table_measured_under_a_key_transform_serves_only_builds_with_it(tmp_path, capsys):
    """calibrate --kv-key-transform center records it; --kv-bits reads that table only with the
    same transform (one error naming both fixes otherwise)."""
    out = tmp_path / "cal.json"
    code, stdout, _ = main_inproc(capsys, "calibrate", "tiny-llama", "-o", out, "--candidates",
                                  "tqx_k4v4:w4,tqx_k3v2_mse", "--tokens", "24",
                                  "--kv-key-transform", "center")  # fmt: skip
    assert code == 0, stdout
    assert "6 layers x 2 candidates (keys center) on 24 tokens" in stdout
    assert json.loads(out.read_text())["key_transform"] == "center"
    table = cal.read_table(out)
    assert table.key_transform == "center"
    code, stdout, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-bits", "3",
                                    "--calibration", out)  # fmt: skip
    assert (code, stdout) == (2, "")
    assert err == (
        f"error: --calibration {out} was measured under --kv-key-transform center, not none; "
        "give --kv-key-transform center, or run `tqexport calibrate` with --kv-key-transform "
        "none\n"
    )
    code, stdout, err = main_inproc(capsys, "plan", "tiny-llama", "--kv-bits", "3",
                                    "--calibration", out, "--kv-key-transform", "center",
                                    "--json")  # fmt: skip
    assert code == 0, err
    choice = choose(describe_model("tiny-llama"), table, 3)
    layers = json.loads(stdout)["layers"]
    assert [la["kv_cache_dtype"] for la in layers] == [c.split(":")[0] for c in choice.candidates]


def test_a_version_1_table_reads_as_measured_without_a_key_transform(tmp_path):
    desc = dense(2, dtype="float32")
    path = tmp_path / "t.json"
    table_for(desc, ("fp8",), [[0.1], [0.2]]).write(path)
    d = json.loads(path.read_text())
    del d["key_transform"]
    path.write_text(json.dumps({**d, "version": 1}))
    assert cal.read_table(path).key_transform == "none"
    path.write_text(json.dumps({**d, "version": 2}))
    with pytest.raises(TQExportError, match=r"is not a `tqexport calibrate` table \('key_"):
        cal.read_table(path)
    with pytest.raises(TQExportError, match=r"^--calibration .* under --kv-key-transform none, "
                       r"not center; give --kv-key-transform none, or run `tqexport calibrate` "
                       r"with --kv-key-transform center$"):  # fmt: skip
        cal.check_same_transform(table_for(desc, ("fp8",), [[0.1], [0.2]]), ("center",), path)


def test_bench_kv_bits_scores_plans_under_the_tables_key_transform(tmp_path):
    from tqexport.bench import commands

    desc = describe_model("tiny-llama")
    path = tmp_path / "t.json"
    cost = [[0.1 * (i + 1), 0.5 * (i + 1)] for i in range(6)]
    table = table_for(desc, ("tqx_k4v4", "tqx_k3v2_mse"), cost)
    cal.Table(*list(table.__dict__.values())[:-1], key_transform="center").write(path)
    configs = commands._budget_configs("tiny-llama", "3.5", path, {}, "center")
    want = choose(desc, cal.read_table(path), 3.5)
    assert [(c.label, c.request.kv_layers, c.request.key_transform_label) for c in configs] == [
        ("kv-bits 3.5 keys center", want.kv_layers, "center")
    ]
    with pytest.raises(TQExportError, match=r"^--kv-bits scores one --kv-key-transform \(the "
                       r"calibration table's\), got center,none; give one$"):  # fmt: skip
        commands._budget_configs("tiny-llama", "3.5", path, {}, "center,none")
    with pytest.raises(TQExportError, match=r"under --kv-key-transform center, not none; "):
        commands._budget_configs("tiny-llama", "3.5", path, {})


def test_under_a_key_transform_fp8_candidates_keep_plain_keys_and_plans_mix_them(tmp_path, capsys):
    """fp8 cannot take a transform: under center its costs are exactly the untransformed table's,
    the tqx_* ones differ; the chosen plan builds with fp8 layers plain and tqx_* layers keyed."""
    from tqexport.export.artifact_build import resolve_spec
    from tqexport.models.loader import load_model
    from tqexport.spec import BuildRequest

    tables = {}
    for kinds in ("none", "center"):
        out = tmp_path / f"{kinds}.json"
        code, stdout, _ = main_inproc(capsys, "calibrate", "tiny-llama", "-o", out, "--candidates",
                                      "fp8,tqx_k3v2_mse", "--tokens", "24",
                                      "--kv-key-transform", kinds)  # fmt: skip
        assert code == 0, stdout
        tables[kinds] = cal.read_table(out)
    fp8 = [[row[0] for row in tables[k].cost] for k in ("none", "center")]
    tqx = [[row[1] for row in tables[k].cost] for k in ("none", "center")]
    assert fp8[0] == fp8[1]
    assert tqx[0] != tqx[1]
    desc = describe_model("tiny-llama")
    plan = choose(desc, tables["center"], 5.0)
    kinds = {c.split(":")[0] for c in plan.candidates}
    assert {"fp8", "tqx_k3v2_mse"} <= kinds, plan.candidates
    lm = load_model("tiny-llama", "float32")
    options = BuildRequest("auto", kv_layers=plan.kv_layers, key_transform="center")
    spec, _ = resolve_spec("tiny-llama", lm, options)
    for layer, candidate in zip(spec.layers, plan.candidates):
        keyed = layer.key_transform is not None
        assert keyed == candidate.startswith("tqx_"), (layer.index, candidate)


def test_a_key_transform_with_no_tqx_candidate_is_refused(capsys, tmp_path):
    out = tmp_path / "x.json"
    code, stdout, err = main_inproc(capsys, "calibrate", "tiny-llama", "-o", out, "--candidates",
                                    "fp8", "--kv-key-transform", "center")  # fmt: skip
    assert (code, stdout) == (2, "")
    assert err == (
        "error: --kv-key-transform center has no effect: no candidate is a tqexport-native "
        "TurboQuant dtype (tqx_*); add one to --candidates or drop the transform\n"
    )


def test_calibrate_makes_the_table_folder(capsys, tmp_path):
    out = tmp_path / "new" / "costs.json"
    code, stdout, _ = main_inproc(capsys, "calibrate", "tiny-llama", "-o", out, "--candidates",
                                  "fp8", "--tokens", "8")  # fmt: skip
    assert code == 0, stdout
    assert cal.read_table(out).candidates == ("fp8",)


def _layer_candidates():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "layer_candidates.py"
    spec = importlib.util.spec_from_file_location("layer_candidates", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_candidate_screen_quantizes_as_the_codecs_do():
    """benchmarks/layer_candidates.py: its split keys are the product's MSE keys on each part,
    and a one-head screen leaves the other heads exact."""
    from tqexport.kvquant.codecs import make_codec

    mod = _layer_candidates()
    k, v = torch.randn(2, 40, 3, 64, generator=torch.Generator().manual_seed(0)).unbind(0)
    codec = make_codec("tqx_k3v2_mse", 64, model_dtype="float32")
    kq, vq = codec.decode(codec.encode(k, v))
    torch.testing.assert_close(mod.mse_round_trip(k, 3), kq, rtol=0, atol=1e-5)
    screen = mod.ScreenCodec("tqx_k3v2_mse", head=1)
    sk, sv = screen.decode(screen.encode(k, v))
    assert torch.equal(sk[:, 1], kq[:, 1]) and torch.equal(sv[:, 1], vq[:, 1])
    assert torch.equal(sk[:, [0, 2]], k[:, [0, 2]]) and torch.equal(sv[:, [0, 2]], v[:, [0, 2]])
    split = mod.ScreenCodec("tqx_k3v2_mse", split=(4, 2, 32))
    xk, xv = split.decode(split.encode(k, v))
    assert torch.equal(xv, vq)  # values as the base's
    for h in range(3):
        x = k[:, h]
        top = torch.argsort((x * x).mean(0), descending=True)[:32]
        torch.testing.assert_close(xk[:, h, top], mod.mse_round_trip(x[:, top], 4))
