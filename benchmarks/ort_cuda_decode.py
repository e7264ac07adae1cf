"""ORT CUDA decode row for scripts/gpu_check.sh: device-resident caches bound in place.

Needs onnxruntime-gpu with a CUDA device. Per kv dtype: the artifact (built once into
``--workdir``) decodes B sequences holding C cached tokens on the CUDA provider with its caches
as device OrtValues bound onto both the cache inputs and outputs, and the same steps with host
caches fed and fetched every step (what a host-buffer backend costs). Checks that the caches
live on the device and stay in place (each cache output is its input's buffer) and that the
logits agree with the CPU provider's within 1e-3; prints tokens/s of both. Exit 1 on a failed
check.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tqexport.bench.speed import artifact_for
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.runtime.backends.ort import OrtBackend


def steps_for(spec, context, batch, n):
    per_seq = -(-(context + n + 1) // spec.block_size)
    tables = [
        [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))] * len(spec.groups)
        for i in range(batch)
    ]
    steps = [build_step(spec, [SeqChunk([7 + s], context + s, t) for t in tables])
             for s in range(n + 1)]  # fmt: skip
    return steps, 1 + batch * per_seq


def timed(backend, steps):
    times, logits = [], []
    for step in steps:
        t0 = time.perf_counter()
        logits.append(backend.run(step).numpy())
        times.append(time.perf_counter() - t0)
    return min(times[1:]), logits


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="auto,turboquant_4bit_nc")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("ORT CUDA decode: no CUDAExecutionProvider (install onnxruntime-gpu)")
        return 1
    ok = True
    print(f"{'kv dtype':>20} {'batch':>5} {'device tok/s':>13} {'host tok/s':>11} "
          f"{'in place':>8} {'max |dlogits| vs CPU':>21}")  # fmt: skip
    for d in args.dtypes.split(","):
        art = artifact_for(args.model, d, args.workdir)
        for b in (int(x) for x in args.batches.split(",")):
            steps, blocks = steps_for(art.spec, args.context, b, args.steps)
            dev = OrtBackend(art, blocks, device="cuda")
            on_device = all(v.device_name().lower() == "cuda" for v in dev.cache_values.values())
            dev_s, dev_logits = timed(dev, steps)
            ptrs = {n.replace("cache.", "cache_out.", 1): v.data_ptr()
                    for n, v in dev.cache_values.items()}  # fmt: skip
            in_place = on_device and dev.last_output_ptrs == ptrs
            host_s, _ = timed(OrtBackend(art, blocks, device="cuda", in_place=False), steps)
            _, cpu_logits = timed(OrtBackend(art, blocks, device="cpu"), steps[:2])
            diff = max(
                float(np.abs(a - c).max()) for a, c in zip(dev_logits[:2], cpu_logits, strict=True)
            )
            ok &= in_place and diff < 1e-3
            print(f"{d:>20} {b:>5} {b / dev_s:>13.1f} {b / host_s:>11.1f} "
                  f"{str(in_place):>8} {diff:>21.2e}", flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
