"""Decode tokens/s of two builds of the same artifacts, interleaved step by step in one process.

``--before`` and ``--after`` are ``tqexport bench speed`` workdirs (its artifact directories,
``MODEL-DTYPE-WEIGHTS``, e.g. one built before a change to the ops or the graph and one after).
Every artifact at every batch size of one context runs in the same loop, one step of each in
turn, so a loaded machine slows them alike: compare the ratios, not the absolute numbers.
Prints tokens/s, the speed-up, batch scaling (batch B tokens/s over batch 1) and each dtype's
ratio to ``auto``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tqexport.bench.speed import artifact_dir, decode_run
from tqexport.contract.artifact import open_artifact
from tqexport.spec.request import DEFAULT_WEIGHTS, WEIGHTS


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--before", type=Path, default=Path("out/bench-before"))
    ap.add_argument("--after", type=Path, default=Path("out/bench"))
    ap.add_argument("--dtypes", default="auto,fp8,turboquant_4bit_nc")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHTS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    arts = {
        (when, d): open_artifact(artifact_dir(args.model, d, root, weights=args.weights))
        for when, root in (("before", args.before), ("after", args.after))
        for d in dtypes
    }
    rows = []
    batches = [int(x) for x in args.batches.split(",")]
    for c in (int(x) for x in args.contexts.split(",")):
        # every batch size of a context in the same loop too: batch scaling is a ratio
        labels = {f"{w}/{d}/{b}": a for (w, d), a in arts.items() for b in batches}
        sizes = {label: int(label.rsplit("/", 1)[1]) for label in labels}
        ms, _ = decode_run(labels, c, sizes, args.steps, args.threads)
        for b in batches:
            for d in dtypes:
                tps = {w: 1000 * b / ms[f"{w}/{d}/{b}"] for w in ("before", "after")}
                rows.append({"context": c, "batch": b, "dtype": d, "tokens_per_second": tps})
        print(json.dumps(rows[-len(dtypes) * len(batches) :]), flush=True)
    t = Table(title=f"decode tokens/s, {args.model}, before vs after (interleaved, one process)")
    cols = ["context", "batch", "kv dtype", "before", "after", "speed-up", "before vs auto",
            "after vs auto", "before b/b1", "after b/b1"]  # fmt: skip
    for col in cols:
        t.add_column(col, justify="right")
    index = {(r["context"], r["batch"], r["dtype"]): r["tokens_per_second"] for r in rows}
    batch1 = min(int(x) for x in args.batches.split(","))
    for r in rows:
        c, b, d, tps = r["context"], r["batch"], r["dtype"], r["tokens_per_second"]
        auto = index.get((c, b, "auto"))
        one = index.get((c, batch1, d))
        r["vs_auto"] = {w: tps[w] / auto[w] for w in tps} if auto else None
        r["batch_scaling"] = {w: tps[w] / one[w] for w in tps} if one else None
        t.add_row(
            str(c), str(b), d, f"{tps['before']:.2f}", f"{tps['after']:.2f}",
            f"{tps['after'] / tps['before']:.2f}x",
            *(f"{r['vs_auto'][w]:.2f}x" if auto else "-" for w in ("before", "after")),
            *(f"{r['batch_scaling'][w]:.2f}x" if one else "-" for w in ("before", "after")),
        )  # fmt: skip
    Console(width=160).print(t)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
