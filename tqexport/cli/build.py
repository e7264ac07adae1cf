"""``tqexport build``: export a model with per-layer KV caches, and show what was built."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tqexport.cli.common import build_request
from tqexport.console import console, err, fmt_bytes, run_in_stages, warn
from tqexport.options import (
    BlockSizeOption,
    BoundaryOption,
    CalibrationOption,
    KeyTransformOption,
    KvBitsOption,
    KvDtypeOption,
    KvLayersOption,
    RecentWindowOption,
    SinkTokensOption,
    SkipOption,
    WeightsOption,
)
from tqexport.spec.request import DEFAULT_KV_SCALES, DEFAULT_OPSET, DEFAULT_WEIGHTS, MAX_BUILD_OPSET
from tqexport.validate import DEFAULT_BLOCK_SIZE, printable


def build(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="HF dir, .gguf, or built-in name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Artifact directory to create.")],
    kv_cache_dtype: KvDtypeOption = "auto",
    kv_layers: KvLayersOption = None,
    kv_bits: KvBitsOption = None,
    calibration: CalibrationOption = None,
    skip_layers: SkipOption = None,
    boundary: BoundaryOption = True,
    block_size: BlockSizeOption = DEFAULT_BLOCK_SIZE,
    recent_window: RecentWindowOption = 0,
    sink_tokens: SinkTokensOption = 0,
    key_transform: KeyTransformOption = "none",
    dtype: Annotated[
        str | None,
        typer.Option(help="float32 | float16 | bfloat16 (bf16 is a GPU target). Default: float32."),
    ] = None,
    opset: Annotated[
        int, typer.Option(help=f"ONNX opset ({DEFAULT_OPSET}..{MAX_BUILD_OPSET}).")
    ] = DEFAULT_OPSET,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact directory.")] = False,
    kv_scales: Annotated[
        str,
        typer.Option(
            help="fp8/nvfp4 per-layer scales: a number (1.0, vLLM's default) or calibrate."
        ),
    ] = DEFAULT_KV_SCALES,
    calibration_text: Annotated[
        Path | None,
        typer.Option(
            help="Text file for --kv-scales calibrate and --kv-key-transform (default: pydoc "
            "topics)."
        ),
    ] = None,
):
    """Export MODEL with per-layer KV caches: model.onnx + tqexport.json + tokenizer."""
    from tqexport.export.artifact_build import build_artifact
    from tqexport.export.outdir import check_target

    check_target(out, force)  # before --kv-bits measures a table
    request = build_request(ctx, model, dtype=dtype or "float32", opset=opset, weights=weights,
                             kv_scales=kv_scales, calibration_text=calibration_text)  # fmt: skip
    labels = {
        "load": "loading weights",
        "calibrate": "calibrating",
        "export": "exporting ONNX",
        "save": "saving",
    }
    result = run_in_stages(labels, lambda stage: build_artifact(model, out, request, stage, force))
    for w in result.warnings:
        warn(w)
    if result.replaced:
        console.print(printable(f"replaced {result.replaced}"), soft_wrap=True)
    spec = result.spec
    if spec.dtype == "bfloat16":
        err.print(
            "note: bfloat16 artifacts are for GPUs; ONNX Runtime's CPU provider has no bf16 MatMul."
        )
    t = Table(title=printable(f"built {result.out_dir}"))
    t.add_column("kv dtype")
    t.add_column("mode")
    t.add_column("layers")
    t.add_column("bytes/token")
    by_dtype: dict[str, list] = {}
    for la in spec.layers:
        by_dtype.setdefault(la.kv_cache_dtype, []).append(la)
    for name, layers in by_dtype.items():
        t.add_row(
            name,
            layers[0].mode.name,
            ",".join(str(la.index) for la in layers),
            str(sum(la.cache.bytes_per_token for la in layers)),
        )
    console.print(t)
    console.print(
        f"KV bytes per token: {spec.bytes_per_token} (all-bf16: {spec.bf16_bytes_per_token}, "
        f"{spec.bf16_bytes_per_token / spec.bytes_per_token:.2f}x); "
        f"artifact size: {fmt_bytes(result.size_bytes)}",
    )
    if spec.weights is not None:
        console.print(
            printable(f"weights: {spec.weights.summary()}; other tensors in {spec.dtype}"),
            soft_wrap=True,
        )
    if spec.recent_window:
        console.print(
            f"recent window: the last {spec.recent_window} tokens of each sequence also kept in "
            f"{spec.dtype}, {spec.recent_bytes_per_token} bytes per token of the window",
        )
    if spec.sink_tokens:
        console.print(
            f"sink tokens: the first {spec.sink_tokens} tokens of each sequence also kept there",
        )
