"""Time to first token of one prompt: tqexport (chunked prefill through its paged caches, as the
engine serves it) against ONNX Runtime GenAI (its builder's CPU models of the same weights,
``--genai-precisions``, default fp32 and int4), in one run, interleaved.

At each prompt length every system prefills the same token ids, a warm-up first, then round r of
every system before round r + 1 of any (``--rounds``), so a loaded machine slows them alike; the
fastest round counts, and the load average is recorded around each length. tqexport prefills in
steps of ``--max-num-batched-tokens`` (the serving default); GenAI takes the whole prompt in one
call. Compare ratios measured in one run, not absolute numbers across runs.

    python benchmarks/prefill_peers.py --model qwen2.5-coder-0.5b --contexts 512,2048,8192 \\
        --dtypes auto,turboquant_4bit_nc --json out/prefill_peers.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from pathlib import Path

from tqexport import validate
from tqexport.bench.prefill import prompt_ids, time_to_first_token
from tqexport.bench.speed import artifact_for, load_average
from tqexport.spec.request import DEFAULT_WEIGHTS, WEIGHTS
from tqexport.weights.precision import stored_label

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_speed import genai_model_dir, open_genai  # noqa: E402


def genai_first_token(model, ids: list[int]) -> float:
    """Seconds from handing GenAI the prompt to its first generated token (a fresh generator
    each time: nothing cached from an earlier round)."""
    import numpy as np
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 2, batch_size=1, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(np.asarray([ids], dtype=np.int32))
    gen.generate_next_token()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--dtypes", default="auto,turboquant_4bit_nc")
    ap.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHTS)
    ap.add_argument("--genai-precisions", default="fp32,int4")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=validate.DEFAULT_MAX_NUM_BATCHED_TOKENS)  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    ap.add_argument("--peer-workdir", type=Path, default=Path("out/peers"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    arts = {f"tqexport {d}": artifact_for(args.model, d, args.workdir, 0, args.weights)
            for d in args.dtypes.split(",")}  # fmt: skip
    genai = {}
    for precision in [p for p in args.genai_precisions.split(",") if p]:
        model_dir = genai_model_dir(args.model, args.peer_workdir, precision)
        genai[f"ORT GenAI {precision}"], _, _ = open_genai(model_dir, args.threads, None)
    spec = next(iter(arts.values())).spec
    chunk = args.max_num_batched_tokens
    rows = []
    for c in (int(x) for x in args.contexts.split(",")):
        ids = prompt_ids(spec, c)
        systems = {n: (lambda a=a, c=c: time_to_first_token(a, c, chunk, args.threads))
                   for n, a in arts.items()}  # fmt: skip
        systems |= {n: (lambda m=m, ids=ids: genai_first_token(m, ids)) for n, m in genai.items()}
        times = {n: [] for n in systems}
        before = load_average()
        for _ in range(args.rounds + 1):  # the first round warms up
            for n, run in systems.items():
                times[n].append(run())
        seconds = {n: min(t[1:]) for n, t in times.items()}
        rows.append({"context": c, "seconds": seconds,
                     "tokens_per_second": {n: c / s for n, s in seconds.items()},
                     "loadavg": {"before": before, "after": load_average()}})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "model": args.model,
        "chunk": chunk,
        "threads": args.threads,
        "weights": {n: stored_label(a.spec) for n, a in arts.items()},
        "versions": {
            p: metadata.version(p) for p in ("onnxruntime", *["onnxruntime-genai"] * bool(genai))
        },
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
