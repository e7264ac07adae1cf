"""ONNX Runtime session options for tqexport decode steps, measured against each other.

Each variant is one override of ``tqexport.runtime.backends.ort.DEFAULT_OPTIONS`` (the chosen
set); all variants of one (kv dtype, context, batch) point run interleaved, step by step, in
one process, so compare the ratios to ``default``. ``--profile DIR`` also writes ORT's per-node
profile of the default session there (``tqexport.bench.speed``'s decode steps).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tqexport.bench.speed import artifact_for, decode_run

VARIANTS = {
    "default": {},
    "1 thread": {"threads": 1},
    "optimization basic": {"graph_optimization_level": "basic"},
    "optimization extended": {"graph_optimization_level": "extended"},
    "memory pattern on": {"enable_mem_pattern": True},
    "cpu arena off": {"enable_cpu_mem_arena": False},
    "spinning": {"allow_spinning": True},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="auto,turboquant_4bit_nc")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    names = args.variants.split(",")
    t = Table(title=f"decode ms/step per ORT session variant, {args.model} (interleaved)")
    for col in ("kv dtype", "context", "batch", *names):
        t.add_column(col, justify="right")
    for d in args.dtypes.split(","):
        art = artifact_for(args.model, d, args.workdir)
        for c in (int(x) for x in args.contexts.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                ms, _ = decode_run(
                    {n: art for n in names},
                    c,
                    b,
                    args.steps,
                    step_options={n: VARIANTS[n] for n in names},
                )
                base = ms[names[0]]
                t.add_row(d, str(c), str(b), *(f"{ms[n]:.1f} ({ms[n] / base:.2f}x)" for n in names))
                print(d, c, b, {n: round(v, 1) for n, v in ms.items()}, flush=True)
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
