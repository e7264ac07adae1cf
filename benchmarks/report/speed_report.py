"""The speed parts of the benchmark report: the decode tables of a ``bench speed`` run and of a
peer-speed run (``benchmarks/peers_speed.py --json``), their goals (every ratio within one
run, with the ratio the bytes a step reads allow) and what bounds each number."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report.markdown import table as md_table
from tqexport.bench import weights_floor
from tqexport.bench.bounds import step_bytes
from tqexport.bench.sessions import GENAI
from tqexport.bench.speed import kernel_label, split_label
from tqexport.bench.speed_table import (
    kernels_text,
    load_text,
    session_text,
    speed_notes,
    speed_table,
)

#: how a peer-speed run names tqexport's systems: "tqexport " + label
TQ = "tqexport "
#: the batch-scaling goals at context 1024: (system, batch 8 over batch 1 at least)
SCALING_GOALS = (("tqexport auto", 3.5), ("tqexport turboquant_4bit_nc", 4.0))
#: the quantized-cost goals at context 4096, batch 1: (system, tokens/s over auto's at least)
QUANTIZED_COST_GOALS = (("tqexport fp8", 0.6), ("tqexport turboquant_4bit_nc", 0.5))
#: the goals against ONNX Runtime GenAI at context 1024: (batch, auto over GenAI at least)
GENAI_GOALS = ((1, 0.8), (8, 0.6))
#: the native-kernel goals, both sides on the native kernels:
#: (configuration, context, batch, tokens/s over auto's at least)
NATIVE_VS_AUTO_GOALS = (("turboquant_4bit_nc", 4096, 1, 1.1), ("turboquant_4bit_nc", 4096, 8, 1.8))
#: (configuration, batch 8 over batch 1 at context 1024 at least)
NATIVE_SCALING_GOALS = (("turboquant_4bit_nc", 4.0), ("auto", 4.0))
#: auto on the native kernels over GenAI: the points, and the ratio at least
NATIVE_GENAI_POINTS, NATIVE_GENAI_LEAST = ((1024, 1), (1024, 8), (4096, 1), (4096, 8)), 1.3
#: the native kernels over the function bodies, every quantized configuration:
#: (context, batch, ratio at least)
NATIVE_OVER_BODIES = (4096, 8, 2.0)


def read_peer_speed(path: Path) -> dict:
    """A peer-speed run (``benchmarks/peers_speed.py --json``), checked for what the report
    reads; ValueError when it is not one."""
    d = json.loads(path.read_text())
    rows = d.get("decode") if isinstance(d, dict) else None
    fields = {"context": int, "batch": int, "tokens_per_second": dict}
    if not (
        rows
        and isinstance(rows, list)
        and {"threads", "steps"} <= d.keys()
        and all(isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in fields.items())
                for r in rows)
    ):  # fmt: skip
        raise ValueError(f"{path} is not a peer-speed run")
    return d


def _tps(rows: list[dict], system: str, context: int, batch: int) -> float | None:
    row = next((r for r in rows if (r["context"], r["batch"]) == (context, batch)), None)
    return None if row is None else row["tokens_per_second"].get(system)


def _bytes_bound(footprints: dict, num: tuple, den: tuple) -> float | None:
    """The tokens/s ratio ``num`` over ``den`` (each (system, context, batch)) that the bytes
    their steps read allow: tokens per byte, num over den; None without both footprints."""
    fa, fb = (footprints.get(split_label(s)[0]) for s, _, _ in (num, den))
    if fa is None or fb is None:
        return None
    return (num[2] / step_bytes(fa, num[1], num[2])) / (den[2] / step_bytes(fb, den[1], den[2]))


def _ratio_goal(goal: str, rows, footprints, num: tuple, den: tuple, least: float, what: str):
    a, b = _tps(rows, *num), _tps(rows, *den)
    if a is None or b is None:
        return {"goal": goal, "met": None, "detail": "not measured in this run"}
    r = a / b
    detail = f"{r:.2f}x: {what} = {a:.1f} / {b:.1f} tokens/s"
    bound = _bytes_bound(footprints, num, den)
    if bound is not None:
        detail += f"; the bytes per step allow {bound:.2f}x"
    return {"goal": goal, "met": r >= least, "detail": detail}


def kernel_goals(rows: list[dict], footprints: dict, prefix: str = "", genai: bool = False):
    """The native-kernel goals from one run's decode rows, whose systems are ``prefix`` +
    ``configuration [kernels]``: turboquant_4bit_nc over auto, batch scaling, auto over
    ONNX Runtime GenAI (``genai``), native over bodies for every quantized configuration."""
    parsed = dict.fromkeys(
        split_label(n[len(prefix) :])
        for r in rows
        for n in r["tokens_per_second"]
        if n.startswith(prefix)
    )
    if not any(k == "native" for _, k in parsed):
        return [{"goal": "the native-kernel speed goals", "met": None,
                 "detail": "not measured: this run has no [native] rows (run it with "
                 "--kernels native,bodies)"}]  # fmt: skip

    def s(config: str, kernels: str = "native") -> str:
        return prefix + kernel_label(config, kernels)

    out = []
    for config, c, b, least in NATIVE_VS_AUTO_GOALS:
        out.append(_ratio_goal(
            f"{s(config)} decodes at >= {least}x {s('auto')}'s tokens/s at context {c}, batch {b}",
            rows, footprints, (s(config), c, b), (s("auto"), c, b), least, "this / auto",
        ))  # fmt: skip
    for config, least in NATIVE_SCALING_GOALS:
        out.append(_ratio_goal(
            f"{s(config)}: batch 8 decodes >= {least}x the tokens/s of batch 1 at context 1024",
            rows, footprints, (s(config), 1024, 8), (s(config), 1024, 1), least,
            "batch 8 / batch 1",
        ))  # fmt: skip
    for c, b in NATIVE_GENAI_POINTS if genai else ():
        goal = _ratio_goal(
            f"{s('auto')} decodes at >= {NATIVE_GENAI_LEAST}x {GENAI}'s tokens/s at context {c}, "
            f"batch {b}",
            rows, footprints, (s("auto"), c, b), (GENAI, c, b), NATIVE_GENAI_LEAST,
            "auto / GenAI",
        )  # fmt: skip
        floor, theirs = _tps(rows, weights_floor.SYSTEM, c, b), _tps(rows, GENAI, c, b)
        ours = _tps(rows, s("auto"), c, b)
        if goal["met"] is not None and floor and theirs and ours:
            goal["detail"] += (
                f"; ORT's weight MatMuls alone run at {floor:.1f} tokens/s, {floor / theirs:.2f}x "
                "GenAI (the most any graph on these weights through ORT can lead it by), and "
                f"auto steps at {ours / floor:.0%} of their rate"
            )
        out.append(goal)
    c, b, least = NATIVE_OVER_BODIES
    both = [n for n, k in parsed if n != "auto" and k == "native" and (n, "bodies") in parsed]
    for config in both:
        out.append(_ratio_goal(
            f"{prefix}{config}: the native kernels decode at >= {least}x the function bodies' "
            f"tokens/s at context {c}, batch {b}",
            rows, footprints, (s(config), c, b), (s(config, "bodies"), c, b), least,
            "native / bodies",
        ))  # fmt: skip
    if not both:
        out.append({"goal": f"the native kernels decode at >= {least}x the function bodies' "
                    f"tokens/s for every quantized configuration at context {c}, batch {b}",
                    "met": None, "detail": "not measured: no quantized configuration ran on "
                    "both (--kernels native,bodies)"})  # fmt: skip
    return out


def _named(ps: dict, system: str) -> str:
    """A tqexport system of the earlier goals as this run names it: on the run's first kernel
    choice when it recorded kernels."""
    kernels = ps.get("kernels")
    return kernel_label(system, kernels[0]) if kernels and system.startswith(TQ) else system


def peer_speed_goals(peer_speed: dict) -> list[dict]:
    """The attention-scaling goals and the native-kernel goals, from one peer-speed run
    (every ratio within that run)."""
    rows, fps = peer_speed["decode"], peer_speed.get("footprint") or {}
    auto = _named(peer_speed, "tqexport auto")
    out = []
    for system, least in SCALING_GOALS:
        s = _named(peer_speed, system)
        out.append(_ratio_goal(
            f"{s}: batch 8 decodes >= {least}x the tokens/s of batch 1 at context 1024",
            rows, fps, (s, 1024, 8), (s, 1024, 1), least, "batch 8 / batch 1",
        ))  # fmt: skip
    for system, least in QUANTIZED_COST_GOALS:
        s = _named(peer_speed, system)
        out.append(_ratio_goal(
            f"{s} decodes at >= {least}x {auto}'s tokens/s at context 4096, batch 1",
            rows, fps, (s, 4096, 1), (auto, 4096, 1), least, "this / auto",
        ))  # fmt: skip
    for batch, least in GENAI_GOALS:
        out.append(_ratio_goal(
            f"{auto} decodes at >= {least}x {GENAI}'s tokens/s at context 1024, batch {batch}",
            rows, fps, (auto, 1024, batch), (GENAI, 1024, batch), least, "auto / GenAI",
        ))  # fmt: skip
    seen = {g["goal"] for g in out}  # an earlier goal the native goals restate counts once
    return out + [g for g in kernel_goals(rows, fps, TQ, genai=True) if g["goal"] not in seen]


def speed_goals(speed: dict) -> list[dict]:
    """The native-kernel goals of a ``bench speed`` run (no peers in it)."""
    return kernel_goals(speed.get("decode", []), speed.get("footprint") or {})


def speed_markdown(speed: dict) -> list[str]:
    """The ``bench speed`` section of the report: decode table, notes, KV memory."""
    header, rows = speed_table(speed)
    notes = speed_notes(speed)
    return [
        "",
        "## Decode speed (ONNX Runtime CPU) and memory",
        "",
        f"{speed['steps']} decode steps per point after one warm-up step, fastest counted; "
        "cache bytes are zeros (decode cost does not depend on them); every configuration and "
        "kernel choice of a point interleaved, ratios within the run.",
        *(["", " ".join(notes)] if notes else []),
        "",
        md_table(header, rows),
        "",
        f"KV budget {speed['budget']}:",
        "",
        md_table(
            ["configuration", "KV bytes/token", "resident tokens", "vs auto", "bytes ratio (spec)"],
            [
                [
                    x["label"],
                    x["kv_bytes_per_token"],
                    x["resident_tokens"],
                    f"{x['resident_vs_auto']:.3f}x",
                    f"{x['bytes_ratio_auto_over_this']:.3f}x",
                ]
                for x in speed["memory"]
            ],
        ),  # fmt: skip
        "",
        "![decode tokens/s vs context](decode_vs_context.png)",
    ]


def _peer_notes(ps: dict) -> list[str]:
    """Kernels, both systems' ORT session options and how they differ, load averages."""
    out = []
    if ps.get("systems"):
        out.append(f"tqexport kernels: {kernels_text(ps['systems'])}.")
    so = ps.get("session_options") or {}
    if so.get("tqexport"):
        text = f"ORT sessions: tqexport {session_text(so['tqexport'])}"
        if so.get(GENAI):
            diffs = so.get("differences") or []
            text += f"; {GENAI} {session_text(so[GENAI])}" + (
                f"; they differ in {'; '.join(diffs)}" if diffs else "; the same in each of these"
            )
        out.append(text + (f" ({so['note']})" if so.get("note") else "") + ".")
    if ps.get("loadavg"):
        out.append(f"Load average (1/5/15 min) over the run: {load_text(ps['loadavg'])}.")
    return out


def bounds_markdown(ps: dict) -> list[str]:
    """What bounds each number of a peer-speed run: the bytes each system's decode step reads
    at every point (weights once, then every sequence's cache), from the footprints the run
    recorded; and how much of llama.cpp's lead its smaller weights explain."""
    fps = ps.get("footprint")
    if not fps:
        return []
    points = [(r["context"], r["batch"]) for r in ps["decode"]]
    sizes = ", ".join(
        f"{s} {f['weights_bytes'] / 1e6:.1f} MB + {f['kv_bytes_per_token'] / 1e3:.2f} KB/token"
        + (f" ({f['recent_window']} recent at {f['recent_bytes_per_token'] / 1e3:.2f} KB)"
           if f.get("recent_window") else "")
        for s, f in fps.items()
    )  # fmt: skip
    out = [
        "",
        "What bounds each number: a decode step reads the weights once and then every "
        "sequence's cached keys and values, so a memory-bound step's tokens/s is at most "
        'batch x bandwidth / bytes per step; a goal\'s "bytes per step allow" is that ratio '
        "between its two sides (a larger measured ratio is compute saved, not bytes). Weights "
        f"are the files on disk, KV bytes per token each cache format's: {sizes}. Bytes per "
        "step, MB:",
        "",
        md_table(
            ["context", "batch", *fps],
            [
                [c, b, *[f"{step_bytes(f, c, b) / 1e6:.1f}" for f in fps.values()]]
                for c, b in points
            ],
        ),  # fmt: skip
    ]
    auto, llama = TQ + "auto", [s for s in fps if s.startswith("llama.cpp ")]
    if auto not in fps or not llama:
        return out
    ours = _named(ps, auto)
    w = fps[auto]["weights_bytes"] / fps[llama[0]]["weights_bytes"]
    rows = []
    for c, b in points:
        for s in llama:
            lead = _tps(ps["decode"], s, c, b)
            base = _tps(ps["decode"], ours, c, b)
            if lead is None or base is None:
                continue
            bound = step_bytes(fps[auto], c, b) / step_bytes(fps[s], c, b)
            rows.append([c, b, s, f"{lead / base:.2f}x", f"{bound:.2f}x",
                         f"{lead / base / bound:.2f}x"])  # fmt: skip
    out += [
        "",
        f"llama.cpp runs the GGUF's quantized weights: {fps[llama[0]]['weights_bytes'] / 1e6:.1f}"
        f" MB on disk against tqexport's {fps[auto]['weights_bytes'] / 1e6:.1f} MB of fp32 "
        f"weights, {w:.2f}x fewer bytes. Its lead over {ours} against the bytes-per-step ratio "
        "(the part of the lead the bytes explain; the rest is compute):",
        "",
        md_table(
            ["context", "batch", "llama.cpp", "lead", "bytes ratio", "lead beyond bytes"], rows
        ),  # fmt: skip
    ]
    return out


def peer_speed_markdown(ps: dict) -> list[str]:
    """The peer-speed section: every system's tokens/s, auto over GenAI, batch scaling, the
    kernels, sessions and load, and what bounds each number."""
    rows = ps["decode"]
    names = list(dict.fromkeys(n for r in rows for n in r["tokens_per_second"]))
    auto = _named(ps, "tqexport auto")
    versions = ", ".join(f"{k} {v}" for k, v in ps.get("versions", {}).items())
    load = all("loadavg" in r for r in rows)
    table = md_table(
        ["context", "batch", *names, f"{auto.removeprefix(TQ)} / GenAI",
         *(["load 1 min before / after"] if load else [])],
        [
            [r["context"], r["batch"],
             *[f"{r['tokens_per_second'][n]:.1f}" if n in r["tokens_per_second"] else "-"
               for n in names],
             (f"{r['tokens_per_second'][auto] / r['tokens_per_second'][GENAI]:.2f}x"
              if {auto, GENAI} <= set(r["tokens_per_second"]) else "-"),
             *([f"{r['loadavg']['before'][0]:.2f} / {r['loadavg']['after'][0]:.2f}"]
               if load else [])]
            for r in rows
        ],
    )  # fmt: skip
    scaling = []
    for r in rows:
        if r["batch"] == 1:
            continue
        one = next((x for x in rows if (x["context"], x["batch"]) == (r["context"], 1)), None)
        if one is None:
            continue
        cells = [
            f"{r['tokens_per_second'][n] / one['tokens_per_second'][n]:.2f}x"
            if n in r["tokens_per_second"] and n in one["tokens_per_second"] else "-"
            for n in names
        ]  # fmt: skip
        scaling.append([r["context"], f"{r['batch']} / 1", *cells])
    notes = _peer_notes(ps)
    return [
        "",
        "## Decode speed against peers",
        "",
        f"`{ps.get('command', 'benchmarks/peers_speed.py')}`"
        + (f" ({versions})" if versions else "")
        + f": decode tokens/s, {ps['threads']} intra-op threads each, fastest of {ps['steps']} "
        "steps after a warm-up, every system's steps interleaved in one process (compare "
        "ratios, not absolute numbers across runs). `-`: not run (GenAI prefills every "
        "prompt and is capped in cached tokens; llama.cpp's Python API decodes one sequence).",
        *(["", " ".join(notes)] if notes else []),
        "",
        table,
        "",
        "Batch scaling (tokens/s at batch B over batch 1, same context):",
        "",
        md_table(["context", "batch", *names], scaling),
        *bounds_markdown(ps),
        "",
        "![decode tokens/s vs context, with peers](decode_peers.png)",
    ]
