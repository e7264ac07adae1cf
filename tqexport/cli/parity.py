"""``tqexport parity``: an artifact on ONNX Runtime against the torch reference, as tables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from tqexport.cli.common import ENGINE
from tqexport.console import console, ok_text
from tqexport.options import KernelsOption


def parity(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    steps: Annotated[int, typer.Option(help="Decode steps after the prefill.")] = 4,
    prompt_len: Annotated[int, typer.Option(help="Longest prompt; others are shorter.")] = 24,
    batch: Annotated[int, typer.Option(help="Number of sequences.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed for the random prompts.")] = 0,
    kernels: KernelsOption = ENGINE.kernels,
):
    """Run the artifact on ONNX Runtime and the torch reference side by side; exit 1 on mismatch."""
    from tqexport.contract.artifact import open_artifact
    from tqexport.verify.parity import check_options, check_position_limit, run_parity

    check_options(steps, prompt_len, batch, seed, kernels)
    art = open_artifact(artifact)
    check_position_limit(art, steps, prompt_len)
    report = run_parity(art, steps, prompt_len, batch, seed, kernels=kernels)
    console.print(f"ONNX Runtime runs the layers on {report.kernels}")
    judged = "judged" if report.logits_judged else "not judged: quantized layers, see per-layer"
    t = Table(title=f"end-to-end logits, ONNX Runtime vs torch reference ({judged})")
    for col in ("step", "max abs err", "detail", f"within {report.logits_tolerance:g}"):
        t.add_column(col)
    for c in report.logits:
        t.add_row(c.what, f"{c.max_abs:.2e}", c.detail, ok_text(c.ok))
    console.print(t)
    bad = [c for c in report.layers if not c.ok]
    t = Table(title="per layer: reference ops on ORT's own q/k/v (cache bytes, attention)")
    for col in ("check", "max abs err", "detail", "ok"):
        t.add_column(col)
    last_step = [c for c in report.layers if c.what.startswith(report.logits[-1].what + " ")]
    for c in bad or last_step:
        t.add_row(c.what, f"{c.max_abs:.2e}", c.detail, ok_text(c.ok))
    console.print(t)
    console.print(
        f"{len(report.layers) - len(bad)}/{len(report.layers)} layer-steps agree "
        f"({'showing failures' if bad else 'showing the last step'})"
    )
    console.print(Text.assemble("parity: ", ("PASS", "green") if report.ok else ("FAIL", "red")))
    if not report.ok:
        raise typer.Exit(1)
