"""``tqexport calibrate``: measure each candidate cache's cost per layer (the --kv-bits table)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tqexport.console import console, progress
from tqexport.kvplan.calibration import DEFAULT_CANDIDATES, DEFAULT_TOKENS
from tqexport.safe_files import check_output_file
from tqexport.validate import printable


def calibrate(
    model: Annotated[str, typer.Argument(help="HF dir, .gguf, or built-in name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="The table file (JSON) to write.")],
    candidates: Annotated[
        str | None,
        typer.Option(
            help="Caches to measure, DTYPE[:wN][:sN] joined by commas (auto is always one). "
            f"Default: {','.join(DEFAULT_CANDIDATES)}."
        ),
    ] = None,
    tokens: Annotated[int, typer.Option(help="Calibration tokens scored per measurement.")] = (
        DEFAULT_TOKENS
    ),
    calibration_text: Annotated[
        Path | None,
        typer.Option(help="Calibration text (default: the held-out pydoc topics)."),
    ] = None,
    key_transform: Annotated[
        str,
        typer.Option(
            "--kv-key-transform",
            help="Measure under this key transform (fitted on the calibration text), for "
            "--kv-bits builds with the same one: the tqx_* candidates take it, the others "
            "(fp8) keep plain keys.",
        ),
    ] = "none",
    force: Annotated[bool, typer.Option(help="Replace an existing table file.")] = False,
):
    """Measure what each candidate cache costs in each layer (KL of the next-token distribution
    with only that layer changed) and write the table `--kv-bits` reads."""
    from tqexport.kvplan import calibration as cal
    from tqexport.kvquant.transforms import parse_key_transform

    kinds = parse_key_transform(key_transform)
    cands = cal.check_options(candidates, tokens, calibration_text)
    check_output_file(out, force)
    from tqexport.models.config import describe_model

    desc = describe_model(model)
    cal.check_transform(desc, cands, kinds)
    with progress() as bar:
        task = bar.add_task("calibrating", total=len(desc.layers) * len(cands))
        table = cal.measure(model, cands, calibration_text, tokens,
                            lambda done, total: bar.update(task, completed=done),
                            kinds)  # fmt: skip
    table.write(out, force)
    t = Table(title=printable(f"{desc.name}: mean KL per prediction, only that layer changed"))
    t.add_column("layer")
    for c in cands:
        t.add_column(c, justify="right")
    for pos, row in enumerate(table.cost):
        t.add_row(str(pos), *(f"{x:.2e}" for x in row))
    console.print(t)
    console.print(
        printable(
            f"{len(table.cost)} layers x {len(cands)} candidates"
            + (f" (keys {table.key_transform})" if kinds else "")
            + f" on {table.text['tokens']} tokens "
            f"of {table.text['name']} in {table.elapsed_seconds:.0f} s; wrote {out}"
        )
    )
