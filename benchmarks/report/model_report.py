"""Quality per real model: ``models.md`` / ``models.json`` beside the SmolLM2 report.

Each model's ``bench quality --json`` parts (in ``REPORT_DIR/<model>/``) become one table per
window size, as in the SmolLM2 report; then every pair of configurations scored on SmolLM2 and
on the model at the same window size, at most :data:`PAIR_BITS` bits per element apart, whose
order by perplexity change flips: where a SmolLM2 winner loses on the other model.

``python -m benchmarks.report.model_report REPORT_DIR MODEL...`` (``make bench`` runs it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.report import budget_report, report
from benchmarks.report.markdown import table as md_table
from tqexport.errors import TQExportError
from tqexport.safe_files import write_file

REFERENCE = "smollm2"
#: pairs compared are this close in bits per element (on both models): like for like
PAIR_BITS = 1.0
#: each tool's unquantized baseline (the 0% every other row is measured from)
BASELINES = {("tqexport", "auto"), ("llama.cpp", "f16")}
#: what each model is, said where it is named (Gemma's licence must be named with it)
ABOUT = {
    "smollm2": "SmolLM2 135M Instruct (Q4_1 GGUF): 30 layers, 9 q / 3 kv heads of 64",
    "gemma3-270m": "Gemma 3 270M (Q4_K_M GGUF, base model; provided under the Gemma terms of use,"
    " https://ai.google.dev/gemma/terms): 18 layers, 5 sliding (window 512) : 1 full, 4 q / 1 kv"
    " head of 256",
    "qwen2.5-coder-0.5b": "Qwen2.5 Coder 0.5B Instruct (Q4_K_M GGUF): 24 layers, 14 q / 2 kv "
    "heads of 64",
}


def read_parts(model_dir: Path) -> list[dict]:
    """Every ``bench quality --json`` output in MODEL_DIR, by file name."""
    parts = []
    for path in sorted(model_dir.glob("*.json")):
        try:
            part = json.loads(path.read_text())
            part["quality"]["chunking"]["chunk_tokens"]
        except (OSError, ValueError, KeyError, TypeError):
            raise TQExportError(f"{path} is not the output of `bench quality --json`") from None
        parts.append(part)
    if not parts:
        raise TQExportError(f"{model_dir} holds no `bench quality --json` output; run them first")
    return parts


def reference_sections(results: dict) -> dict[int, list[dict]]:
    """SmolLM2's rows per window size, from its report's ``results.json``."""
    out = {results["quality"]["chunking"]["chunk_tokens"]: results["rows"]}
    out.update({s["chunk_tokens"]: s["rows"] for s in results.get("quality_windows", [])})
    return out


def _key(row: dict) -> tuple[str, str]:
    return row["tool"], row["label"]


def flips(reference: list[dict], other: list[dict]) -> list[dict]:
    """Pairs (winner, loser) that SmolLM2 orders one way by perplexity change and the other
    model the other way, both rows at most PAIR_BITS apart in bits on both; baselines left out."""
    ref = {_key(r): r for r in reference if _key(r) not in BASELINES}
    oth = {_key(r): r for r in other if _key(r) in ref}
    out = []
    for a in oth:
        for b in oth:
            ra, rb, oa, ob = ref[a], ref[b], oth[a], oth[b]
            close = all(abs(x["bits_per_element"] - y["bits_per_element"]) <= PAIR_BITS
                        for x, y in ((ra, rb), (oa, ob)))  # fmt: skip
            flipped = ra["ppl_delta_pct"] < rb["ppl_delta_pct"] and (
                oa["ppl_delta_pct"] > ob["ppl_delta_pct"]
            )
            if close and flipped:
                out.append({
                    "winner": list(a), "loser": list(b),
                    "reference_pct": [ra["ppl_delta_pct"], rb["ppl_delta_pct"]],
                    "model_pct": [oa["ppl_delta_pct"], ob["ppl_delta_pct"]],
                    "model_bits": [oa["bits_per_element"], ob["bits_per_element"]],
                })  # fmt: skip
    return sorted(out, key=lambda f: f["reference_pct"][0] - f["reference_pct"][1])


def build(report_dir: Path, models: list[str]) -> dict:
    """Every model's sections and its flips against SmolLM2 (from REPORT_DIR/results.json)."""
    ref_path = report_dir / "results.json"
    try:
        reference = reference_sections(json.loads(ref_path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        raise TQExportError(
            f"{ref_path} is not a `python -m benchmarks.report {REFERENCE}` results.json; run "
            "it first"
        ) from None
    out = []
    for model in models:
        parts = read_parts(report_dir / model)
        sections = [report.quality_section(g, model) for g in report.split_by_chunking(parts)]
        for sec in sections:
            ref = reference.get(sec["chunk_tokens"])
            sec["flips"] = flips(ref, sec["rows"]) if ref else None
        budgets = budget_report.budget_rows(
            [(sec["quality"]["chunking"], sec["rows"]) for sec in sections]
        )
        out.append({"model": model, "about": ABOUT.get(model, model), "sections": sections,
                    "budgets": budgets})  # fmt: skip
    return {"machine": report.machine(), "reference": REFERENCE, "models": out}


def _flip_lines(model: str, sec: dict) -> list[str]:
    if sec["flips"] is None:
        return [f"SmolLM2 was not scored at {sec['chunk_tokens']}-token windows."]
    if not sec["flips"]:
        return [f"No SmolLM2 winner loses on {model} here (pairs at most {PAIR_BITS:g} bit apart)."]
    rows = [
        [" ".join(f["winner"]), " ".join(f["loser"]),
         f"{f['reference_pct'][0]:+.2f}% vs {f['reference_pct'][1]:+.2f}%",
         f"{f['model_pct'][0]:+.2f}% vs {f['model_pct'][1]:+.2f}%",
         f"{f['model_bits'][0]:.2f} vs {f['model_bits'][1]:.2f}"]
        for f in sec["flips"]
    ]  # fmt: skip
    return [
        f"Where a SmolLM2 winner loses on {model} (pairs at most {PAIR_BITS:g} bit per element "
        "apart; PPL change against each tool's own baseline):",
        "",
        md_table(["wins on SmolLM2", "loses to", "SmolLM2", model, f"bits on {model}"], rows),
    ]


def markdown(results: dict) -> str:
    m = results["machine"]
    parts = [
        "# KV-cache quality per model",
        "",
        "Generated by `make bench` (`python -m benchmarks.report.model_report`); every number is "
        "in `models.json`, SmolLM2's in `report.md`.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; Python "
        f"{m['python']}, torch {m['torch']}, transformers {m['transformers']}.",
    ]
    for entry in results["models"]:
        model = entry["model"]
        parts += ["", f"## {model}", "", entry["about"] + "."]
        for sec in entry["sections"]:
            plot = f"{model}/ppl_vs_bits_{sec['chunk_tokens']}.png"
            parts += report._quality_markdown(
                f"{model} at {sec['chunk_tokens']}-token windows", sec["quality"],
                sec["rows"], sec["peer"], sec["peer_note"], plot,
            )  # fmt: skip
            parts += [""] + _flip_lines(model, sec)
        parts += budget_report.budget_markdown(
            entry.get("budgets", []), f"### {model}: per-layer precision under a bits budget",
            f"{model}/{budget_report.PLOT}",
        )  # fmt: skip
    return "\n".join(parts) + "\n"


def write(report_dir: Path, results: dict) -> list[Path]:
    """models.json, models.md and each section's plot (in its model's directory)."""
    files = [report_dir / "models.json", report_dir / "models.md"]
    write_file(files[0], json.dumps(results, indent=2) + "\n")
    for entry in results["models"]:
        for sec in entry["sections"]:
            plot = report_dir / entry["model"] / f"ppl_vs_bits_{sec['chunk_tokens']}.png"
            report.plot_quality(sec["rows"], plot)
            files.append(plot)
        if entry.get("budgets"):
            plot = report_dir / entry["model"] / budget_report.PLOT
            budget_report.plot_budgets(entry["budgets"], plot)
            files.append(plot)
    write_file(files[1], markdown(results))
    return files


def main(argv: list[str]) -> None:
    force = "--force" in argv
    argv = [a for a in argv if a != "--force"]
    if len(argv) < 2:
        raise SystemExit(
            "usage: python -m benchmarks.report.model_report REPORT_DIR MODEL... [--force]"
        )
    report_dir = Path(argv[0])
    try:
        report.check_out(report_dir, force, ("models.json", "models.md"), "REPORT_DIR")
        files = write(report_dir, build(report_dir, argv[1:]))
    except TQExportError as e:
        raise SystemExit(f"error: {e}") from None
    print("wrote " + ", ".join(str(f) for f in files))


if __name__ == "__main__":
    main(sys.argv[1:])
