"""SmolLM2 decode on ONNX Runtime CPU: auto vs fp8 vs turboquant_4bit_nc, measured side by side.

For each kv dtype the artifact is built once (into out/bench-<dtype>), then B sequences with C
tokens already cached (block tables contiguous; cache bytes zero: decode cost does not depend on
the values) take N greedy decode steps. Printed: ms per step and tokens/s with the ratio to
``auto`` in the same run, KV bytes per token and the tokens a fixed budget holds, and the step
latency when --num-blocks grows 10x (in-place cache updates should keep it flat).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tqexport.export.artifact import BuildOptions, build_artifact
from tqexport.runtime.artifact import open_artifact
from tqexport.runtime.backends.ort import OrtBackend
from tqexport.runtime.executor import block_bytes, parse_memory
from tqexport.runtime.steps import SeqChunk, build_step

DTYPES = ("auto", "fp8", "turboquant_4bit_nc")


def artifact_for(dtype: str, root: Path):
    out = root / f"bench-{dtype}"
    if not out.exists():
        build_artifact("smollm2", out, BuildOptions(kv_cache_dtype=dtype))
    return open_artifact(out)


def decode_ms(art, context: int, batch: int, steps: int, extra_blocks: int = 0) -> float:
    spec = art.spec
    per_seq = -(-(context + steps) // spec.block_size)
    num_blocks = 1 + batch * per_seq + extra_blocks
    backend = OrtBackend(art, num_blocks)
    tables = [
        [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))] * len(spec.groups)
        for i in range(batch)
    ]
    times = []
    for s in range(steps + 1):
        step = build_step(spec, [SeqChunk([7], context + s, t) for t in tables])
        t0 = time.perf_counter()
        backend.run(step)
        times.append(time.perf_counter() - t0)
    return 1000 * min(times[1:])  # first step warms up


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", default="512MiB")
    ap.add_argument("--root", type=Path, default=Path("out"))
    args = ap.parse_args()
    args.root.mkdir(exist_ok=True)
    console = Console(width=140)
    arts = {d: artifact_for(d, args.root) for d in DTYPES}
    t = Table(title=f"SmolLM2 decode on ORT CPU ({torch.get_num_threads()} threads), fp32 weights")
    for col in (
        "context",
        "batch",
        *[f"{d} ms/step" for d in DTYPES],
        *[f"{d} tok/s vs auto" for d in DTYPES[1:]],
    ):
        t.add_column(col, justify="right")
    for c in args.contexts:
        for b in args.batches:
            ms = {d: decode_ms(arts[d], c, b, args.steps) for d in DTYPES}
            t.add_row(
                str(c), str(b), *[f"{ms[d]:.0f}" for d in DTYPES],
                *[f"{ms['auto'] / ms[d]:.2f}x" for d in DTYPES[1:]],
            )  # fmt: skip
            console.print(
                f"context {c} batch {b}: " + ", ".join(f"{d} {ms[d]:.0f} ms" for d in DTYPES)
            )
    console.print(t)
    m = Table(title=f"memory at a {args.budget} KV budget")
    for col in ("kv dtype", "KV bytes/token", "resident tokens", "vs auto"):
        m.add_column(col, justify="right")
    budget = parse_memory(args.budget)
    resident = {}
    for d in DTYPES:
        spec = arts[d].spec
        resident[d] = (budget // block_bytes(arts[d]) - 1) * spec.block_size
        m.add_row(
            d, str(spec.bytes_per_token), str(resident[d]), f"{resident[d] / resident['auto']:.2f}x"
        )
    console.print(m)
    s = Table(title="decode step latency vs cache size (context 256, batch 1)")
    for col in ("kv dtype", "ms/step", "ms/step with 10x blocks", "ratio"):
        s.add_column(col, justify="right")
    for d in DTYPES:
        small = decode_ms(arts[d], 256, 1, args.steps)
        per_seq = -(-(256 + args.steps) // 16)
        big = decode_ms(arts[d], 256, 1, args.steps, extra_blocks=9 * (1 + per_seq))
        s.add_row(d, f"{small:.1f}", f"{big:.1f}", f"{big / small:.2f}x")
    console.print(s)


if __name__ == "__main__":
    main()
