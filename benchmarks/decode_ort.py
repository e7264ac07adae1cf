"""Decode step latency on ONNX Runtime CPU as the cache grows 10x, per kv dtype.

In-place cache updates (IO binding onto the input buffers) should keep a decode step's latency
flat when ``--num-blocks`` grows; a copying runtime would scale with the cache. Decode speed and
memory per kv dtype live in ``tqexport bench speed`` / ``make bench``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tqexport.bench.speed import artifact_for, decode_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "turboquant_4bit_nc"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    t = Table(title=f"decode step vs cache size (context {args.context}, batch 1)")
    for col in ("kv dtype", "ms/step", "ms/step with 10x blocks", "ratio"):
        t.add_column(col, justify="right")
    for d in args.dtypes:
        art = artifact_for(args.model, d, args.workdir)
        small = decode_ms(art, args.context, 1, args.steps)
        per_seq = -(-(args.context + args.steps) // art.spec.block_size)
        big = decode_ms(art, args.context, 1, args.steps, extra_blocks=9 * (1 + per_seq))
        t.add_row(d, f"{small:.1f}", f"{big:.1f}", f"{big / small:.2f}x")
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
