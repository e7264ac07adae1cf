"""The README's "formats at a glance" table, generated from the report's ``results.json`` so
that every number on the front page is one the report holds (``make docs`` rewrites it; a test
fails when the committed table is stale)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks.report.markdown import table as md_table
from tqexport.safe_files import write_file
from tqexport.spec.request import UNRECORDED_WEIGHTS

BEGIN, END = "<!-- glance:begin (make docs) -->", "<!-- glance:end -->"


def _runs_on(dtype: str, recent: bool) -> str:
    """Where a kv-cache dtype runs: every one on ONNX Runtime CPU; the Triton kernels (CUDA)
    and TensorRT plugins where a kernel covers it; vLLM for vLLM's own names without a recent
    window (which vLLM cannot express)."""
    from tqexport.kvquant.codecs import codec_for
    from tqexport.kvquant.modes import parse_kv_cache_dtype
    from tqexport.ops.triton.common import supports

    where = ["ORT CPU"]
    if supports(codec_for(dtype, 128, "float16", 1.0, 1.0)):
        where += ["CUDA", "TensorRT"]
    if not parse_kv_cache_dtype(dtype).native and not recent:
        where.append("vLLM")
    return ", ".join(where)


def _speed_point(speed: dict | None) -> dict | None:
    """The decode point the table quotes: batch 1 at the longest context measured."""
    points = [p for p in (speed or {}).get("decode", []) if p["batch"] == 1]
    return max(points, key=lambda p: p["context"]) if points else None


def _ratio(point: dict | None, label: str) -> str:
    if point is None:
        return "-"
    ratios = point["speed_vs_auto"]
    for name in (f"{label} [auto]", f"{label} [native]", label):  # what a default run gets
        if name in ratios:
            return f"{ratios[name]:.2f}x"
    return "-"


def table(results: dict) -> str:
    """One row per kv-cache dtype as the report ran it (boundary layers on), plus every
    configuration whose decode speed the report measured; the best long-window configurations
    follow the table."""
    point = _speed_point(results.get("speed"))
    measured = {re.sub(r" \[\w+\]$", "", n) for n in point["speed_vs_auto"]} if point else set()
    rows = []
    for r in results["rows"]:
        bare = r["label"] == r.get("kv_cache_dtype")
        if r["tool"] != "tqexport" or not (bare or r["label"] in measured):
            continue
        rows.append([f"`{r['label']}`", f"{r['bits_per_element']:.2f}",
                     r.get("weights", UNRECORDED_WEIGHTS), f"{r['ppl_delta_pct']:+.2f}%",
                     f"{r['kl']:.5f}", _ratio(point, r["label"]),
                     _runs_on(r["kv_cache_dtype"], bool(r.get("recent_window")))])  # fmt: skip
    ctx = f"context {point['context']}, batch 1" if point else "not measured"
    tokens = results["quality"]["chunking"]["chunk_tokens"]
    out = [
        md_table(
            [
                "format",
                "bits/element all in",
                "weights",
                f"PPL change ({tokens}-token windows)",
                "mean KL",
                f"decode vs auto ({ctx})",
                "runs on",
            ],
            rows,
        ),  # fmt: skip
    ]
    peers = [r for r in results["rows"] if r["tool"] == "llama.cpp" and r["label"] != "f16"]
    if peers:
        out += ["", "llama.cpp's own caches on the same text: " + ", ".join(
            f"{r['label']} {r['bits_per_element']:.2f} bits {r['ppl_delta_pct']:+.2f}%"
            for r in peers) + "."]  # fmt: skip
    for g in results.get("goals", []):
        budget = re.match(r"at (\d+)-token windows, .* at <= ([\d.]+) bits", g["goal"])
        if budget and g["met"] is not None:
            best = g["detail"].removeprefix("best: ")
            out += [
                "",
                f"Best measured at <= {budget[2]} bits on one {budget[1]}-token window: {best}.",
            ]
    return "\n".join(out)


def update(text: str, results: dict) -> str:
    """``text`` with the part between the glance markers replaced by the current table."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the glance markers {BEGIN!r} ... {END!r} are missing")
    return text[: start + len(BEGIN)] + "\n" + table(results) + "\n" + text[end:]


def main(argv: list[str]) -> int:
    """``python -m benchmarks.report.glance README.md docs/report/results.json``: rewrite the
    page in place."""
    page, results = Path(argv[0]), json.loads(Path(argv[1]).read_text())
    write_file(page, update(page.read_text(), results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
