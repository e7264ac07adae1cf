"""The report command: ``bench quality`` runs (given or run here), a ``bench speed`` run and a
peers run side by side in ``report.md``, PNG plots and ``results.json``, with the goals."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.report import report, speed_report
from tqexport import validate
from tqexport.bench import matrix
from tqexport.bench.commands import print_quality, print_speed, score_quality
from tqexport.bench.speed import parse_kernels
from tqexport.cli.root import run_app
from tqexport.console import console, err
from tqexport.errors import TQExportError
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.options import Command, given
from tqexport.validate import DEFAULT_KV_CACHE_MEMORY, printable

#: how the report is run (its results record the command)
PROG = "python -m benchmarks.report"


def _say(what: str) -> None:
    err.print(printable(what))


def print_goals(goals: list[dict]) -> None:
    """Each goal with its verdict: met, not met, or not measured."""
    for g in goals:
        verdict = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[g["met"]]
        console.print(printable(f"{g['goal']}: {verdict} ({g['detail']})"))


def report_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="MODEL (HF dir, .gguf, built-in).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Report directory.")],
    chunks: Annotated[int, typer.Option(help="Quality windows of 1024 tokens.")] = 8,
    contexts: Annotated[str, typer.Option(help="Decode context lengths.")] = "256,1024,4096",
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,8",
    workdir: Annotated[Path, typer.Option(help="Where the speed artifacts are built.")] = Path(
        "out/bench"
    ),
    quality_json: Annotated[
        list[Path] | None,
        typer.Option(
            help="Reuse `bench quality MODEL --json` outputs (repeatable) instead of rerunning; "
            "parts scored on other windows than the first (e.g. --chunk 4096) get sections of "
            "their own."
        ),
    ] = None,
    peer_speed_json: Annotated[
        Path | None,
        typer.Option(
            help="Add a `benchmarks/peers_speed.py --json` run (tqexport against ONNX Runtime "
            "GenAI and llama.cpp): its section, plot and goals."
        ),
    ] = None,
    speed_json: Annotated[
        Path | None,
        typer.Option(
            help="Reuse the speed section of a report's results.json instead of measuring it "
            "again (regenerating a report from new quality runs)."
        ),
    ] = None,
    kernels: Annotated[
        str,
        typer.Option(
            help="Kernel choices of the speed section (as `bench speed --kernels`); auto,bodies "
            "measures the native kernels against the function bodies where they are built."
        ),
    ] = "auto,bodies",
    force: Annotated[bool, typer.Option(help="Replace the report already in OUT.")] = False,
):
    """Quality + speed side by side: report.md, PNG plots and results.json in OUT.

    Quality: every kv dtype (TurboQuant with and without boundary protection) against
    llama.cpp, then the TurboQuant presets with recent windows 32 and 128. Speed: auto, fp8
    and turboquant_4bit_nc, the last also with a 32-token recent window."""
    validate.integer(chunks, "--chunks", 1, matrix.MAX_BENCH_CHUNKS)
    report.check_out(out, force)
    if quality_json and given(ctx, "chunks"):
        raise TQExportError(
            "--chunks has no effect with --quality-json (its quality runs are reused as they "
            "are); drop one"
        )
    matrix.speed_args(contexts, batches, 4, "0,32")
    parse_kernels(kernels)
    peer_speed = None
    if peer_speed_json is not None:
        validate.regular_file(peer_speed_json, "--peer-speed-json", "a JSON file")
        try:
            peer_speed = speed_report.read_peer_speed(peer_speed_json)
        except (OSError, ValueError):
            raise TQExportError(
                f"--peer-speed-json {peer_speed_json} is not the output of "
                "`benchmarks/peers_speed.py --json`"
            ) from None
    if speed_json is not None:
        validate.regular_file(speed_json, "--speed-json", "a JSON file")
        try:
            kept = json.loads(speed_json.read_text())["speed"]
            kept["decode"]
        except (OSError, ValueError, KeyError, TypeError):
            raise TQExportError(
                f"--speed-json {speed_json} is not a report's results.json with a speed section"
            ) from None
        run_speed = lambda say: kept  # noqa: E731 - the section as it was measured
    else:
        run_speed = matrix.plan_speed(  # checked before the quality runs
            model, None, contexts, batches, 4, DEFAULT_KV_CACHE_MEMORY, workdir, "0,32", kernels
        )
    if quality_json:
        parts = []
        for path in quality_json:
            try:
                parts.append(json.loads(path.read_text()))
                parts[-1]["quality"]["model"]
            except (OSError, ValueError, KeyError, TypeError):
                raise TQExportError(
                    f"--quality-json {path} is not the output of `bench quality --json`"
                ) from None
    else:
        tq = [n for n in matrix.BENCH_DTYPES if parse_kv_cache_dtype(n).is_turboquant]
        parts = []
        for configs, peer in (
            (matrix.quality_configs(None, "both", None), True),
            (matrix.quality_configs(tq, "both", None, "32,128"), False),
        ):
            ours, peer_result, note = score_quality(model, configs, None, 1024, chunks, peer)
            parts.append({"quality": ours, "peer": peer_result, "peer_note": note})
    first, *windows = [report.quality_section(g, model) for g in report.split_by_chunking(parts)]
    ours, peer_result, note, rows = (first[k] for k in ("quality", "peer", "peer_note", "rows"))
    speed = run_speed(_say)
    results = {
        "model": model,
        "command": f"{PROG} " + " ".join(sys.argv[1:]),
        "machine": report.machine(),
        "quality": ours,
        "peer": peer_result,
        "peer_note": note,
        "rows": rows,
        "quality_windows": windows,
        "speed": speed,
        "peer_speed": peer_speed,
        "goals": report.goals(rows, speed, windows, peer_speed),
    }
    files = report.write(out, results)
    print_quality(ours, rows, note)
    for sec in windows:
        print_quality(sec["quality"], sec["rows"], sec["peer_note"])
    print_speed(speed)
    print_goals(results["goals"])
    console.print(printable("wrote " + ", ".join(str(f) for f in files)))


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(cls=Command)(report_command)


def main(argv: list[str] | None = None) -> None:
    """User and usage errors: one line on stderr, exit code 2 (as ``tqexport``'s)."""
    run_app(app, argv, PROG)
