"""``tqexport bench scale``: its options and tables; :mod:`tqexport.bench.scale` measures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tqexport.bench import scale
from tqexport.console import console, err, progress
from tqexport.options import EngineOptions, WeightsOption
from tqexport.runtime.engine_config import EngineConfig
from tqexport.spec.request import DEFAULT_WEIGHTS
from tqexport.validate import printable


def say(what: str) -> None:
    """A progress line on stderr (stdout stays for --json)."""
    err.print(printable(what))


def bench_scale(
    target: Annotated[
        str, typer.Argument(help="MODEL (artifacts built per dtype) or artifact DIR.")
    ],
    kv_cache_dtype: Annotated[
        list[str] | None, typer.Option(help="kv dtypes (default: auto, fp8, turboquant_4bit_nc).")
    ] = None,
    contexts: Annotated[
        str,
        typer.Option(help="Context lengths, comma-separated (beyond the model's limit: left out)."),
    ] = scale.DEFAULT_SCALE_CONTEXTS,
    batches: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = (
        scale.DEFAULT_SCALE_BATCHES
    ),
    steps: Annotated[int, typer.Option(help="Timed decode steps per point.")] = 2,
    kv_cache_memory: Annotated[
        str, typer.Option(help="The KV budget the capacity batch is sized for.")
    ] = scale.DEFAULT_SCALE_BUDGET,
    max_num_seqs: EngineOptions[2] = EngineConfig.max_num_seqs,
    grid_memory: Annotated[
        str | None,
        typer.Option(
            help="KV memory one grid point may allocate, every format's caches together; a "
            "format over it is skipped there (default: half this machine's memory)."
        ),
    ] = None,
    workdir: Annotated[Path, typer.Option(help="Where MODEL's artifacts are built.")] = Path(
        "out/bench"
    ),
    recent_window: Annotated[
        str, typer.Option(help="--kv-recent-window values per quantized dtype, e.g. 0,32.")
    ] = "0",
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: EngineOptions[3] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the two plots (tokens/s, capacity) as PNG here.")
    ] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --plot file.")] = False,
    prefill: Annotated[
        bool,
        typer.Option(
            help="Also time each context's prompt to its first token (chunked prefill), and "
            "decoding streams' inter-token p99 while a --stall-prompt prompt is admitted."
        ),
    ] = False,
    stall_prompt: Annotated[
        int, typer.Option(help="Tokens of the prompt admitted beside decoding streams.")
    ] = scale.DEFAULT_STALL_PROMPT,
    long_prefill_token_threshold: EngineOptions[5] = EngineConfig.long_prefill_token_threshold,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Decode cost vs context and batch per kv dtype, each point beside its bytes-per-step
    bound; at each context the batch a KV budget holds and its tokens/s."""
    from tqexport.safe_files import check_output_file

    if plot is not None:
        check_output_file(plot, force, "--plot")
    total, run = scale.plan_scale(
        target, kv_cache_dtype, contexts, batches, steps, kv_cache_memory, grid_memory,
        workdir, recent_window, weights, max_num_seqs, threads, prefill, stall_prompt,
        long_prefill_token_threshold,
    )  # fmt: skip
    with progress() as bar:
        task = bar.add_task("decode points", total=total)
        result = run(say, lambda what: bar.update(task, advance=1, description=what))
    if plot is not None:
        scale.plot_scale(result, plot, force)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    _print_scale(result)
    if plot is not None:
        console.print(printable(f"wrote {plot}"))


def _print_scale(result: dict) -> None:
    """The grid (tokens/s and the share of the bytes bound per format) and the capacity table."""
    names = list(result["footprint"])
    bw = result["read_bandwidth"]["used"]
    t = Table(title=printable(
        f"{result['model']}: decode tokens/s (share of the bytes bound at {bw / 1e9:.1f} GB/s)"
    ))  # fmt: skip
    for col in ("context", "batch", *names):
        t.add_column(col, justify="right")
    for r in result["grid"]:
        tps, bound = r.get("tokens_per_second", {}), r.get("bound", {})
        t.add_row(str(r["context"]), str(r["batch"]), *[
            f"{tps[n]:.1f} ({bound[n]['share_of_bound']:.0%})" if n in tps else "over memory"
            for n in names
        ])  # fmt: skip
    console.print(t)
    c = Table(title=printable(
        f"capacity at {result['budget']} of KV: batch held, aggregate tokens/s, vs auto"
    ))  # fmt: skip
    for col in ("context", *names):
        c.add_column(col, justify="right")
    for r in result["capacity"]:
        tps, vs = r.get("tokens_per_second", {}), r.get("vs_auto", {})
        c.add_row(str(r["context"]), *[
            f"{r['batch'][n]} x, {tps[n]:.1f}" + (f", {vs[n]:.2f}x" if n in vs else "")
            if n in tps else "0 (nothing fits)"
            for n in names
        ])  # fmt: skip
    console.print(c)
    if result["left_out_contexts"]:
        console.print(printable(
            f"left out (over the position limit {result['position_limit']}): "
            f"{', '.join(map(str, result['left_out_contexts']))}"
        ))  # fmt: skip
    if "prefill" in result:
        _print_prefill(result["prefill"], names)
    load = result["loadavg"]
    console.print(printable(
        f"kernels {result['kernels']}; load average before {load['before']}, after "
        f"{load['after']}; weights {', '.join(f'{n}: {w}' for n, w in result['weights'].items())}"
    ))  # fmt: skip


def _print_prefill(pre: dict, names: list[str]) -> None:
    """Time to first token per context, and the decoding streams' delay beside a long prompt."""
    t = Table(title=printable(
        f"prefill in chunks of {pre['chunk']} tokens: seconds to the first token (tokens/s)"
    ))  # fmt: skip
    for col in ("prompt", *names):
        t.add_column(col, justify="right")
    for r in pre["prefill"]:
        t.add_row(str(r["context"]), *[
            f"{r['seconds'][n]:.2f} ({r['tokens_per_second'][n]:.0f})" for n in names
        ])  # fmt: skip
    console.print(t)
    for n in names:
        s = pre["stall"][n]
        console.print(printable(
            f"{n}: {pre['streams']} streams' inter-token p99 {s['quiet_p99_ms']:.1f} ms alone, "
            f"{s['admitting_p99_ms']:.1f} ms while a {pre['stall_tokens']}-token prompt is "
            f"admitted, {s['after_p99_ms']:.1f} ms alone after it at their longer contexts "
            f"({s['ratio']:.2f}x that; {s['ratio_to_start']:.2f}x the first; its first token "
            f"after {s['long_prompt_seconds']:.1f} s, long-prefill token threshold "
            f"{pre['long_prefill_token_threshold']})"
        ))  # fmt: skip
