"""``tqexport engine``: build a TensorRT engine (engine.plan) into an artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tqexport import validate
from tqexport.console import console, fmt_bytes
from tqexport.validate import printable


def engine(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    max_batch: Annotated[
        int, typer.Option(help="Most sequences per step.")
    ] = validate.DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Most tokens per step.")
    ] = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_blocks: Annotated[int, typer.Option(help="Most cache blocks per layer.")] = 4096,
):
    """Build a TensorRT engine (engine.plan) into ARTIFACT: needs tensorrt>=10.9 and a GPU."""
    from tqexport.export.tensorrt_engine import build_engine, check_sizes

    check_sizes(max_batch, max_num_batched_tokens, max_blocks)
    out = build_engine(artifact, max_batch, max_num_batched_tokens, max_blocks)
    console.print(printable(f"wrote {out} ({fmt_bytes(out.stat().st_size)})"))
