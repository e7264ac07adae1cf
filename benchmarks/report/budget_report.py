"""The report's ``--kv-bits`` section: each budget's measured quality beside what it predicted,
the best single configuration at no more bits and llama.cpp q4_0, per window size."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report.markdown import table as md_table
from tqexport.safe_files import write_figure

#: the per-layer budget issue's goals: (window tokens, budget, perplexity change at most)
BUDGET_GOALS = ((4096, 3.5, 0.8), (4096, 3.0, 1.5))
PLOT = "ppl_vs_kv_bits.png"


def sections_of(results: dict) -> list[tuple[dict, list[dict]]]:
    """(chunking, rows) of a report's main quality section and of each other window size."""
    out = []
    if results.get("quality"):
        out.append((results["quality"]["chunking"], results["rows"]))
    out += [(s["quality"]["chunking"], s["rows"]) for s in results.get("quality_windows", [])]
    return out


def budget_rows(sections: list[tuple[dict, list[dict]]]) -> list[dict]:
    """One row per ``--kv-bits`` run of every (chunking, rows) section: its budget, bits,
    predicted and measured KL and perplexity change, the best other tqexport configuration (a
    single dtype or given ``--kv-layers``) within the budget in the same section, and llama.cpp
    q4_0 there."""
    out = []
    for chunking, rows in sections:
        ours = [r for r in rows if r["tool"] == "tqexport" and r["label"] != "auto"]
        q4 = next((r for r in rows if r["tool"] == "llama.cpp" and r["label"] == "q4_0"), None)
        for r in (r for r in ours if r.get("kv_bits") is not None):
            fixed = [u for u in ours if u.get("kv_bits") is None
                     and u["bits_per_element"] <= r["kv_bits"] + 1e-9]  # fmt: skip
            best = min(fixed, key=lambda u: u["ppl_delta_pct"], default=None)
            out.append({
                "chunk_tokens": chunking["chunk_tokens"], "chunks": chunking["chunks"],
                "kv_bits": r["kv_bits"], "bits_per_element": r["bits_per_element"],
                "predicted_kl": r["predicted_kl"], "kl": r.get("kl"),
                "ppl_delta_pct": r["ppl_delta_pct"], "kv_layers": r.get("kv_layers"),
                "uniform": None if best is None else {
                    "label": best["label"], "bits_per_element": best["bits_per_element"],
                    "ppl_delta_pct": best["ppl_delta_pct"], "kl": best.get("kl")},
                "q4_0_ppl_delta_pct": None if q4 is None else q4["ppl_delta_pct"],
                "q4_0_bits_per_element": None if q4 is None else q4["bits_per_element"],
            })  # fmt: skip
    return sorted(out, key=lambda b: (b["chunk_tokens"], b["kv_bits"]))


def budget_goals(brows: list[dict]) -> list[dict]:
    """The budget issue's acceptance at 4096-token windows (only when a budget run exists)."""
    if not brows:
        return []
    out = []
    for tokens, budget, max_pct in BUDGET_GOALS:
        goal = f"--kv-bits {budget} at {tokens}-token windows costs <= {max_pct}% perplexity"
        r = next((b for b in brows if b["chunk_tokens"] == tokens and b["kv_bits"] == budget),
                 None)  # fmt: skip
        if r is None:
            out.append({"goal": goal, "met": None, "detail": "not measured in this run"})
            continue
        out.append({"goal": goal, "met": r["ppl_delta_pct"] <= max_pct,
                    "detail": f"{r['ppl_delta_pct']:+.2f}% at {r['bits_per_element']:.3f} bits "
                    f"(predicted KL {r['predicted_kl']:.5f}, measured {r['kl']:.5f})"})  # fmt: skip
    return out


def budget_markdown(
    brows: list[dict],
    heading: str = "## Per-layer precision under a bits budget",
    plot: str = PLOT,
) -> list[str]:
    """The section: a table of every budget run and the plot (``plot``: its path from the
    markdown file)."""
    if not brows:
        return []
    rows = []
    for b in brows:
        u = b["uniform"]
        rows.append([
            f"{b['chunks']} x {b['chunk_tokens']}", f"{b['kv_bits']:g}",
            f"{b['bits_per_element']:.3f}", f"{b['predicted_kl']:.5f}", f"{b['kl']:.5f}",
            f"{b['ppl_delta_pct']:+.2f}%",
            "-" if u is None else f"{u['label']} ({u['bits_per_element']:.2f}): "
            f"{u['ppl_delta_pct']:+.2f}%" + ("" if u.get("kl") is None else f", KL {u['kl']:.5f}"),
            "-" if b["q4_0_ppl_delta_pct"] is None else f"{b['q4_0_ppl_delta_pct']:+.2f}% "
            f"({b['q4_0_bits_per_element']:.2f})",
        ])  # fmt: skip
    return [
        "",
        heading,
        "",
        "`--kv-bits B`: each layer's cache (format, recent window, sink tokens) chosen from the "
        "calibration table (`tqexport calibrate`) to least predicted cost within B bits per "
        "element all in. Predicted KL: the sum of the chosen candidates' measured costs, each "
        "with only its layer changed; measured KL and perplexity change: the run through the "
        "paged caches. Beside it the best other configuration of the same windows within the "
        "budget, and llama.cpp q4_0 (its bits per element all in, in brackets).",
        "",
        md_table(
            [
                "windows",
                "budget",
                "bits/elem all in",
                "predicted KL",
                "measured KL",
                "PPL change",
                "best single configuration within the budget",
                "llama.cpp q4_0",
            ],
            rows,
        ),  # fmt: skip
        "",
        f"![PPL change vs --kv-bits budget]({plot})",
    ]


def plot_budgets(brows: list[dict], path: Path) -> None:
    """Perplexity change vs bits: one line of budgets per window size, its best single
    configurations dashed, llama.cpp q4_0 as a square."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, tokens in enumerate(sorted({b["chunk_tokens"] for b in brows})):
        pts = [b for b in brows if b["chunk_tokens"] == tokens]
        ax.plot(
            [b["bits_per_element"] for b in pts],
            [b["ppl_delta_pct"] for b in pts],
            marker="o",
            color=f"C{i}",
            label=f"--kv-bits, {tokens}-token windows",
        )
        uni = sorted({(b["uniform"]["bits_per_element"], b["uniform"]["ppl_delta_pct"])
                      for b in pts if b["uniform"]})  # fmt: skip
        if uni:
            ax.plot(
                *zip(*uni, strict=True),
                marker="x",
                ls="--",
                color=f"C{i}",
                label=f"best single configuration, {tokens}-token windows",
            )
        q4 = next((b for b in pts if b["q4_0_ppl_delta_pct"] is not None), None)
        if q4 is not None:
            ax.scatter(
                [q4["q4_0_bits_per_element"]],
                [q4["q4_0_ppl_delta_pct"]],
                marker="s",
                color=f"C{i}",
                label=f"llama.cpp q4_0, {tokens}-token windows",
                zorder=3,
            )
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("KV bits per element, all in")
    ax.set_ylabel("perplexity increase vs unquantized (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_figure(fig, path, dpi=120)
    plt.close(fig)
