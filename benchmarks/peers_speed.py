"""Decode tokens/s of tqexport on ONNX Runtime CPU against peers, all in one run, interleaved.

Peers (installed by the project's extras: ``pip install -e '.[peers-speed]'`` for ONNX Runtime
GenAI, ``'.[peers]'`` for llama.cpp):

- ONNX Runtime GenAI: its model builder's CPU models of the same weights, one per
  ``--genai-precisions`` (default fp32 and int4: RTN blocks of 32 at accuracy level 4, the
  level tqexport's block-quantized weights run at), built once, offline, from the HF directory
  tqexport converts the GGUF into; GroupQueryAttention over a contiguous fp32 KV buffer shared
  between steps. The prompt is prefilled outside the timing.
- llama.cpp (llama-cpp-python) on the GGUF itself, f16 / q8_0 / q4_0 K and V caches, flash
  attention, batch 1 (its Python API decodes one sequence).
- tqexport: the artifacts of ``tqexport bench speed --weights`` (built once into ``--workdir``,
  default ``auto``: a GGUF's own 4- and 8-bit blocks): B
  sequences with C cached tokens, single-token decode steps, under every ``--kernels`` choice
  (systems ``tqexport fp8 [native]``, ``tqexport fp8 [bodies]``).

For each (context, batch) point every system takes one warm-up step, then step s of every
system runs before step s + 1 of any, so a loaded machine slows them alike; the fastest step
counts. Compare ratios measured in the same run, not absolute numbers across runs. The JSON also
records the load average before and after each point, what ran tqexport's layers, both systems'
ORT session options and how they differ (GenAI gets ``--threads`` and, with ``--genai-spinning
same``, tqexport's spinning through a genai_config overlay where its version takes one), and
each system's footprint (weights on disk, KV bytes per token) for the bytes each step reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from tqexport.bench import bounds, sessions, weights_floor
from tqexport.bench.sessions import GENAI, genai_system
from tqexport.bench.speed import (
    artifact_for,
    kernel_label,
    load_average,
    parse_kernels,
    run_kernels,
    split_label,
)
from tqexport.console import error_exit
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.errors import TQExportError
from tqexport.runtime.backends.ort import DEFAULT_OPTIONS, OrtBackend, session_summary
from tqexport.spec.request import DEFAULT_WEIGHTS, WEIGHTS
from tqexport.weights.precision import stored_label

#: GenAI's builder options per precision: int4 in RTN blocks of 32 at accuracy level 4
GENAI_EXTRA = {"int4": ["--extra_options", "int4_accuracy_level=4", "int4_block_size=32"]}


def hf_dir(model: str, out: Path) -> Path:
    """The HF checkpoint tqexport loads for MODEL (GGUF converted and cached), as a directory
    GenAI's builder reads (it needs ``architectures`` in config.json)."""
    from tqexport.models import builtins, cache, loader

    loader.load_model(model)  # converts and caches a GGUF once
    gguf = model in builtins.GGUF_BUILTINS
    src = cache.gguf_cache(builtins.builtin_gguf(model)) if gguf else Path(model)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def genai_model_dir(model: str, workdir: Path, precision: str = "fp32") -> Path:
    out = workdir / f"genai-{Path(model).name}-{precision}"
    if not (out / "genai_config.json").is_file():
        src = hf_dir(model, workdir / f"{Path(model).name}-hf")
        cmd = [
            sys.executable,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(src),
            "-o",
            str(out),
            "-p",
            precision,
            "-e",
            "cpu",
            "-c",
            str(workdir / "genai-cache"),
            *GENAI_EXTRA.get(precision, []),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def open_genai(model_dir: Path, threads: int, spinning: bool | None):
    """GenAI's model on the CPU with its decoder session set to ``threads`` and ``spinning``
    (None: GenAI's own) where this GenAI takes the overlay, else as much of it as it takes:
    (model, the overlay applied, why a part was dropped or None)."""
    import onnxruntime_genai as og

    note = None
    tries = [sessions.genai_overlay(threads, spinning), sessions.genai_overlay(threads, None), {}]
    for overlay in [t for i, t in enumerate(tries) if t not in tries[:i]]:
        cfg = og.Config(str(model_dir))
        cfg.clear_providers()  # CPU
        try:
            if overlay:
                cfg.overlay(json.dumps(overlay))
            return og.Model(cfg), overlay, note
        except (AttributeError, RuntimeError) as e:  # no Config.overlay, or an unknown key
            note = f"this GenAI refused the overlay {json.dumps(overlay)}: {e}"
    raise RuntimeError(note)


def genai_session_record(ours: dict, genai_config: dict, overlay: dict, note: str | None,
                         system: str = GENAI):  # fmt: skip
    """GenAI's session options as run (its genai_config.json with the overlay applied), the
    overlay, how they differ from tqexport's ``ours``, and why part of the overlay was dropped."""
    theirs = sessions.genai_session(sessions.merged(genai_config, overlay), os.cpu_count() or 1)
    return {system: theirs, "genai_overlay": overlay,
            "differences": sessions.differences(ours, theirs), "note": note}  # fmt: skip


#: prompt tokens GenAI takes per call at batch 1 (it refuses a second call at a larger batch):
#: its CPU attention holds a call's scores at once (heads x tokens x context floats: 60 GB for
#: one 32k-token call on Qwen2.5 Coder 0.5B, 3.7 GB for a chunk)
GENAI_PROMPT_CHUNK = 2048
#: prompt tokens llama.cpp evaluates per call (one call is the same computation in pieces)
LLAMA_PROMPT_CHUNK = 2048
#: a peer's prompt longer than this reports each chunk on stderr: at 16k tokens the peers'
#: prefills are tens of minutes that would otherwise pass without a line
PREFILL_REPORT = 4096


def prefill(label: str, tokens: int, chunk: int, feed) -> None:
    """``feed(start, end)`` over a ``tokens``-long prompt in slices of ``chunk``; past
    :data:`PREFILL_REPORT` tokens a line on stderr after each slice (tokens done, seconds)."""
    t0 = time.perf_counter()
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        feed(start, end)
        if tokens > PREFILL_REPORT:
            took = time.perf_counter() - t0
            print(f"  {label}: prompt {end}/{tokens} tokens ({took:.0f} s)", file=sys.stderr,
                  flush=True)  # fmt: skip


class GenAI:
    """One GenAI generator holding ``batch`` prompts of ``context`` tokens."""

    def __init__(self, model, context: int, batch: int, steps: int, label: str = GENAI):
        import onnxruntime_genai as og

        params = og.GeneratorParams(model)
        params.set_search_options(max_length=context + steps + 2, batch_size=batch, do_sample=False)
        self.gen = og.Generator(model, params)
        rng = np.random.default_rng(0)
        prompt = rng.integers(10, 30000, (batch, context)).astype(np.int32)
        chunk = GENAI_PROMPT_CHUNK if batch == 1 else context  # GenAI appends once at batch > 1
        prefill(label, context, chunk, lambda a, b: self.gen.append_tokens(prompt[:, a:b]))
        self.gen.generate_next_token()  # the prompt's own next token (no decode step yet)

    def step(self):
        self.gen.generate_next_token()


class LlamaCpp:
    def __init__(self, gguf: Path, kv_type: str, context: int, threads: int):
        import llama_cpp

        ggml = getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}")
        self.llm = llama_cpp.Llama(
            str(gguf),
            n_ctx=context + 64,
            n_batch=512,
            flash_attn=True,
            type_k=ggml,
            type_v=ggml,
            n_threads=threads,
            verbose=False,
        )
        rng = np.random.default_rng(0)
        prompt = rng.integers(10, 30000, context).tolist()
        prefill(f"llama.cpp {kv_type}", context, LLAMA_PROMPT_CHUNK,
                lambda a, b: self.llm.eval(prompt[a:b]))  # fmt: skip

    def step(self):
        self.llm.eval([7])


class Tqexport:
    def __init__(self, art, context: int, batch: int, steps: int, threads, kernels: str):
        spec = art.spec
        per_seq = -(-(context + steps + 2) // spec.block_size)
        self.backend = OrtBackend(art, 1 + batch * per_seq, threads, kernels=kernels)
        self.spec, self.pos = spec, context
        self.tables = [
            [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))] * len(spec.groups)
            for i in range(batch)
        ]

    def step(self):
        self.backend.run(build_step(self.spec, [SeqChunk([7], self.pos, t) for t in self.tables]))
        self.pos += 1


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--dtypes",
        default="auto,fp8,turboquant_4bit_nc,turboquant_4bit_nc:32",
        help="tqexport kv dtypes; DTYPE:N adds a recent window of N",
    )
    ap.add_argument(
        "--kernels",
        default="auto,bodies",
        help="tqexport kernel choices, comma-separated: native, bodies, auto (native where the "
        "native kernels serve every artifact, else bodies)",
    )
    ap.add_argument("--llama-kv", default="f16,q8_0,q4_0")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument(
        "--genai-precisions",
        default="fp32,int4",
        help="GenAI models to build and run beside tqexport, comma-separated (-p of its builder)",
    )
    ap.add_argument(
        "--weights",
        default=DEFAULT_WEIGHTS,
        choices=WEIGHTS,
        help="tqexport's --weights for every artifact (auto: a GGUF's own blocks)",
    )
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help=f"leave out {weights_floor.SYSTEM!r}: ORT running only the weight MatMuls of the "
        "first --dtypes artifact, the fastest any decoder on these weights can step",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--genai-spinning",
        choices=("same", "default"),
        default="same",
        help="GenAI's idle intra-op threads: spin as tqexport's do (same) or as GenAI sets",
    )
    ap.add_argument(
        "--max-cached-tokens",
        type=int,
        default=32768,
        help="skip points whose batch x context exceeds this (memory, time)",
    )
    ap.add_argument(
        "--peer-max-cached-tokens",
        type=int,
        default=8192,
        help="the same for GenAI, which prefills every prompt (slow at batch 8)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    ap.add_argument("--peer-workdir", type=Path, default=Path("out/peers"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    asked = parse_kernels(args.kernels)
    configs = {}
    for d in args.dtypes.split(","):
        name, _, window = d.partition(":")
        label = f"{name} recent {window}" if window else name
        configs[label] = artifact_for(args.model, name, args.workdir, int(window or 0),
                                      args.weights)  # fmt: skip
    kernels = run_kernels(asked, {n: a.spec for n, a in configs.items()})
    footprint = {f"tqexport {n}": bounds.artifact_footprint(a) for n, a in configs.items()}
    floor_art = next(iter(configs.values()))
    if not args.no_floor:
        footprint[weights_floor.SYSTEM] = bounds.footprint(
            weights_floor.weights_bytes(weights_floor.floor_model(floor_art)), 0
        )
    spinning = DEFAULT_OPTIONS["allow_spinning"] if args.genai_spinning == "same" else None
    genai, genai_configs, overlay, note = {}, {}, {}, None
    for precision in [] if args.no_genai else args.genai_precisions.split(","):
        system = genai_system(precision)
        genai_dir = genai_model_dir(args.model, args.peer_workdir, precision)
        genai[system], overlay, note = open_genai(genai_dir, args.threads, spinning)
        genai_configs[system] = json.loads((genai_dir / "genai_config.json").read_text())
        footprint[system] = bounds.genai_footprint(genai_dir, genai_configs[system])
    gguf = None
    if not args.no_llama:
        from tqexport.bench import peers

        gguf = peers.gguf_path(args.model) if peers.available() else None
        if gguf is None:
            print("llama.cpp: not installed (pip install -e '.[peers]'), skipped", flush=True)
        else:
            elements = bounds.kv_elements_per_token(next(iter(configs.values())).spec)
            for kv in args.llama_kv.split(","):
                footprint[f"llama.cpp {kv}"] = bounds.gguf_footprint(
                    gguf, elements, peers.KV_TYPES[kv]
                )
    rows, ran, ours_session = [], {}, None
    run_before = load_average()
    for c in (int(x) for x in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            if b * c > args.max_cached_tokens:
                continue
            systems = {
                f"tqexport {kernel_label(n, k)}": Tqexport(a, c, b, args.steps, args.threads, k)
                for k in kernels
                for n, a in configs.items()
            }
            if not args.no_floor:
                systems[weights_floor.SYSTEM] = weights_floor.WeightsFloor(
                    floor_art, b, args.threads
                )
            for system, model in genai.items() if b * c <= args.peer_max_cached_tokens else ():
                systems[system] = GenAI(model, c, b, args.steps, system)
            if gguf is not None and b == 1:
                for kv in args.llama_kv.split(","):
                    systems[f"llama.cpp {kv}"] = LlamaCpp(gguf, kv, c, args.threads)
            for n, sys_ in systems.items():
                if isinstance(sys_, Tqexport):
                    choice = sys_.backend.kernel_choice
                    config = split_label(n.removeprefix("tqexport "))[0]
                    what = {"configuration": config, "kernels": choice.kernels}
                    ran.setdefault(n, {**what, "reason": choice.reason})
                    ours_session = ours_session or session_summary(
                        sys_.backend.session.get_session_options()
                    )
            times = {n: [] for n in systems}
            before = load_average()
            for _ in range(args.steps + 1):
                for n, sys_ in systems.items():
                    t0 = time.perf_counter()
                    sys_.step()
                    times[n].append(time.perf_counter() - t0)
            after = load_average()
            tps = {n: b / min(t[1:]) for n, t in times.items()}
            rows.append({"context": c, "batch": b, "tokens_per_second": tps,
                         "loadavg": {"before": before, "after": after}})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del systems
    print_table(rows, kernels)
    if args.json:
        versions = {"onnxruntime": metadata.version("onnxruntime")}
        if genai:
            versions["onnxruntime-genai"] = metadata.version("onnxruntime-genai")
        if gguf is not None:
            versions["llama-cpp-python"] = metadata.version("llama-cpp-python")
        session = {"tqexport": ours_session}
        for system, config in genai_configs.items():
            record = genai_session_record(ours_session, config, overlay, note, system)
            session.update(record if system == GENAI else {system: record[system]})
        command = " ".join(["benchmarks/peers_speed.py", *(sys.argv[1:] if argv is None else argv)])
        result = {"command": command, "versions": versions, "threads": args.threads,
                  "weights": {n: stored_label(a.spec) for n, a in configs.items()},
                  "steps": args.steps, "kernels": kernels,
                  "kernels_requested": asked, "systems": ran,
                  "session_options": session, "footprint": footprint,
                  "loadavg": {"before": run_before, "after": load_average()},
                  "decode": rows}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def print_table(rows, kernels):
    names = list(dict.fromkeys(n for r in rows for n in r["tokens_per_second"]))
    auto = f"tqexport {kernel_label('auto', kernels[0])}"
    print("| context | batch | " + " | ".join(names) + f" | {auto} / GenAI |")
    print("|---" * (len(names) + 3) + "|")
    for r in rows:
        t = r["tokens_per_second"]
        ratio = f"{t[auto] / t[GENAI]:.2f}x" if GENAI in t and auto in t else "-"
        cells = [f"{t[n]:.1f}" if n in t else "-" for n in names]
        print(f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    try:
        main()
    except TQExportError as e:  # bad input: one line, as the CLI says it
        error_exit(str(e))
