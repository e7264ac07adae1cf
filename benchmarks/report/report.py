"""The benchmark report: ``results.json`` (every number), ``report.md`` and PNG plots."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from benchmarks.report import budget_report, speed_report
from benchmarks.report.markdown import table as md_table
from tqexport.bench.quality import with_deltas
from tqexport.errors import TQExportError
from tqexport.safe_files import check_output_file, write_figure, write_file


def machine() -> dict:
    """What the numbers were measured on."""
    import onnxruntime
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            int(ln.split()[1]) * 1024
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1) if mem else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
        "gpu": None,
    }


def merge_quality(parts: list[dict], model: str) -> tuple[dict, dict | None, str | None]:
    """One quality result from several ``bench quality --json`` runs of the same model, text
    and chunking (their runs concatenated; the peer from whichever part ran it)."""

    first = parts[0]["quality"]
    merged = {**first, "runs": []}
    peer, note = None, None
    for part in parts:
        q = part["quality"]
        same = (q["model"], q["text"]["sha256"], q["chunking"]) == (
            model, first["text"]["sha256"], first["chunking"]
        )  # fmt: skip
        # baselines scored in another run agree to summation order (measured: 2e-10 relative)
        base, ref = q["baseline"]["ppl"], first["baseline"]["ppl"]
        if not same or abs(base - ref) > 1e-9 * abs(ref):
            raise TQExportError(
                f"quality results differ in model, text, chunking or baseline ({q['model']}, "
                f"{q['chunking']}); rerun them with the same options for {model}"
            )
        seen = {r["label"] for r in merged["runs"]}
        merged["runs"] += [r for r in q["runs"] if r["label"] not in seen]
        peer = peer or part.get("peer")
        note = note or part.get("peer_note")
    return merged, peer, None if peer else note


def split_by_chunking(parts: list[dict]) -> list[list[dict]]:
    """``bench quality --json`` parts grouped by their windows (same chunking together), in the
    order each chunking first appears: each group is one quality section of the report."""
    groups: dict[str, list[dict]] = {}
    for part in parts:
        key = json.dumps(part["quality"]["chunking"], sort_keys=True)
        groups.setdefault(key, []).append(part)
    return list(groups.values())


def quality_section(parts: list[dict], model: str) -> dict:
    """One report section (windows of one size): the merged result, its peer and its rows."""
    merged, peer, note = merge_quality(parts, model)
    return {
        "chunk_tokens": merged["chunking"]["chunk_tokens"],
        "quality": merged,
        "peer": peer,
        "peer_note": note,
        "rows": with_deltas(merged, peer),
    }


def _find(rows, tool, label):
    return next((r for r in rows if r["tool"] == tool and r["label"] == label), None)


#: the long-context goals: (window tokens, bits per element at most, perplexity change at most)
LONG_WINDOW_GOALS = ((4096, 4.5, 0.6), (4096, 3.5, 1.5))


def _native(row: dict) -> bool:
    from tqexport.kvquant.modes import parse_kv_cache_dtype

    return row["tool"] == "tqexport" and parse_kv_cache_dtype(row["kv_cache_dtype"]).native


def long_window_goals(sections: list[dict]) -> list[dict]:
    """The key-transform issue's goals at long windows: the best tqexport-native configuration
    within each bit budget, from the section scored at that window size."""
    out = []
    for tokens, max_bits, max_pct in LONG_WINDOW_GOALS:
        goal = (
            f"at {tokens}-token windows, a tqexport-native configuration at <= {max_bits} bits "
            f"per element all in costs <= {max_pct}% perplexity"
        )
        rows = next((s["rows"] for s in sections if s["chunk_tokens"] == tokens), [])
        fits = [r for r in rows if _native(r) and r["bits_per_element"] <= max_bits + 1e-9]
        if not fits:
            out.append({"goal": goal, "met": None, "detail": "not measured in this run"})
            continue
        best = min(fits, key=lambda r: r["ppl_delta_pct"])
        out.append({
            "goal": goal,
            "met": best["ppl_delta_pct"] <= max_pct,
            "detail": f"best: {best['label']} at {best['bits_per_element']:.3f} bits, "
            f"{best['ppl_delta_pct']:+.2f}%",
        })  # fmt: skip
    return out


def goals(
    rows: list[dict], speed: dict | None, sections: list[dict] = (), peer_speed: dict | None = None
) -> list[dict]:
    """The report issues' goals, each stated as met, not met, or not measured; ``sections``
    are the quality sections at other window sizes and ``peer_speed`` a peer-speed run (their
    goals only when given)."""
    out = []
    for ours, theirs in (("turboquant_4bit_nc", "q4_0"), ("fp8", "q8_0")):
        a, b = _find(rows, "tqexport", ours), _find(rows, "llama.cpp", theirs)
        goal = (
            f"{ours} PPL increase {'below' if theirs == 'q4_0' else 'no worse than'} "
            f"llama.cpp {theirs}'s"
        )
        if a is None or b is None:
            out.append({"goal": goal, "met": None, "detail": "not measured in this run"})
            continue
        da, db = a["ppl_delta_pct"], b["ppl_delta_pct"]
        met = da < db if theirs == "q4_0" else da <= db
        out.append({"goal": goal, "met": met, "detail": f"{da:+.2f}% vs {db:+.2f}%"})
    ours = [r for r in rows if r["tool"] == "tqexport" and r["bits_per_element"] <= 4.5]
    if ours:
        best = min(ours, key=lambda r: r["ppl_delta_pct"])
        out.append({
            "goal": "a configuration at <= 4.5 bits per element all in costs <= 1% perplexity",
            "met": best["ppl_delta_pct"] <= 1.0,
            "detail": f"best: {best['label']} at {best['bits_per_element']:.3f} bits, "
            f"{best['ppl_delta_pct']:+.2f}%",
        })  # fmt: skip
    if speed:
        out += speed_report.speed_goals(speed)
        worst = max(  # a recent window takes a fixed share of the budget first: no ratio
            abs(m["resident_vs_auto"] / m["bytes_ratio_auto_over_this"] - 1)
            for m in speed["memory"]
            if "recent" not in m["label"]
        )
        out.append({
            "goal": "resident tokens at the KV budget match the spec's bytes-per-token ratios",
            "met": worst < 0.01,
            "detail": f"largest relative gap {100 * worst:.2f}% (whole blocks and the null block)",
        })  # fmt: skip
    out += long_window_goals(sections) if sections else []
    out += budget_report.budget_goals(budget_report.budget_rows(
        [(s["quality"]["chunking"], s["rows"]) for s in sections]))  # fmt: skip
    return out + (speed_report.peer_speed_goals(peer_speed) if peer_speed else [])


#: where a point's label may go, tried in order: offset in points, horizontal/vertical anchor
_LABEL_SPOTS = [(4, 3, "left", "bottom"), (4, -3, "left", "top"), (-4, 3, "right", "bottom"),
                (-4, -3, "right", "top"), (0, 7, "center", "bottom"), (0, -7, "center", "top"),
                (10, 0, "left", "center"), (-10, 0, "right", "center"), (4, 11, "left", "bottom"),
                (4, -11, "left", "top"), (-4, 11, "right", "bottom"), (-4, -11, "right", "top"),
                (12, 20, "left", "bottom"), (12, -20, "left", "top"), (-12, 20, "right", "bottom"),
                (-12, -20, "right", "top")]  # fmt: skip


def _frontier(rows: list[dict]) -> list[dict]:
    """The rows no other row beats in both bits and perplexity change (fewest bits first)."""
    best, out = float("inf"), []
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["ppl_delta_pct"])):
        if r["ppl_delta_pct"] < best:
            best = r["ppl_delta_pct"]
            out.append(r)
    return out


def place_labels(fig, ax, points: list[tuple[float, float, str]], fontsize: float = 7) -> list:
    """Label each point (in the order given: the first ones matter most) at the first spot
    where its text overlaps no other label, no marker and stays inside the axes; a label that
    fits nowhere is left out. Returns the labels placed. Call after the axes' limits and the
    layout are final."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    taken = []
    for x, y in {(x, y) for x, y, _ in points}:
        px, py = ax.transData.transform((x, y))
        taken.append(matplotlib_bbox(px - 4, py - 4, px + 4, py + 4))
    placed = []
    for x, y, text in points:
        for dx, dy, ha, va in _LABEL_SPOTS:
            far = abs(dy) > 12  # a leader line says whose label a far one is
            t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                            fontsize=fontsize, ha=ha, va=va,
                            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "gray"} if far
                            else None)  # fmt: skip
            box = t.get_window_extent(renderer)
            fits = inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)
            if fits and not any(box.overlaps(o) for o in taken):
                taken.append(box)
                placed.append(t)
                break
            t.remove()
    return placed


def matplotlib_bbox(x0, y0, x1, y1):
    from matplotlib.transforms import Bbox

    return Bbox([[x0, y0], [x1, y1]])


def plot_quality(rows: list[dict], path: Path) -> list:
    """PPL change vs bits per element of every row; labels that would overlap are left out,
    the best trade-offs (the frontier) and the peers labelled first. Returns the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    styles = {"tqexport": ("o", "tab:blue"), "llama.cpp": ("s", "tab:red")}
    for tool, (marker, color) in styles.items():
        pts = [r for r in rows if r["tool"] == tool]
        ax.scatter([r["bits_per_element"] for r in pts], [r["ppl_delta_pct"] for r in pts],
                   marker=marker, color=color, label=tool, zorder=3)  # fmt: skip
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("KV bits per element, all in (unquantized boundary layers included)")
    ax.set_ylabel("perplexity increase vs own unquantized baseline (%)")
    ax.axhline(0, color="gray", lw=0.5)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    ax.margins(x=0.12, y=0.08)
    ax.set_xlim(left=0)  # room for the labels of the fewest-bits points, on their left
    fig.tight_layout()
    ours = [r for r in rows if r["tool"] == "tqexport"]
    first = [r for r in rows if r["tool"] != "tqexport"] + _frontier(ours)
    order = first + [r for r in rows if r not in first]
    labels = place_labels(fig, ax, [(r["bits_per_element"], r["ppl_delta_pct"],
                                     r["label"] if r["tool"] == "tqexport"
                                     else f"llama.cpp {r['label']}") for r in order])  # fmt: skip
    write_figure(fig, path, dpi=120)
    plt.close(fig)
    return labels


def plot_decode(rows: list[dict], path: Path, ylabel: str, log_y: bool = False) -> None:
    """Decode tokens/s vs context of every system in ``rows``, one line style per batch; the
    legend sits beside the axes, never over the lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    names = list(dict.fromkeys(n for r in rows for n in r["tokens_per_second"]))
    batches = sorted({r["batch"] for r in rows})
    for i, name in enumerate(names):
        for j, b in enumerate(batches):
            pts = [r for r in rows if r["batch"] == b and name in r["tokens_per_second"]]
            if pts:
                ax.plot([r["context"] for r in pts], [r["tokens_per_second"][name] for r in pts],
                        marker="o", color=f"C{i % 10}", ls=["-", "--", ":", "-."][j % 4],
                        label=f"{name}, batch {b}")  # fmt: skip
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("context length (tokens cached per sequence)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
    write_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _plot_name(section: dict) -> str:
    return f"ppl_vs_bits_{section['chunk_tokens']}.png"


def _quality_markdown(title, q, rows, peer, note, plot) -> list[str]:
    """One quality section: the text and windows it was scored on, the peer, the table."""
    t, c = q["text"], q["chunking"]
    parts = [
        "",
        f"## {title}",
        "",
        f"Text: {t['name']}, {t['characters']} characters, SHA-256 `{t['sha256']}` "
        f"(Python {t['python']}). {c['text_tokens']} tokens (HF tokenizer, no special tokens);"
        f" the first {c['chunks']} windows of {c['chunk_tokens']} tokens, each scored from an "
        f"empty cache: {c['chunks'] * (c['chunk_tokens'] - 1)} predictions. Ours run through "
        "the executor's paged caches (every position's logits, attention reads the cache); "
        "KL is KL(baseline || run) per next-token distribution, averaged; top-1 is argmax "
        "agreement with the same tool's own unquantized baseline. Bits per element are all "
        "in: every layer's K and V bytes per token (unquantized boundary layers counted at "
        "16 bits, as deployed; the CPU runs themselves are fp32) plus a recent window's "
        "16-bit bytes amortized over a 4096-token context, over the K and V elements; a "
        "sliding-window layer's bytes are amortized the same way (it holds only its window), "
        "for llama.cpp's nominal bits too.",
        "",
    ]
    if peer:
        parts += [f"Peer: {peer['tool']} on {peer['gguf']}, same token "
                  "ids, flash attention on.", ""]  # fmt: skip
    elif note:
        parts += [f"Peer: {note}", ""]
    parts.append(
        md_table(
            [
                "tool",
                "configuration",
                "bits/elem all in",
                "PPL",
                "PPL change",
                "mean KL",
                "top-1",
            ],
            [
                [
                    r["tool"],
                    r["label"],
                    f"{r['bits_per_element']:.2f}",
                    f"{r['ppl']:.4f}",
                    f"{r['ppl_delta_pct']:+.2f}%",
                    f"{r.get('kl', 0):.5f}",
                    f"{100 * r.get('top1', 1):.2f}%",
                ]
                for r in rows
            ],
        )  # fmt: skip
    )
    parts += ["", f"![PPL change vs bits per element]({plot})"]
    return parts


def markdown(results: dict) -> str:
    m, q, rows, speed = (
        results["machine"],
        results.get("quality"),
        results["rows"],
        results.get("speed"),
    )
    parts = [
        f"# KV-cache quality and speed report: {results['model']}",
        "",
        f"Generated by `{results['command']}`. Every number below is in `results.json`.",
        "",
        "## Machine",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; {m['os']}; Python "
        f"{m['python']}, torch {m['torch']}, onnxruntime {m['onnxruntime']}, transformers "
        f"{m['transformers']}.",
    ]
    if q:
        parts += _quality_markdown(
            "Quality", q, rows, results.get("peer"), results.get("peer_note"), "ppl_vs_bits.png"
        )
    for sec in results.get("quality_windows", []):
        parts += _quality_markdown(
            f"Quality at {sec['chunk_tokens']}-token windows", sec["quality"], sec["rows"],
            sec["peer"], sec["peer_note"], _plot_name(sec),
        )  # fmt: skip
    if speed:
        parts += speed_report.speed_markdown(speed)
    if results.get("peer_speed"):
        parts += speed_report.peer_speed_markdown(results["peer_speed"])
    parts += budget_report.budget_markdown(
        budget_report.budget_rows(budget_report.sections_of(results))
    )
    parts += ["", "## Goals", ""]
    for g in results["goals"]:
        verdict = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[g["met"]]
        parts.append(f"- {g['goal']}: **{verdict}** ({g['detail']})")
    return "\n".join(parts) + "\n"


#: the files that make a folder hold a report (``-o`` replaces them only with --force)
REPORT_FILES = ("results.json", "report.md")


def check_out(out_dir: Path, force: bool, names=REPORT_FILES, option: str = "-o") -> None:
    """Before any measurement: ``out_dir`` must be a folder that can be written (made if
    missing), and may hold a report already only with ``force``."""
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise TQExportError(f"{option} {out_dir} exists and is not a directory; choose another")
    for name in names:
        check_output_file(out_dir / name, force, option)


def write(out_dir: Path, results: dict) -> list[Path]:
    """Write results.json, the plots and report.md into ``out_dir``; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "results.json"]
    write_file(files[0], json.dumps(results, indent=2) + "\n")
    if results["rows"]:
        plot_quality(results["rows"], out_dir / "ppl_vs_bits.png")
        files.append(out_dir / "ppl_vs_bits.png")
    for sec in results.get("quality_windows", []):
        plot_quality(sec["rows"], out_dir / _plot_name(sec))
        files.append(out_dir / _plot_name(sec))
    budgets = budget_report.budget_rows(budget_report.sections_of(results))
    if budgets:
        budget_report.plot_budgets(budgets, out_dir / budget_report.PLOT)
        files.append(out_dir / budget_report.PLOT)
    if results.get("speed"):
        plot_decode(
            results["speed"]["decode"],
            out_dir / "decode_vs_context.png",
            "decode tokens/s (ONNX Runtime CPU)",
        )
        files.append(out_dir / "decode_vs_context.png")
    if results.get("peer_speed"):
        plot_decode(
            results["peer_speed"]["decode"],
            out_dir / "decode_peers.png",
            "decode tokens/s (CPU, one run, interleaved)",
            log_y=True,
        )
        files.append(out_dir / "decode_peers.png")
    write_file(out_dir / "report.md", markdown(results))
    files.append(out_dir / "report.md")
    return files
