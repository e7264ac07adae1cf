"""Per-op time of one decode step: tqexport (native kernels) beside ONNX Runtime GenAI.

Both sessions run with ORT's profiler on (tqexport through ``session_options(profile=...)``,
GenAI through its genai_config's decoder ``session_options.enable_profiling``), take
``--steps`` single-token decode steps at each context (batch ``--batch``), and the step with
the shortest ``model_run`` is split by op type (``*_kernel_time`` events, summed per op; the
run's remainder outside the nodes is "graph overhead"). The tables say where one system spends
time the other does not; the fastest step, not the mean, so a loaded machine hurts less.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from tqexport.bench import sessions
from tqexport.bench.speed import artifact_for, load_average
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.runtime.backends.ort import OrtBackend


def fastest_run(profile: Path) -> tuple[float, dict[str, float]]:
    """(ms of the fastest ``model_run``, the fewest ms per op type over the runs) from an ORT
    profile: a loaded machine stretches some nodes of some steps, the minimum drops that."""
    events = json.loads(profile.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e["name"] == "model_run")  # fmt: skip
    per_run: list[dict[str, float]] = [defaultdict(float) for _ in runs]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            i = next((i for i, (a, b) in enumerate(runs) if a <= e["ts"] <= b), None)
            if i is not None:
                per_run[i][e["args"].get("op_name", "?")] += e["dur"] / 1000
    for (a, b), ops in zip(runs, per_run, strict=True):
        ops["graph overhead"] = (b - a) / 1000 - sum(ops.values())
    names = {n for ops in per_run for n in ops}
    return min(b - a for a, b in runs) / 1000, {n: min(o.get(n, 0.0) for o in per_run)
                                                for n in names}  # fmt: skip


def profile_tqexport(art, context: int, batch: int, steps: int, threads: int, out: Path):
    spec = art.spec
    per_seq = -(-(context + steps + 2) // spec.block_size)
    options = {"profile": str(out / "tqexport")}
    backend = OrtBackend(art, 1 + batch * per_seq, threads, options=options, kernels="native")
    tables = [
        [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))] * len(spec.groups)
        for i in range(batch)
    ]
    for s in range(steps + 1):
        backend.run(build_step(spec, [SeqChunk([7], context + s, t) for t in tables]))
    return Path(backend.session.end_profiling())


def profile_genai(model_dir: Path, context: int, batch: int, steps: int, threads: int, out: Path):
    import numpy as np
    import onnxruntime_genai as og

    overlay = sessions.genai_overlay(threads, False)
    overlay["model"]["decoder"]["session_options"]["enable_profiling"] = str(out / "genai")
    cfg = og.Config(str(model_dir))
    cfg.clear_providers()
    cfg.overlay(json.dumps(overlay))
    model = og.Model(cfg)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + steps + 4, batch_size=batch, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.random.default_rng(0).integers(10, 30000, (batch, context), np.int32))
    for _ in range(steps + 2):  # the prompt's next token, a warm-up, then the steps
        gen.generate_next_token()
    del gen, model  # the profile is written when the session closes
    return max(out.glob("genai*.json"), key=lambda p: p.stat().st_mtime)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    ap.add_argument("--genai-dir", type=Path, default=Path("out/peers/genai-smollm2-fp32"))
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    art = artifact_for(args.model, args.dtype, args.workdir)
    for c in (int(x) for x in args.contexts.split(",")):
        before = load_average()
        with tempfile.TemporaryDirectory() as tmp:
            tq = fastest_run(profile_tqexport(art, c, args.batch, args.steps, args.threads,
                                              Path(tmp)))  # fmt: skip
            ga = fastest_run(profile_genai(args.genai_dir, c, args.batch, args.steps,
                                           args.threads, Path(tmp)))  # fmt: skip
        names = sorted(set(tq[1]) | set(ga[1]), key=lambda n: -max(tq[1].get(n, 0),
                                                                    ga[1].get(n, 0)))  # fmt: skip
        print(f"\ncontext {c}, batch {args.batch}, load {before} -> {load_average()}")
        print(f"| op | tqexport {args.dtype} [native] ms | ORT GenAI ({args.genai_dir.name}) ms |")
        print("|---|---|---|")
        for n in names[: args.top]:
            print(f"| {n} | {tq[1].get(n, 0):.2f} | {ga[1].get(n, 0):.2f} |")
        print(f"| step (fastest model_run) | {tq[0]:.2f} | {ga[0]:.2f} |")


if __name__ == "__main__":
    main()
