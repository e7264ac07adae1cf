"""The ``tqexport bench`` commands: parsing and tables; :mod:`tqexport.bench.matrix` runs them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tqexport import validate
from tqexport.bench import matrix
from tqexport.bench.scale_command import bench_scale
from tqexport.console import console, err, progress
from tqexport.errors import TQExportError
from tqexport.options import (
    CalibrationOption,
    Command,
    SkipOption,
    WeightsOption,
    given,
)
from tqexport.spec import BuildRequest
from tqexport.spec.request import DEFAULT_WEIGHTS
from tqexport.validate import DEFAULT_KV_CACHE_MEMORY, printable

bench_app = typer.Typer(
    help="Quality (perplexity, KL, top-1 vs llama.cpp) and speed benchmarks.",
    no_args_is_help=True,
)


def _say(what: str) -> None:
    err.print(printable(what))


def score_quality(target, configs, text_file, chunk, chunks, peer: bool, weights=DEFAULT_WEIGHTS):
    """Ours (with a progress bar) and the llama.cpp peer: (ours, peer result, peer note)."""
    with progress() as bar:
        task = bar.add_task("tqexport: scoring chunks", total=None)
        return matrix.run_quality(
            target, configs, text_file, chunk, chunks, peer,
            lambda done, total: bar.update(task, completed=done, total=total), _say,
            weights=weights,
        )  # fmt: skip


@bench_app.command("quality", cls=Command)
def bench_quality(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="MODEL (HF dir, .gguf, built-in) or artifact DIR.")],
    kv_cache_dtype: Annotated[
        list[str] | None,
        typer.Option(help="kv dtypes to score (repeatable or comma-separated; default: all)."),
    ] = None,
    boundary: Annotated[
        str, typer.Option(help="TurboQuant boundary protection: on, off or both.")
    ] = "both",
    skip_layers: SkipOption = None,
    recent_window: Annotated[
        str, typer.Option(help="--kv-recent-window values to score, e.g. 0,32,128.")
    ] = "0",
    sink_tokens: Annotated[
        str,
        typer.Option(
            "--kv-sink-tokens",
            help="Sink-token counts to score with every recent window > 0, e.g. 0,4.",
        ),
    ] = "0",
    kv_scales: Annotated[
        str, typer.Option(help="fp8/nvfp4 per-layer scales: a number, or calibrate (as build).")
    ] = "1.0",
    key_transform: Annotated[
        str,
        typer.Option(
            "--kv-key-transform",
            help="Key transforms to score on tqx_* TurboQuant dtypes, comma-separated, each "
            "none or kinds joined by + (e.g. none,center,center+smooth+signs).",
        ),
    ] = "none",
    kv_layers: Annotated[
        list[str] | None,
        typer.Option(
            "--kv-layers",
            help="Per-layer caches to score instead of whole dtypes, one configuration per "
            "value (repeatable): RANGE:DTYPE[:wN][:sN] joined by commas, as plan and build.",
        ),
    ] = None,
    kv_bits: Annotated[
        str | None,
        typer.Option(
            "--kv-bits",
            help="Budgets to score, e.g. 3.5,3.0: each layer's cache chosen from the calibration "
            "table (as plan and build), shown with its predicted KL.",
        ),
    ] = None,
    calibration: CalibrationOption = None,
    chunk: Annotated[int, typer.Option(help="Tokens per evaluation window.")] = 1024,
    chunks: Annotated[int, typer.Option(help="Windows scored (from the text's start).")] = 4,
    text_file: Annotated[
        Path | None, typer.Option(help="Evaluate on this UTF-8 text instead of pydoc topics.")
    ] = None,
    peer: Annotated[bool, typer.Option(help="Also run llama.cpp's f16/q8_0/q4_0 caches.")] = True,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Perplexity, KL and top-1 agreement per kv-cache configuration, through the paged caches
    (every run on the weights ``build --weights`` stores, dequantized)."""
    from tqexport.bench.quality import with_deltas

    validate.integer(chunk, "--chunk", 2, matrix.MAX_BENCH_CHUNK)
    validate.integer(chunks, "--chunks", 1, matrix.MAX_BENCH_CHUNKS)
    if given(ctx, "weights") and matrix.is_artifact(target):
        raise TQExportError(
            f"--weights has no effect when TARGET is an artifact ({target} runs on the weights "
            "it stores); drop it, or give a model"
        )
    if text_file is not None:
        validate.regular_file(text_file, "--text-file", "a text file", "give a UTF-8 text file")
    configs = matrix.quality_configs(
        kv_cache_dtype,
        boundary,
        skip_layers,
        recent_window,
        kv_scales,
        key_transform,
        sink_tokens,
        kv_layers,
    )
    if kv_layers and not matrix.is_artifact(target):
        from tqexport.export.artifact_build import check_request

        for c in configs:  # resolved from the config alone: nothing loads for a bad range
            check_request(target, c.request)
    if kv_bits is not None:
        others = {
            "--kv-layers": kv_layers, "--kv-cache-dtype": kv_cache_dtype,
            "--skip-layers": skip_layers, "--recent-window": recent_window != "0",
            "--kv-sink-tokens": sink_tokens != "0",
            "--kv-scales": kv_scales != "1.0", "--boundary": boundary != "both",
        }  # fmt: skip
        configs = _budget_configs(target, kv_bits, calibration, others, key_transform)
    elif calibration is not None:
        raise TQExportError("--calibration is read only by --kv-bits; add --kv-bits or drop it")
    ours, peer_result, note = score_quality(
        target, configs, text_file, chunk, chunks, peer, weights
    )
    rows = with_deltas(ours, peer_result)
    if as_json:
        print(json.dumps({"quality": ours, "peer": peer_result, "peer_note": note,
                          "rows": rows}, indent=2))  # fmt: skip
        return
    print_quality(ours, rows, note)


def _budget_configs(target, kv_bits, calibration, others: dict, key_transform: str = "none"):
    """One configuration per ``--kv-bits`` budget, each layer's cache chosen by the knapsack
    (keys under ``key_transform``, the one the table was measured under); ``others`` maps each
    option the budget would override to whether it was given."""
    from tqexport.bench.quality import Config
    from tqexport.kvplan import kv_budget
    from tqexport.kvquant.transforms import parse_key_transform
    from tqexport.models.config import describe_model

    kv_budget.conflicts(kv_bits, {flag: bool(v) for flag, v in others.items()})
    if "," in key_transform:
        raise TQExportError(
            f"--kv-bits scores one --kv-key-transform (the calibration table's), got "
            f"{key_transform}; give one"
        )
    kinds = parse_key_transform(key_transform)
    budgets = [kv_budget.check_budget(x) for x in validate.comma_list(kv_bits, "--kv-bits")]
    if matrix.is_artifact(target):
        raise TQExportError("--kv-bits needs a MODEL to choose caches for, not an artifact")
    desc = describe_model(target)
    configs = []
    for b in budgets:
        choice, _ = kv_budget.budget_plan(target, desc, b, calibration, _say, kinds)
        _say(f"--kv-bits {b:g}: --kv-layers {choice.kv_layers} "
             f"({float(choice.bits_per_element):.4f} bits per element)")  # fmt: skip
        request = BuildRequest(kv_layers=choice.kv_layers, key_transform=kinds)
        configs.append(Config(request, kv_bits=b, predicted_kl=choice.predicted_cost))
    return configs


def print_quality(ours: dict, rows: list[dict], note: str | None) -> None:
    """A ``bench quality`` run's table (ours, then the peer's rows) and its notes."""
    c = ours["chunking"]
    t = Table(
        title=printable(
            f"{ours['model']} ({ours['weights']} weights): {c['chunks']} x {c['chunk_tokens']} "
            f"tokens of {ours['text']['name']} (sha256 {ours['text']['sha256'][:12]})"
        )
    )
    for col in ("tool", "configuration", "bits/elem", "PPL", "vs own baseline", "KL", "top-1"):
        t.add_column(col, justify="left" if col in ("tool", "configuration") else "right")
    for r in rows:
        t.add_row(
            r["tool"], r["label"], f"{r['bits_per_element']:.2f}", f"{r['ppl']:.4f}",
            f"{r['ppl_delta_pct']:+.2f}%", f"{r.get('kl', 0):.5f}",
            f"{100 * r.get('top1', 1):.2f}%",
        )  # fmt: skip
    console.print(t)
    console.print(
        "bits/elem: all in, unquantized layers counted at 16 bits; KL = KL(baseline || run)",
    )
    for r in rows:
        if r.get("predicted_kl") is not None:
            console.print(
                printable(
                    f"{r['label']}: --kv-layers {r['kv_layers']}; KL predicted "
                    f"{r['predicted_kl']:.5f} (sum of calibrated layer costs), measured "
                    f"{r.get('kl', 0):.5f}"
                )
            )
    if note:
        err.print(printable(f"llama.cpp peer {note}"))


@bench_app.command("speed", cls=Command)
def bench_speed(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Argument(help="MODEL (artifacts built per dtype) or artifact DIR.")
    ],
    kv_cache_dtype: Annotated[
        list[str] | None, typer.Option(help="kv dtypes (default: auto, fp8, turboquant_4bit_nc).")
    ] = None,
    contexts: Annotated[
        str, typer.Option(help="Context lengths, comma-separated.")
    ] = "256,1024,4096",
    batches: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,8",
    steps: Annotated[int, typer.Option(help="Timed decode steps per point.")] = 4,
    budget: Annotated[
        str, typer.Option(help="KV budget for the resident-token column.")
    ] = DEFAULT_KV_CACHE_MEMORY,
    workdir: Annotated[Path, typer.Option(help="Where MODEL's artifacts are built.")] = Path(
        "out/bench"
    ),
    recent_window: Annotated[
        str, typer.Option(help="--kv-recent-window values per quantized dtype, e.g. 0,32.")
    ] = "0",
    kernels: Annotated[
        str,
        typer.Option(
            help="Kernel choices to measure every configuration under, comma-separated: "
            "native, bodies, auto (native when the native kernels serve every artifact, else "
            "bodies); labels say which ran, e.g. fp8 [native]."
        ),
    ] = "auto",
    weights: WeightsOption = DEFAULT_WEIGHTS,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Decode tokens/s vs context and batch per kv dtype on ONNX Runtime CPU; KV memory."""
    if matrix.is_artifact(target):
        for name in ("kv_cache_dtype", "recent_window", "weights"):
            if given(ctx, name):
                raise TQExportError(
                    f"--{name.replace('_', '-')} has no effect when TARGET is an artifact "
                    f"({target}, compared with auto as built); drop it, or give a model to "
                    "build per dtype"
                )
    speed = matrix.run_speed(
        target, kv_cache_dtype, contexts, batches, steps, budget, workdir, _say, recent_window,
        kernels, weights,
    )  # fmt: skip
    if as_json:
        print(json.dumps(speed, indent=2))
        return
    print_speed(speed)


bench_app.command("scale", cls=Command)(bench_scale)


def print_speed(speed: dict) -> None:
    """A ``bench speed`` run's decode table (a row per kernel choice), what ran, its weights
    and KV memory."""
    from tqexport.bench.speed_table import speed_notes, speed_table

    header, rows = speed_table(speed)
    t = Table(title="decode on ONNX Runtime CPU (ratios measured in the same run)")
    for col in header:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*r)
    console.print(t)
    for note in speed_notes(speed):
        console.print(printable(note))
    if speed.get("weights"):
        kinds = ", ".join(f"{n}: {w}" for n, w in speed["weights"].items())
        console.print(printable(f"weights: {kinds}"))
    m = Table(title=printable(f"KV memory at a {speed['budget']} budget"))
    for col in ("kv dtype", "KV bytes/token", "resident tokens", "vs auto", "bytes ratio"):
        m.add_column(col, justify="right")
    for x in speed["memory"]:
        m.add_row(
            x["label"], str(x["kv_bytes_per_token"]), str(x["resident_tokens"]),
            f"{x['resident_vs_auto']:.3f}x", f"{x['bytes_ratio_auto_over_this']:.3f}x",
        )  # fmt: skip
    console.print(m)
