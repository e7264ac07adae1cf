"""``tqexport bench scale``: how decode cost and serving capacity grow with context.

For a model and its kv formats, a grid of contexts x batches: decode steps over filled caches
(:mod:`~tqexport.bench.filled`, no prefill), the formats interleaved step by step as in ``bench
speed``, each point beside the bound its bytes set: a step reads the weights once and every
sequence's visible keys and values, so at this machine's measured read bandwidth it cannot take
less than bytes / bandwidth. At every context, the largest batch a KV budget holds per format
(the serving memory plan's own count) and the tokens/s that batch decodes: capacity throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tqexport import validate
from tqexport.bench.bounds import artifact_footprint
from tqexport.bench.filled import dropped_blocks
from tqexport.bench.speed import decode_run, load_average, run_kernels
from tqexport.contract.artifact import Artifact
from tqexport.errors import TQExportError
from tqexport.runtime.memory import allocation, resolve_num_blocks
from tqexport.spec import ModelSpec
from tqexport.spec.request import DEFAULT_WEIGHTS

DEFAULT_SCALE_CONTEXTS = "1024,4096,8192,16384,32768"
DEFAULT_SCALE_BATCHES = "1,8,32"
DEFAULT_SCALE_BUDGET = "1GiB"
#: the prompt admitted beside decoding streams (``--prefill``): clipped to the model's limit
DEFAULT_STALL_PROMPT = 8192
#: the tensor the read bandwidth is measured on, bytes (far larger than any CPU cache)
BANDWIDTH_BYTES = 512 * 2**20


def kv_read_bytes(spec: ModelSpec, context: int) -> int:
    """Bytes of cached keys and values one sequence's decode step reads at ``context`` tokens:
    every layer's visible tokens (its window's at most) in its own format; the last
    ``recent_window`` tokens and the sink tokens from its recent-window cache instead."""
    total = 0
    for la in spec.layers:
        visible = context if la.window is None else min(context, la.window)
        recent = 0
        if la.recent is not None:
            recent = min(visible, la.recent_window + la.sink_tokens)
            total += recent * la.recent.bytes_per_token
        total += (visible - recent) * la.cache.bytes_per_token
    return total


def filled_bytes(spec: ModelSpec, batch: int, tokens: int, query: int) -> int:
    """Bytes of the caches :func:`~tqexport.bench.filled.filled_tables` allocates for
    ``batch`` sequences with room for ``tokens`` tokens, the next query at ``query``."""
    total = 0
    for g in spec.groups:
        n = -(-tokens // g.block_size)
        gone = dropped_blocks(g, query)
        live = n - max(0, min(gone.stop, n) - gone.start)
        total += (1 + batch * live) * spec.group_block_bytes(g)
    return total


def read_bandwidth(threads: int | None = None, repeats: int = 5) -> float:
    """This machine's memory read bandwidth, bytes/s: the fastest of ``repeats`` sums of a
    :data:`BANDWIDTH_BYTES` float32 tensor by torch on ``threads`` threads (None: its default,
    the cores ONNX Runtime's default uses too)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        x = torch.ones(BANDWIDTH_BYTES // 4)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return BANDWIDTH_BYTES / best


@dataclass(frozen=True)
class Capacity:
    """The sequences of ``context`` tokens a KV budget holds at once under the serving memory
    plan, and what bounds them (a cache group, or ``max_num_seqs``)."""

    batch: int
    bound_by: str


def capacity(
    art: Artifact,
    context: int,
    budget: str,
    max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> Capacity:
    """What ``serve --kv-cache-memory BUDGET --max-model-len CONTEXT`` admits at once: the
    memory plan split for that context, then the sequences its blocks hold (``inspect``'s
    ``max_seqs_at_context``); 0 when the budget holds fewer than 2 blocks."""
    try:
        per_group = resolve_num_blocks(art, None, budget, max_num_seqs, max_num_batched_tokens,
                                       context=context)  # fmt: skip
    except TQExportError:
        return Capacity(0, "the budget")
    s = allocation(art.spec, per_group, context, max_num_seqs, max_num_batched_tokens)["summary"]
    return Capacity(s["max_seqs_at_context"], s["bound_by"])


def scale_contexts(spec: ModelSpec, contexts: list[int], steps: int) -> tuple[list[int], list]:
    """(the contexts measured, the ones left out): a context past the model's recorded
    position limit is left out; one too close to it for a warm-up and ``steps`` decode steps is
    measured where they fit (32768 on a 32k model: 32765 with 2 steps). No limit: all kept."""
    limit = spec.max_position_embeddings
    if limit is None:
        return contexts, []
    last = limit - steps - 1  # positions context .. context + steps are written
    kept = [min(c, last) for c in contexts if c <= limit and last >= 1]
    return list(dict.fromkeys(kept)), [c for c in contexts if c > limit]


def grid_points(
    specs: dict[str, ModelSpec], contexts: list[int], batches: list[int], steps: int, limit: int
) -> list[dict]:
    """Every (context, batch) of the grid and the formats that run there: in ``specs``' order
    while their caches together stay within ``limit`` bytes; the others skipped with what
    their caches would need."""
    points = []
    for c in contexts:
        for b in batches:
            run, skipped, used = [], {}, 0
            for label, spec in specs.items():
                need = filled_bytes(spec, b, c + steps + 1, c)
                if used + need <= limit:
                    run.append(label)
                    used += need
                else:
                    skipped[label] = need
            points.append({"context": c, "batch": b, "run": run, "skipped": skipped})
    return points


def _bound(fp: dict, spec: ModelSpec, context: int, batch: int, bandwidth: float) -> dict:
    """A point's bytes per step and the tokens/s they allow at ``bandwidth``."""
    step = fp["weights_bytes"] + batch * kv_read_bytes(spec, context)
    return {"step_bytes": step, "bound_tokens_per_second": batch * bandwidth / step}


def measure_scale(
    arts: dict[str, Artifact],
    contexts: list[int],
    batches: list[int],
    steps: int,
    budget: str,
    grid_memory: int,
    threads: int | None = None,
    max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS,
    progress: Callable[[str], None] = lambda what: None,
) -> dict:
    """The grid (:func:`grid_points`) and, per context, every format at its capacity batch
    (:func:`capacity`), each point's formats interleaved in one process; bounds from the read
    bandwidth measured before and after (the larger counts)."""
    specs = {label: a.spec for label, a in arts.items()}
    kernels = run_kernels(["auto"], specs)[0]
    fps = {label: artifact_footprint(a) for label, a in arts.items()}
    bandwidth = [read_bandwidth(threads)]
    run_before = load_average()
    grid = []
    for p in grid_points(specs, contexts, batches, steps, grid_memory):
        c, b = p["context"], p["batch"]
        progress(f"context {c} batch {b}")
        row = {"context": c, "batch": b, "skipped_kv_bytes": p["skipped"]}
        if p["run"]:
            before = load_average()
            ms, ran = decode_run({n: arts[n] for n in p["run"]}, c, b, steps, threads,
                                 kernels=kernels)  # fmt: skip
            row.update(ms_per_step=ms, tokens_per_second={n: 1000 * b / v for n, v in ms.items()},
                       kernels={n: r["kernels"] for n, r in ran.items()},
                       loadavg={"before": before, "after": load_average()})  # fmt: skip
        grid.append(row)
    cap_rows = []
    for c in contexts:
        progress(f"context {c} at capacity")
        caps = {label: capacity(a, c, budget, max_num_seqs) for label, a in arts.items()}
        fits = {n: k.batch for n, k in caps.items() if k.batch > 0}
        row = {"context": c, "batch": {n: k.batch for n, k in caps.items()},
               "bound_by": {n: k.bound_by for n, k in caps.items()}}  # fmt: skip
        if fits:
            before = load_average()
            ms, _ = decode_run({n: arts[n] for n in fits}, c, fits, steps, threads,
                               kernels=kernels)  # fmt: skip
            row.update(ms_per_step=ms,
                       tokens_per_second={n: 1000 * fits[n] / v for n, v in ms.items()},
                       loadavg={"before": before, "after": load_average()})  # fmt: skip
        cap_rows.append(row)
    bandwidth.append(read_bandwidth(threads))
    best = max(bandwidth)
    for row in grid:
        c, b = row["context"], row["batch"]
        row["bound"] = {n: _bound(fps[n], specs[n], c, b, best) for n in row.get("ms_per_step", {})}
        for n, tps in row.get("tokens_per_second", {}).items():
            row["bound"][n]["share_of_bound"] = tps / row["bound"][n]["bound_tokens_per_second"]
    for row in cap_rows:
        tps = row.get("tokens_per_second", {})
        if "auto" in tps:
            row["vs_auto"] = {n: v / tps["auto"] for n, v in tps.items()}
    return {
        "threads": threads, "steps": steps, "budget": budget, "grid_memory": grid_memory,
        "max_num_seqs": max_num_seqs, "kernels": kernels,
        "read_bandwidth": {"bytes_per_second": bandwidth, "used": best,
                           "how": f"torch sum of {BANDWIDTH_BYTES >> 20} MiB float32, fastest "
                                  "of 5, before and after the run"},
        "loadavg": {"before": run_before, "after": load_average()},
        "footprint": fps,
        "grid": grid,
        "capacity": cap_rows,
    }  # fmt: skip


def plan_scale(
    target,
    dtypes,
    contexts: str,
    batches: str,
    steps: int,
    budget: str,
    grid_memory: str | None,
    workdir,
    recent: str = "0",
    weights: str = DEFAULT_WEIGHTS,
    max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS,
    threads: int | None = None,
    prefill: bool = False,
    stall_prompt: int = DEFAULT_STALL_PROMPT,
    long_prefill_token_threshold: int = validate.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
) -> tuple[int, Callable]:
    """Every input of a scale run checked before anything is built: (the points it measures,
    ``run(say, progress)``, which builds or reuses the artifacts and measures them; with
    ``prefill``, :func:`~tqexport.bench.prefill.measure_prefill` too, its long prompt
    ``stall_prompt`` tokens or the longest the model takes, prefilled beside the decoding
    streams under ``long_prefill_token_threshold``)."""
    from tqexport.bench import matrix
    from tqexport.weights.precision import stored_label

    ctx, bat, windows = matrix.speed_args(contexts, batches, steps, recent)
    validate.parse_memory(budget, "--kv-cache-memory")
    validate.integer(max_num_seqs, "--max-num-seqs", 1, validate.MAX_NUM_SEQS)
    if threads is not None:
        validate.threads(threads)
    if grid_memory is None:
        limit = (validate.physical_memory() or 2**33) // 2
    else:
        limit = validate.parse_memory(grid_memory, "--grid-memory")
    specs, build = matrix.speed_artifacts(target, dtypes, windows, weights, workdir)
    spec = next(iter(specs.values()))
    kept, left_out = scale_contexts(spec, ctx, steps)
    if not kept:
        raise TQExportError(
            f"--contexts {contexts}: every context is over the model's position limit "
            f"({spec.max_position_embeddings} tokens); give shorter ones"
        )

    position_limit = spec.max_position_embeddings
    validate.integer(stall_prompt, "--stall-prompt", 1, matrix.MAX_BENCH_CONTEXT)
    validate.serving(long_prefill_token_threshold=long_prefill_token_threshold)
    if position_limit is not None:
        stall_prompt = min(stall_prompt, position_limit - 1)

    def run(say: Callable[[str], None], progress: Callable[[str], None]) -> dict:
        from tqexport.bench.prefill import measure_prefill

        arts = build(say)
        result = measure_scale(arts, kept, bat, steps, budget, limit, threads, max_num_seqs,
                               progress)  # fmt: skip
        if prefill:
            result["prefill"] = measure_prefill(
                arts, kept, stall_prompt, threads=threads, progress=progress,
                threshold=long_prefill_token_threshold,
            )  # fmt: skip
        return {
            **result,
            "model": spec.model.get("name"),
            "position_limit": spec.max_position_embeddings,
            "left_out_contexts": left_out,
            "weights": {n: stored_label(a.spec) for n, a in arts.items()},
        }

    formats = len(specs) + matrix.is_artifact(target)  # an artifact runs beside auto
    points = len(kept) * (len(bat) + 1) + (len(kept) + formats if prefill else 0)
    return points, run


def plot_scale(result: dict, path, force: bool = False) -> None:
    """Two panels: decode tokens/s vs context per format (a line style per batch, log scale),
    and capacity throughput (every format at the batch the budget holds) vs context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tqexport.safe_files import write_figure

    fig, (grid_ax, cap_ax) = plt.subplots(1, 2, figsize=(13, 5))
    names = list(result["footprint"])
    batches = sorted({r["batch"] for r in result["grid"]})
    for i, name in enumerate(names):
        for j, b in enumerate(batches):
            pts = [r for r in result["grid"]
                   if r["batch"] == b and name in r.get("tokens_per_second", {})]  # fmt: skip
            if pts:
                grid_ax.plot([r["context"] for r in pts],
                             [r["tokens_per_second"][name] for r in pts], marker="o",
                             color=f"C{i % 10}", ls=["-", "--", ":", "-."][j % 4],
                             label=f"{name}, batch {b}")  # fmt: skip
        pts = [r for r in result["capacity"] if name in r.get("tokens_per_second", {})]
        if pts:
            cap_ax.plot([r["context"] for r in pts], [r["tokens_per_second"][name] for r in pts],
                        marker="o", color=f"C{i % 10}", label=name)  # fmt: skip
    grid_ax.set_title("decode tokens/s")
    cap_ax.set_title(f"capacity throughput: the batch {result['budget']} of KV holds")
    contexts = sorted({r["context"] for r in result["capacity"]})
    for ax in (grid_ax, cap_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result.get('model')}: decode on ONNX Runtime CPU ({result['kernels']} "
                 "kernels)")  # fmt: skip
    fig.tight_layout()
    write_figure(fig, path, force=force, dpi=110)
    plt.close(fig)
